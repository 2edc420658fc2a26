"""Files of the GPT example: atomic writes, stale temporary files, folder checks.

Every file the example writes (checkpoint.npz, metrics.jsonl, loss.png, the
cached corpus) goes through :func:`atomic_write`: the bytes go to a temporary
file in the same folder, which is flushed to disk and then renamed over the
target. A reader sees the old file or the new one, never a partial one. A run
killed mid-write leaves only a temporary file named ``.<target>.<8 hex>.tmp``
behind; :func:`remove_stale_temp_files` clears those at the next start.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from typing import IO, Any, Callable, Optional

TEMP_SUFFIX = ".tmp"
# readable_folder_problem's answer for a folder that is not there (yet).
MISSING = "does not exist"
# ".<target name>.<8 hex digits>.tmp": hidden, and distinct enough that the
# clean-up never touches a file this module did not make.
_TEMP_PATTERN = re.compile(r"\..+\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX))


def _temp_name(target: str) -> str:
  return f".{target}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def is_temp_file_name(name: str) -> bool:
  """Whether ``name`` (a base name) is one of :func:`atomic_write`'s temporaries."""
  return _TEMP_PATTERN.fullmatch(name) is not None


def _create_temp(folder: str, target: str) -> tuple[int, str]:
  """A new, empty temporary file next to ``target``: ``(fd, path)``."""
  for _ in range(100):
    path = os.path.join(folder, _temp_name(target))
    try:
      # Mode 0o666, which the kernel narrows by the process umask (and the
      # folder's default ACL), so the file ends up with the same mode as one
      # made by open(path, "w"). tempfile.mkstemp would make it 0o600, and the
      # rename would keep that: outputs only their owner can read.
      return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
    except FileExistsError:
      continue
  raise FileExistsError(errno.EEXIST, "No free temporary file name", folder)


def atomic_write(path: str, write_fn: Callable[[IO[Any]], Any],
                 mode: str = "wb") -> str:
  """Writes a file atomically: via a temporary file, fsync and a rename.

  The temporary file lies in the folder of ``path`` (a rename is atomic only
  within one file system) and is removed on any error, KeyboardInterrupt
  included; the old ``path``, if any, is then left as it was.

  Args:
    path: the file to write; its folder must exist.
    write_fn: called once with the open temporary file; writes the contents.
    mode: ``"wb"`` for bytes or ``"w"`` for text (UTF-8).

  Returns:
    ``path``.

  Raises:
    ValueError: a mode other than ``"wb"`` or ``"w"``.
    OSError: the folder is missing or not writable, the disk is full, ...
  """
  if mode not in ("wb", "w"):
    raise ValueError(f"atomic_write(mode={mode!r}): use 'wb' (bytes) or 'w' (UTF-8 text).")
  folder, target = os.path.split(os.path.abspath(path))
  fd, tmp = _create_temp(folder, target)
  try:
    with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
      write_fn(f)
      f.flush()
      # On disk before the rename: after a crash the target is the old file
      # or the whole new one, never a renamed but still empty one.
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.remove(tmp)
    except FileNotFoundError:
      pass
    raise
  return path


def remove_stale_temp_files(folder: str) -> list[str]:
  """Removes the temporary files that killed writes left in ``folder``.

  Only regular files named like :func:`atomic_write`'s temporaries go; call
  this when no write into ``folder`` is under way (at a run's start).

  Args:
    folder: the folder to clean; a missing one holds nothing to clean.

  Returns:
    The base names removed, sorted.
  """
  if not os.path.isdir(folder):
    return []
  removed = []
  with os.scandir(folder) as entries:
    for entry in entries:
      if is_temp_file_name(entry.name) and entry.is_file(follow_symlinks=False):
        try:
          os.remove(entry.path)
        except FileNotFoundError:
          continue
        removed.append(entry.name)
  return sorted(removed)


def _nearest_existing(path: str) -> str:
  """``path`` or its nearest ancestor that exists."""
  # os.path.lexists is False both for a missing name and for one under a
  # file (ENOTDIR), so walk up to the first name that is there.
  while not os.path.lexists(path):
    path = os.path.dirname(path)
  return path


def _not_a_folder(path: str, existing: str) -> Optional[str]:
  """Why ``path`` cannot be a folder, ``existing`` being what of it exists."""
  if os.path.isdir(existing):
    return None
  kind = "a file" if os.path.isfile(existing) else "not a directory"
  if existing == path:
    return "is a file, not a directory" if kind == "a file" else "is not a directory"
  return f"lies under {existing!r}, which is {kind}"


def writable_folder_problem(path: str) -> Optional[str]:
  """What stops writing into the folder ``path`` (creating it if missing).

  Writability is probed by creating and removing a file, since permission
  bits do not tell (root ignores them; a read-only mount ignores them too).
  A missing folder is probed in its nearest existing ancestor, where
  ``os.makedirs`` would create it; nothing is left behind.

  Args:
    path: the folder.

  Returns:
    None if the folder can be written, else the rest of a sentence that
    begins with the folder's name, e.g. ``"is a file, not a directory"``.
  """
  path = os.path.abspath(path)
  existing = _nearest_existing(path)
  problem = _not_a_folder(path, existing)
  if problem:
    return problem if existing == path else problem + ", so it cannot be created"
  try:
    fd, probe = _create_temp(existing, "write-probe")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    if existing == path:
      return f"is a directory that cannot be written to ({e.strerror})"
    return (f"does not exist and cannot be created: {existing!r} cannot be "
            f"written to ({e.strerror})")
  return None


def readable_folder_problem(path: str) -> Optional[str]:
  """What stops reading the folder ``path``, which must exist.

  Args:
    path: the folder.

  Returns:
    None if it is a folder that can be listed, else the rest of a sentence
    that begins with the folder's name, e.g. :data:`MISSING`.
  """
  path = os.path.abspath(path)
  existing = _nearest_existing(path)
  problem = _not_a_folder(path, existing)
  if problem:
    return problem
  if existing != path:
    return MISSING
  try:
    os.listdir(path)
  except OSError as e:
    return f"cannot be read ({e.strerror})"
  return None
