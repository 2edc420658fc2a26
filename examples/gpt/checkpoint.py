"""Checkpoints of the GPT example, through Orbax; and a plain .npz export.

A run's checkpoints live in ``<workdir>/checkpoints/``, one folder per saved
step, written by an Orbax ``CheckpointManager``::

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

:func:`restore_across_depth` reads a checkpoint into a model of another depth
(``st.take_layers`` on the stack's layers, and on the matching rows of the
optimizer state when that is carried over).

Nothing here is read with pickle. :func:`latest` reads the metadata without
JAX, so that ``train.py --resume`` can check it before the processes join.
:func:`export_npz` writes one ``.npz`` of host arrays for inspection without
Orbax (``np.load(path, allow_pickle=False)``).

``import stacktools`` never imports this module, nor Orbax: Orbax is a
dependency of the example only (``pip install -e '.[examples]'``).
"""

from __future__ import annotations

import importlib
import logging as py_logging
import os
import sys
from typing import Any, Optional

import jax
import numpy as np

import stacktools as st
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


def _one_line(error: BaseException) -> str:
  """An exception's message on one line (tensorstore's span several)."""
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def latest(workdir: str) -> tuple[int, dict[str, Any]]:
  """The latest committed step of ``workdir`` and its metadata.

  Reads the files only, without starting JAX: callable before
  ``jax.distributed.initialize``. Every process of a run reads the same.

  Raises:
    NotFoundError: no committed step (a half-written one does not count).
    CheckpointError: the latest step's metadata is unreadable.
  """
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
        f"{path} is not a readable checkpoint ({_one_line(e)}); delete that "
        "folder to resume from the step before, or point --workdir elsewhere.") from None
  return step, meta


class _QuietOrbax(py_logging.Filter):
  """Drops Orbax's INFO lines (a dozen per save) from absl's log."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return record.levelno >= py_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


_QUIET = _QuietOrbax()


def _quiet_orbax() -> None:
  py_logging.getLogger("absl").addFilter(_QUIET)  # once: a logger's filters are a set


def _handlers() -> dict[str, Any]:
  return {"params": ocp.StandardCheckpointHandler(),
          "opt_state": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler()}


def _key(path: tuple[Any, ...]) -> str:
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
  """``{"h/block/fc/w": leaf, ...}``: the leaves of ``tree`` by :func:`_key`."""
  return {_key(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class Manager:
  """Saves one run's checkpoints (:func:`restore` reads them); every process makes one.

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
    _quiet_orbax()
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
  multihost_utils.sync_global_devices("examples/gpt/checkpoint.py: probe written")
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


def restore(workdir: str, step: int, params: Any,
            opt_state: Optional[Any] = None) -> tuple[Any, Any]:
  """Reads ``step`` of ``workdir`` into the structure, shapes and shardings of templates.

  A collective in a multi-process run: every process reads the shards that
  its devices hold under the templates' shardings.

  Args:
    workdir: the run's folder.
    step: a committed step (see :func:`latest`).
    params: ``jax.ShapeDtypeStruct``s with ``sharding`` set: where each
      process puts what it reads (any mesh, not only the one that saved).
    opt_state: the same for the optimizer state, or None to skip it.

  Returns:
    ``(params, opt_state)`` as ``jax.Array``s (``opt_state`` None if skipped).

  Raises:
    CheckpointError: from another model, or unreadable (corrupt, missing files).
  """
  _quiet_orbax()
  step_dir = epath.Path(folder(workdir)) / str(step)
  # When one read fails, Orbax closes its event loop while tensorstore still
  # completes the others, whose callbacks then raise "Event loop is closed"
  # as unraisable exceptions: a traceback after the one-line error; and a
  # read task whose error Orbax never retrieved is logged by asyncio when it
  # is collected, sometimes after that line. Both dropped from here on if the
  # restore fails (the caller exits; the error has been said once).
  previous_hook = sys.unraisablehook
  sys.unraisablehook = _IgnoreClosedLoop(previous_hook)
  asyncio_log = py_logging.getLogger("asyncio")
  asyncio_log.addFilter(_UNRETRIEVED)
  restored = {}
  for item, template in (("params", params), ("opt_state", opt_state)):
    if template is None:
      restored[item] = None
      continue
    handler = ocp.StandardCheckpointHandler()
    try:
      saved = _saved_tree(handler, step_dir / item)
      if item == "params":
        check_matches(str(step_dir), saved, template)
      else:   # another optimizer's state would fail inside Orbax, unnamed
        check_optimizer_state(str(step_dir), saved, template)
      restored[item] = handler.restore(step_dir / item,
                                       args=ocp.args.StandardRestore(template))
    except CheckpointError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f"{step_dir} is not a readable checkpoint ({_one_line(e)}); delete "
          "that folder to resume from the step before, or point --workdir "
          "elsewhere.") from None
    finally:
      handler.close()
  sys.unraisablehook = previous_hook
  asyncio_log.removeFilter(_UNRETRIEVED)
  return restored["params"], restored["opt_state"]


class _UnretrievedTask(py_logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" records."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Task exception was never retrieved")


_UNRETRIEVED = _UnretrievedTask()


class _IgnoreClosedLoop:
  """A ``sys.unraisablehook`` that drops "Event loop is closed" errors."""

  def __init__(self, previous: Any):
    self.previous = previous

  def __call__(self, unraisable: Any) -> None:
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
      return
    self.previous(unraisable)


def _saved_tree(handler: Any, path: Any) -> Any:
  """The saved pytree's metadata (shapes and dtypes) of one item."""
  if not path.is_dir():
    raise FileNotFoundError(f"it has no {path.name}/ folder")
  return handler.metadata(path).tree


def check_matches(path: str, metadata: Any, template: Any) -> None:
  """Raises CheckpointError unless the saved params have the template's
  names, shapes and dtypes (the same model flags)."""
  tree = metadata
  if tree is None:
    raise CheckpointError(f"{path} is not a readable checkpoint (no parameter "
                          "metadata); delete that folder or point --workdir elsewhere.")
  saved = flatten(tree)
  for key, leaf in flatten(template).items():
    if key not in saved:
      raise CheckpointError(
          f"{path} has no parameter {key}: it was written by a different model "
          "or flags (e.g. --num_layers, --stack, --bias). Use the same model "
          "flags, or a new --workdir.")
    entry = saved[key]
    shape, dtype = tuple(entry.shape), np.dtype(entry.dtype)
    if shape != tuple(leaf.shape) or dtype != np.dtype(leaf.dtype):
      raise CheckpointError(
          f"{path}: parameter {key} is {dtype}{list(shape)} but the model needs "
          f"{np.dtype(leaf.dtype)}{list(leaf.shape)}; the model flags differ from "
          "the run that wrote it.")
  extra = sorted(set(saved) - set(flatten(template)))
  if extra:
    raise CheckpointError(
        f"{path} has parameters the model lacks ({', '.join(extra[:3])}"
        f"{', ...' if len(extra) > 3 else ''}): it was written by a different "
        "model or flags (e.g. --num_layers, --stack, --bias). Use the same model "
        "flags, or a new --workdir.")


def check_optimizer_state(path: str, metadata: Any, template: Any) -> None:
  """Raises OptimizerStateError unless the saved optimizer state has the
  template's leaves, shapes and dtypes: the same optimizer, made by the same
  optimizer flags."""
  saved, want = flatten(metadata), flatten(template)
  missing = sorted(set(want) - set(saved))
  extra = sorted(set(saved) - set(want))
  if missing:
    detail = f"it has no {missing[0]}, which this run's optimizer keeps"
  elif extra:
    detail = f"it has {extra[0]}, which this run's optimizer does not keep"
  else:
    detail = ""
    for key, leaf in want.items():
      shape, dtype = tuple(saved[key].shape), np.dtype(saved[key].dtype)
      if shape != tuple(leaf.shape) or dtype != np.dtype(leaf.dtype):
        detail = (f"its {key} is {dtype}{list(shape)} where this run's optimizer "
                  f"keeps {np.dtype(leaf.dtype)}{list(leaf.shape)}")
        break
  if detail:
    raise OptimizerStateError(
        f"{path} holds another optimizer's state ({detail}): the checkpoint is "
        "readable, but it was written under other optimizer flags (--optimizer, "
        "--freeze_layers, --layer_lr_decay, --grad_clip).")


def read_arrays(workdir: str, step: Optional[int] = None,
                item: str = "params") -> dict[str, np.ndarray]:
  """One item of a checkpoint as host arrays, whatever mesh saved it.

  For inspection and tests, in one process: ``{"h/block/fc/w": array, ...}``
  (keys as :func:`flatten` makes them).

  Args:
    workdir: the run's folder.
    step: a committed step; the latest if None.
    item: ``"params"`` or ``"opt_state"``.
  """
  step = latest(workdir)[0] if step is None else step
  path = epath.Path(folder(workdir)) / str(step) / item
  handler = ocp.StandardCheckpointHandler()
  try:
    tree = handler.metadata(path).tree
    restore_args = jax.tree_util.tree_map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = ocp.PyTreeCheckpointHandler().restore(
        path, args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"{path} is not a readable checkpoint ({_one_line(e)}).") from None
  finally:
    handler.close()
  return {k: np.asarray(v) for k, v in flatten(restored).items()}


def restore_across_depth(workdir: str, step: int, fresh_params: Any,
                         fresh_opt_state: Optional[Any] = None, *, stack: str,
                         indices: list[Optional[int]], pattern: Optional[tuple[str, ...]] = None,
                         zero: tuple[str, ...] = ()) -> tuple[Any, Any]:
  """Reads ``step`` of ``workdir`` into a model whose stack has another depth.

  Layer ``p`` of the stack ``stack`` is the checkpoint's layer
  ``indices[p]``, or layer ``p`` of ``fresh_params`` where it is ``None``
  (with the leaves ``zero`` names set to zero: see ``st.take_layers``); the
  other parameters are the checkpoint's. Nothing is unstacked: one gather
  per stacked leaf, on the host. Nothing is written.

  Example::

    params, opt_state = restore_across_depth(
        "workdir/gpt2", 200, fresh_params, fresh_opt_state, stack="h",
        indices=depth.insert_new(2, 4), zero=model.RESIDUAL_OUTPUTS)

  Args:
    workdir: the earlier run's folder.
    step: a committed step of it (see :func:`latest`).
    fresh_params: the new model's params from a fresh init (host or device
      arrays): the tree, shapes and fresh layers of the result.
    fresh_opt_state: the new optimizer's state from a fresh init to map the
      checkpoint's optimizer state into (see :func:`map_opt_state`), or
      None to leave the optimizer state out.
    stack: the stack's full module name.
    indices, pattern, zero: as ``st.take_layers`` takes them.

  Returns:
    ``(params, opt_state)`` as host numpy arrays in the trees of the fresh
    ones (``opt_state`` None when ``fresh_opt_state`` is).

  Raises:
    CheckpointError: unreadable, or written by another model or optimizer.
    ValueError: ``st.take_layers``' own, for indices, a pattern or a stack
      name that do not fit the checkpoint (one line).
  """
  saved = read_arrays(workdir, step, "params")
  params = map_params(saved, jax.device_get(fresh_params), stack=stack, indices=indices,
                      pattern=pattern, zero=zero)
  opt_state = None
  if fresh_opt_state is not None:
    opt_state = map_opt_state(read_arrays(workdir, step, "opt_state"),
                              jax.device_get(fresh_opt_state), stack=stack,
                              indices=indices, pattern=pattern)
  return params, opt_state


def map_params(saved: dict[str, Any], fresh: Any, *, stack: str,
               indices: list[Optional[int]], pattern: Optional[tuple[str, ...]] = None,
               zero: tuple[str, ...] = ()) -> Any:
  """Saved params (:func:`flatten`'s keys) at another depth, in ``fresh``'s tree.

  ``st.take_layers`` on the stack, the rest as saved; checked against
  ``fresh``'s names, shapes and dtypes (CheckpointError otherwise).
  """
  bundles: dict[str, dict[str, Any]] = {}
  for key, value in saved.items():
    module, name = key.rsplit("/", 1)
    bundles.setdefault(module, {})[name] = value
  mapped = st.take_layers(bundles, stack, indices, pattern=pattern, new=fresh, zero=zero)
  return _unflatten_like(fresh, {f"{m}/{n}": v for m, b in mapped.items() for n, v in b.items()},
                         "parameter", "model flags (e.g. --d_model, --pattern, --bias)")


def map_opt_state(saved: dict[str, Any], fresh: Any, *, stack: str,
                  indices: list[Optional[int]],
                  pattern: Optional[tuple[str, ...]] = None) -> Any:
  """Saved optimizer state at another depth, in ``fresh``'s tree.

  Every leaf whose path holds the stack's name is a row-per-layer leaf of
  it: an AdamW moment (``1/0/mu/h/block/fc/w``), or a leaf of
  ``st.over_layers``' per-layer state (``layers/h/0/count``). Those of one
  path before the stack's name are taken together with ``st.take_layers``
  (``fresh``'s rows for fresh layers); every other leaf (step counts, the
  moments of the embeddings) is the checkpoint's.

  Raises:
    CheckpointError: the saved state has other leaves than ``fresh`` has
      (another optimizer, or other --freeze_layers/--layer_lr_decay flags).
  """
  def split(flat: dict[str, Any]) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any]]:
    stacked: dict[str, dict[str, dict[str, Any]]] = {}
    rest = {}
    for key, value in flat.items():
      at = _stack_start(key, stack)
      if at is None:
        rest[key] = value
        continue
      module, name = key[at:].rsplit("/", 1)
      stacked.setdefault(key[:at], {}).setdefault(module, {})[name] = value
    return stacked, rest

  saved_stacked, out = split(saved)
  fresh_stacked, _ = split(flatten(fresh))
  for before, bundle in fresh_stacked.items():
    if before not in saved_stacked:
      raise CheckpointError(
          f"the checkpoint's optimizer state has no {before}{stack}/...: it was written "
          "with another optimizer (or other --optimizer, --freeze_layers or "
          "--layer_lr_decay flags); pass --init_opt_state=fresh.")
    mapped = st.take_layers(saved_stacked[before], stack, indices, pattern=pattern, new=bundle)
    out.update({f"{before}{m}/{n}": v for m, b in mapped.items() for n, v in b.items()})
  return _unflatten_like(fresh, out, "optimizer state leaf",
                         "optimizer flags (--optimizer, --freeze_layers, --layer_lr_decay); "
                         "pass --init_opt_state=fresh")


def _stack_start(key: str, stack: str) -> Optional[int]:
  """Where the path segments ``stack/`` start in ``key``, or None."""
  if key.startswith(stack + "/"):
    return 0
  at = key.find("/" + stack + "/")
  return None if at < 0 else at + 1


def _unflatten_like(fresh: Any, flat: dict[str, Any], what: str, flags: str) -> Any:
  """``fresh``'s tree with the leaves of ``flat`` (by :func:`flatten`'s keys), checked."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(fresh)
  leaves = []
  for path, want in paths:
    key = _key(path)
    if key not in flat:
      raise CheckpointError(f"the checkpoint has no {what} {key}: it was written with "
                            f"other {flags}.")
    got = flat[key]
    if np.shape(got) != np.shape(want) or np.dtype(got.dtype) != np.dtype(want.dtype):
      raise CheckpointError(
          f"the checkpoint's {what} {key} maps to {np.dtype(got.dtype)}{list(np.shape(got))} "
          f"but the model needs {np.dtype(want.dtype)}{list(np.shape(want))}: it was "
          f"written with other {flags}.")
    leaves.append(np.asarray(got))
  extra = sorted(set(flat) - {_key(p) for p, _ in paths})
  if extra:
    raise CheckpointError(f"the checkpoint has {what}s the model lacks ({', '.join(extra[:3])}"
                          f"{', ...' if len(extra) > 3 else ''}): it was written with other "
                          f"{flags}.")
  return jax.tree_util.tree_unflatten(treedef, leaves)


def export_npz(path: str, params: Any) -> str:
  """Writes host ``params`` to ``path`` as one ``.npz``, atomically.

  Keys are :func:`flatten`'s (``"h/block/fc/w"``: the Haiku module, then the
  parameter); read it with ``np.load(path, allow_pickle=False)``.
  """
  arrays = {k: np.asarray(v) for k, v in flatten(params).items()}
  folder_ = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder_, exist_ok=True)
  return files.atomic_write(path, lambda f: np.savez(f, **arrays))


def load_npz(path: str) -> dict[str, np.ndarray]:
  """What :func:`export_npz` wrote, without pickle."""
  with np.load(path, allow_pickle=False) as data:
    return {k: data[k] for k in data.files}
