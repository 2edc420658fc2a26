r"""Writes a text as nanoGPT's character-level dataset: train.bin, val.bin, meta.pkl.

The same files nanoGPT's ``data/shakespeare_char/prepare.py`` writes, from a
local text instead of a download: the vocabulary is the sorted set of the
text's characters, the first 90% of the characters train and the last 10%
validate, ids are ``uint16``. These are exactly the ids and the split that
``examples/gpt/data.py`` (``CharDataset.from_text``) makes from the same
text, so nanoGPT and the example train on the same data.

  python -m benchmarks.common.nanogpt_prep --data_path=input.txt \
      --out_dir=/tmp/nanogpt_data/stdlib_char

Without ``--data_path`` the text is the example's default corpus, this
Python's standard-library sources. ``benchmarks/nanogpt_cpu.py`` calls
:func:`prepare`, and :func:`nanogpt_versions` for the versions it runs
nanoGPT with; nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

from examples.gpt import data as data_lib


def load_text(data_path: Optional[str]) -> str:
  """The text at ``data_path`` (UTF-8), or the example's standard-library corpus."""
  if data_path is None:
    return data_lib.stdlib_corpus()
  with open(data_path, encoding="utf-8") as f:
    return f.read()


def prepare(text: str, out_dir: str) -> dict[str, Any]:
  """Writes ``train.bin``, ``val.bin`` and ``meta.pkl`` for ``text`` to ``out_dir``.

  Args:
    text: the whole corpus.
    out_dir: the dataset folder nanoGPT reads (``data/<dataset>``); created.

  Returns:
    ``{"vocab_size", "train_tokens", "val_tokens"}``.

  Example:
    >>> prepare(open("input.txt").read(), "/tmp/data/my_char")  # doctest: +SKIP
    {'vocab_size': 65, 'train_tokens': 1003854, 'val_tokens': 111540}
  """
  dataset = data_lib.CharDataset.from_text(text)
  if dataset.vocab_size > np.iinfo(np.uint16).max + 1:
    raise ValueError(f"The text has {dataset.vocab_size} distinct characters; "
                     "nanoGPT's uint16 ids hold at most 65536.")
  os.makedirs(out_dir, exist_ok=True)
  dataset.train.astype(np.uint16).tofile(os.path.join(out_dir, "train.bin"))
  dataset.valid.astype(np.uint16).tofile(os.path.join(out_dir, "val.bin"))
  meta = {"vocab_size": dataset.vocab_size,
          "itos": dict(enumerate(dataset.chars)),
          "stoi": {c: i for i, c in enumerate(dataset.chars)}}
  with open(os.path.join(out_dir, "meta.pkl"), "wb") as f:
    pickle.dump(meta, f)
  return {"vocab_size": dataset.vocab_size, "train_tokens": len(dataset.train),
          "val_tokens": len(dataset.valid)}


def nanogpt_versions(args) -> dict[str, Any]:
  """torch's version and threads, from the user's Python; checks it runs."""
  code = ("import json, platform, torch, numpy; print(json.dumps({'python': "
          "platform.python_version(), 'torch': torch.__version__, 'numpy': "
          "numpy.__version__, 'torch_threads': torch.get_num_threads()}))")
  done = subprocess.run([args.nanogpt_python, "-c", code], capture_output=True,
                        text=True, check=False)
  if done.returncode:
    sys.exit(f"error: --nanogpt_python={args.nanogpt_python!r} cannot import torch "
             f"and numpy: {done.stderr.strip().splitlines()[-1:]}; pass a Python "
             "with both (e.g. a venv with `pip install torch numpy`).")
  versions = json.loads(done.stdout.strip().splitlines()[-1])
  head = Path(args.nanogpt_dir) / ".git"
  if head.exists():
    rev = subprocess.run(["git", "-C", args.nanogpt_dir, "rev-parse", "HEAD"],
                         capture_output=True, text=True, check=False)
    versions["nanogpt_commit"] = rev.stdout.strip() or None
  return versions


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("--data_path", default=None,
                      help="a UTF-8 text (default: the standard-library corpus)")
  parser.add_argument("--out_dir", required=True, help="the dataset folder to write")
  args = parser.parse_args(argv)
  info = prepare(load_text(args.data_path), args.out_dir)
  print(f"wrote {args.out_dir}: vocab {info['vocab_size']}, "
        f"{info['train_tokens']:,} train and {info['val_tokens']:,} val tokens")


if __name__ == "__main__":
  main()
