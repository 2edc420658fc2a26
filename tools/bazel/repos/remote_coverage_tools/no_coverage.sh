#!/bin/sh
echo "bazel coverage is not available offline (tools/bazel/repos/README);" \
  "run: python -m pytest --cov=stacktools tests (needs pytest-cov)" >&2
exit 1
