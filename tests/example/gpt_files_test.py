"""Tests for examples/gpt/files.py: atomic writes, stale temporaries, folder checks.

In this process and fast; the binaries' use of them is in gpt_test.py.
"""

import contextlib
import os

import pytest

from examples.gpt import files

pytestmark = pytest.mark.jax_independent   # see pytest.ini: files, no JAX


@contextlib.contextmanager
def umask(mask: int):
  old = os.umask(mask)
  try:
    yield
  finally:
    os.umask(old)


def mode(path) -> int:
  return os.stat(path).st_mode & 0o777


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_write_gives_the_umask_mode(tmp_path, mask, expected):
  with umask(mask):
    files.atomic_write(str(tmp_path / "a.bin"), lambda f: f.write(b"\x00\x01"))
    files.atomic_write(str(tmp_path / "a.txt"), lambda f: f.write("h\u00e9"), mode="w")
  assert mode(tmp_path / "a.bin") == expected
  assert mode(tmp_path / "a.txt") == expected
  assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
  assert (tmp_path / "a.txt").read_bytes() == "h\u00e9".encode("utf-8")
  assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.txt"]


def test_atomic_write_replaces_and_leaves_no_temporary_on_error(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  files.atomic_write(path, lambda f: f.write("old\n"), mode="w")
  seen = []

  def fail_half_way(f):
    f.write("half of the new")
    seen.extend(os.listdir(tmp_path))
    raise KeyboardInterrupt  # a kill the process survives long enough to clean

  with pytest.raises(KeyboardInterrupt):
    files.atomic_write(path, fail_half_way, mode="w")
  # While it wrote, the temporary was a recognisable sibling of the target.
  temps = [n for n in seen if n != "metrics.jsonl"]
  assert len(temps) == 1 and files.is_temp_file_name(temps[0]), seen
  assert temps[0].startswith(".metrics.jsonl.") and temps[0].endswith(".tmp")
  assert os.listdir(tmp_path) == ["metrics.jsonl"]
  assert (tmp_path / "metrics.jsonl").read_text() == "old\n"
  files.atomic_write(path, lambda f: f.write("new\n"), mode="w")
  assert (tmp_path / "metrics.jsonl").read_text() == "new\n"


def test_atomic_write_rejects_other_modes(tmp_path):
  with pytest.raises(ValueError, match="use 'wb'"):
    files.atomic_write(str(tmp_path / "x"), lambda f: None, mode="a")


def test_remove_stale_temp_files_removes_only_its_own(tmp_path):
  stale = [".checkpoint.npz.0123abcd.tmp", ".loss.png.fedcba98.tmp"]
  others = ["notes.tmp", ".keep.tmp", "checkpoint.npz", ".checkpoint.npz.0123abcd.tmp.bak",
            ".checkpoint.npz.XYZ.tmp"]
  for name in stale + others:
    (tmp_path / name).write_text("x")
  (tmp_path / ".a_folder.00000000.tmp").mkdir()  # not a file: left alone
  assert files.remove_stale_temp_files(str(tmp_path)) == sorted(stale)
  assert sorted(os.listdir(tmp_path)) == sorted(others + [".a_folder.00000000.tmp"])
  assert files.remove_stale_temp_files(str(tmp_path / "missing")) == []


def test_writable_folder_problem(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  assert files.writable_folder_problem(str(tmp_path)) is None
  assert files.writable_folder_problem(str(tmp_path / "new" / "deeper")) is None
  assert files.writable_folder_problem(str(a_file)) == "is a file, not a directory"
  assert files.writable_folder_problem(str(a_file / "sub" / "more")) == (
      f"lies under {str(a_file)!r}, which is a file, so it cannot be created")
  # The probes leave nothing behind.
  assert os.listdir(tmp_path) == ["a_file"]


def test_readable_folder_problem(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  assert files.readable_folder_problem(str(tmp_path)) is None
  assert files.readable_folder_problem(str(tmp_path / "new")) == files.MISSING
  assert files.readable_folder_problem(str(a_file)) == "is a file, not a directory"
  assert files.readable_folder_problem(str(a_file / "sub")) == (
      f"lies under {str(a_file)!r}, which is a file")
