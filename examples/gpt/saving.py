"""Saving a run to disk through Orbax: the step folders, which are
committed, the manager that writes them; and a plain .npz export.

In the library a "checkpoint" is remat (what the backward pass keeps); in the
example it is also a saved step of a run, which is what this module (and
``restoring.py``, which reads the steps back) means by it. A run's saved
steps live in ``<workdir>/checkpoints/``, one folder per step, written by an
Orbax ``CheckpointManager``::

  checkpoints/
    10/                      a committed step
      params/                parameters: Orbax's pytree format (OCDBT + zarr)
      opt_state/             optimizer state, the same format
      meta/metadata          JSON: step, data sampler state, model config, characters
      _CHECKPOINT_METADATA   Orbax's bookkeeping, commit_success.txt
    20/
    30.orbax-checkpoint-tmp  a save under way (or killed): not a checkpoint

Every process writes the shards its own devices hold (no gather to one host)
and restores straight into the shardings of the current mesh, which may be
another mesh than the one that saved. A save is asynchronous: it waits only
for the arrays to be copied off the devices, and training goes on while a
background thread writes them. A step folder is written under a temporary
name and renamed when every process has finished, so a run killed at any
point leaves its last committed step intact; the next start removes the
unfinished folder. ``keep`` rotates old steps away.

``restoring.py`` reads a step back into any mesh, or into a model of another
depth.

Nothing here is read with pickle. :func:`latest` reads the metadata without
JAX, so that ``train.py --resume`` can check it before the processes join.
:func:`export_npz` writes one ``.npz`` of host arrays, readable without Orbax
(``np.load(path, allow_pickle=False)``), with the run's metadata in its
``meta`` entry: :func:`latest` reads an export as a run's latest step, so
that ``sample.py --workdir`` and ``train.py --init_from`` take either
(:func:`is_export` tells them apart by the path).

``import stacktools`` never imports this module, nor Orbax: Orbax is a
dependency of the example only (``pip install -e '.[examples]'``).
"""

from __future__ import annotations

import importlib
import json
import logging as py_logging
import os
from typing import Any
import zipfile

import jax
import numpy as np

from examples.gpt import files


class _Lazy:
  """A module imported at its first use, so that a binary stopping at a flag
  error (train.py imports this module) does not pay for importing Orbax."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str) -> Any:
    return getattr(importlib.import_module(self._name), attr)


ocp = _Lazy("orbax.checkpoint")
epath = _Lazy("etils.epath")

FOLDER = "checkpoints"
#: The entry of an export that holds the run's metadata as JSON: a name no
#: parameter has (theirs are ``module/name``).
EXPORT_META = "meta"
#: What an export's metadata must hold for a reader to rebuild its model.
EXPORT_FIELDS = ("step", "config", "dtype", "chars")
# The suffix of a step folder that is still being written (or never finished).
UNFINISHED_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointError(Exception):
  """A checkpoint is missing, unreadable or does not match the model."""


class OptimizerStateError(CheckpointError):
  """The checkpoint is readable, but its optimizer state is another optimizer's.

  Raised before anything is read: the flags that shape the optimizer state
  (train.py's --optimizer, --freeze_layers, --layer_lr_decay, --grad_clip)
  differ from the run's that wrote it. Nothing is wrong with the files.
  """


class NotFoundError(CheckpointError):
  """There is no committed checkpoint.

  The message only says where none is: what to do about it depends on the
  binary (train.py: drop --resume; sample.py: train first), so the caller
  adds that.
  """


def folder(workdir: str) -> str:
  """Where the step folders of ``workdir`` live."""
  return os.path.join(os.path.abspath(workdir), FOLDER)


def committed_steps(workdir: str) -> list[int]:
  """The committed steps in ``workdir``, ascending; no JAX involved."""
  root = folder(workdir)
  if not os.path.isdir(root):
    return []
  return sorted(ocp.path.step.checkpoint_steps(root))


def unfinished(workdir: str) -> list[str]:
  """Names of the step folders in ``workdir`` that were never committed."""
  root = folder(workdir)
  if not os.path.isdir(root):
    return []
  return sorted(name for name in os.listdir(root) if UNFINISHED_SUFFIX in name)


def one_line(error: BaseException) -> str:
  """An exception's message on one line (tensorstore's span several)."""
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def latest(workdir: str) -> tuple[int, dict[str, Any]]:
  """The latest committed step of ``workdir`` and its metadata.

  Reads the files only, without starting JAX: callable before
  ``jax.distributed.initialize``. Every process of a run reads the same.

  An export (:func:`is_export`) is a run of one step: its own, and the
  metadata :func:`export_npz` wrote into it.

  Raises:
    NotFoundError: no committed step (a half-written one does not count),
      or no export at that path.
    CheckpointError: the latest step's metadata is unreadable, or the file
      is no export.
  """
  if is_export(workdir):
    return read_export(workdir)
  steps = committed_steps(workdir)
  if not steps:
    raise NotFoundError(f"No checkpoint in {folder(workdir)}.")
  step = steps[-1]
  path = os.path.join(folder(workdir), str(step))
  try:
    meta = ocp.JsonCheckpointHandler().restore(epath.Path(path) / "meta")
    if not isinstance(meta, dict) or meta.get("step") != step:
      raise ValueError(f"its metadata says step {meta.get('step') if isinstance(meta, dict) else meta!r}")
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f"{path} is not a readable checkpoint ({one_line(e)}); delete that "
        "folder to resume from the step before, or point --workdir elsewhere.") from None
  return step, meta


class _QuietOrbax(py_logging.Filter):
  """Drops Orbax's INFO lines (a dozen per save) from absl's log."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return record.levelno >= py_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


_QUIET = _QuietOrbax()


def quiet_orbax() -> None:
  py_logging.getLogger("absl").addFilter(_QUIET)  # once: a logger's filters are a set


def _handlers() -> dict[str, Any]:
  return {"params": ocp.StandardCheckpointHandler(),
          "opt_state": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler()}


def path_key(path: tuple[Any, ...]) -> str:
  """A tree path as ``"h/block/fc/w"``: dict keys, attribute names and
  indices joined by ``/``. The same for a namedtuple and the dict Orbax
  reads it back as."""
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)


def flatten(tree: Any) -> dict[str, Any]:
  """``{"h/block/fc/w": leaf, ...}``: the leaves of ``tree`` by :func:`path_key`."""
  return {path_key(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class Manager:
  """Saves one run's checkpoints (``restoring.restore`` reads them); every process makes one.

  Every method is a collective in a multi-process run: every process calls
  it, in the same order.

  Args:
    workdir: the run's folder; checkpoints go to ``<workdir>/checkpoints``.
    keep: how many of the latest steps to keep (older ones are deleted).
    asynchronous: write in a background thread (the default), or block.

  Raises:
    CheckpointError: (several processes) some process does not see the
      folder that process 0 writes.
  """

  def __init__(self, workdir: str, keep: int, asynchronous: bool = True):
    quiet_orbax()
    self.workdir = workdir
    self.root = folder(workdir)
    check_shared(workdir)
    # Left by a run killed while it saved; the manager removes them.
    self.removed_unfinished = unfinished(workdir)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=asynchronous)
    self._manager = ocp.CheckpointManager(self.root, options=options,
                                          item_handlers=_handlers())

  def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
    """Starts saving ``step``; returns once the arrays are off the devices.

    Args:
      step: the step number (the folder's name); ``meta["step"]`` is set to it.
      params, opt_state: (possibly sharded) arrays; each process writes the
        shards it holds.
      meta: JSON-able metadata (sampler state, model config, characters).
    """
    saved = self._manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave({**meta, "step": step})))
    if not saved:  # Orbax skips a step at or below its latest one
      raise CheckpointError(
          f"Orbax did not save step {step} in {self.root}: it holds step "
          f"{self._manager.latest_step()} already.")

  def saving(self) -> bool:
    """Whether a save is still being written (in the background)."""
    return self._manager.is_saving_in_progress()

  def wait(self) -> None:
    """Blocks until the last save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last save, then releases Orbax's threads."""
    self._manager.close()


def check_shared(workdir: str) -> None:
  """Raises CheckpointError unless every process sees the folder process 0 writes.

  Every process writes its shards into ``workdir``, so all of them must pass
  the same folder, on a file system they share. Process 0 writes a probe file
  there, named by a token it broadcasts; every process says whether it sees
  it; then the probe (and the folder, if this made it) goes. A collective:
  every process calls it; with one process it does nothing.
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  token = np.frombuffer(os.urandom(8), np.uint8)
  token = np.asarray(multihost_utils.broadcast_one_to_all(token)).astype(np.uint8)
  probe = os.path.join(os.path.abspath(workdir), f".shared-probe-{token.tobytes().hex()}")
  made = False
  if jax.process_index() == 0:
    made = not os.path.isdir(workdir)
    os.makedirs(workdir, exist_ok=True)
    with open(probe, "wb"):
      pass
  multihost_utils.sync_global_devices("examples/gpt/saving.py: probe written")
  seen = np.asarray(multihost_utils.process_allgather(
      np.asarray([os.path.exists(probe)], np.int32))).reshape(-1)
  blind = [str(i) for i, ok in enumerate(seen) if not ok]
  if jax.process_index() == 0:
    os.remove(probe)
    if blind and made and not any(True for _ in os.scandir(workdir)):
      os.rmdir(workdir)  # the run stops: leave nothing behind
  if blind:
    raise CheckpointError(
        f"process{'es' if len(blind) > 1 else ''} {', '.join(blind)} of "
        f"{jax.process_count()} do{'es' if len(blind) == 1 else ''} not see the "
        f"files that process 0 writes in its --workdir; every process writes its "
        "shards there: pass all of them the same --workdir, on a file system "
        "they share.")


def is_export(path: str) -> bool:
  """Whether ``path`` names an export (:func:`export_npz`'s file) rather than
  a run's folder: a name ending in ``.npz``, or a zip archive (as an .npz
  is), that is no folder. Reads no more than a file's end; no JAX."""
  if os.path.isdir(path):
    return False
  return path.endswith(".npz") or (os.path.isfile(path) and zipfile.is_zipfile(path))


def export_npz(path: str, params: Any, meta: dict[str, Any]) -> str:
  """Writes host ``params`` and the run's ``meta`` to ``path`` as one ``.npz``, atomically.

  Keys are :func:`flatten`'s (``"h/block/fc/w"``: the Haiku module, then the
  parameter), and :data:`EXPORT_META`, ``meta`` as JSON (a 0-d string array:
  :data:`EXPORT_FIELDS`, what a checkpoint's metadata says of the model).
  Read it with :func:`load_npz` and :func:`latest`, or
  ``np.load(path, allow_pickle=False)``.
  """
  arrays = {k: np.asarray(v) for k, v in flatten(params).items()}
  arrays[EXPORT_META] = np.asarray(json.dumps(meta))
  folder_ = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder_, exist_ok=True)
  return files.atomic_write(path, lambda f: np.savez(f, **arrays))


def _npz(path: str) -> Any:
  """``np.load``'s open archive of the export ``path``; CheckpointError
  (NotFoundError where there is none) in one line otherwise."""
  if not os.path.exists(path):
    raise NotFoundError(f"There is no export at {os.path.abspath(path)}.")
  try:
    if not zipfile.is_zipfile(path):
      raise ValueError("not a zip archive")
    return np.load(path, allow_pickle=False)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f"{path} is not an .npz that train.py --export_npz wrote ({one_line(e)}); pass "
        "such a file, or a run's --workdir.") from None


def read_export(path: str) -> tuple[int, dict[str, Any]]:
  """The step and metadata of an export, as :func:`latest` gives a run's.

  Raises:
    NotFoundError: no file at ``path``.
    CheckpointError: unreadable, or without the metadata that
      :func:`export_npz` writes.
  """
  with _npz(path) as data:
    try:
      meta = json.loads(str(data[EXPORT_META])) if EXPORT_META in data.files else None
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"{path}: its {EXPORT_META!r} entry is unreadable "
                            f"({one_line(e)}); export the run again.") from None
  missing = [f for f in EXPORT_FIELDS if not isinstance(meta, dict) or f not in meta]
  if missing:
    raise CheckpointError(
        f"{path} holds no run metadata ({', '.join(missing)} in its {EXPORT_META!r} "
        "entry), so its model cannot be rebuilt: it was not written by train.py "
        "--export_npz (or by an older one); pass the --workdir of the run instead.")
  return meta["step"], meta


def load_npz(path: str) -> dict[str, np.ndarray]:
  """The parameters :func:`export_npz` wrote, without pickle (not its metadata).

  Raises:
    CheckpointError: unreadable, or no such file (NotFoundError).
  """
  with _npz(path) as data:
    try:
      return {k: data[k] for k in data.files if k != EXPORT_META}
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"{path} is not a readable .npz ({one_line(e)}).") from None
