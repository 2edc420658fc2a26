"""Reading a saved run back: into the current mesh, for inspection, or at another depth.

The steps are those ``saving.py`` writes (a "checkpoint" here is a saved
step of a run, not the library's remat). :func:`restore` reads a step into
the shardings of the current mesh, whichever mesh saved it, after checking
that its parameters and optimizer state are this run's model's and
optimizer's. :func:`read_arrays` reads one item onto the host. Both read an
export (``saving.export_npz``) as a step of parameters alone.

:func:`restore_across_depth` reads a step into a model of another depth
(``st.take_layers`` on the stack's layers, and on the matching rows of the
optimizer state when that is carried over).
"""

from __future__ import annotations

import logging as py_logging
import sys
from typing import Any, Optional

import jax
import numpy as np

import stacktools as st
from examples.gpt import saving
from examples.gpt.saving import CheckpointError
from examples.gpt.saving import OptimizerStateError


def restore(workdir: str, step: int, params: Any,
            opt_state: Optional[Any] = None) -> tuple[Any, Any]:
  """Reads ``step`` of ``workdir`` into the structure, shapes and shardings of templates.

  A collective in a multi-process run: every process reads the shards that
  its devices hold under the templates' shardings.

  Args:
    workdir: the run's folder.
    step: a committed step (see ``saving.latest``).
    params: ``jax.ShapeDtypeStruct``s with ``sharding`` set: where each
      process puts what it reads (any mesh, not only the one that saved).
    opt_state: the same for the optimizer state, or None to skip it.

  Returns:
    ``(params, opt_state)`` as ``jax.Array``s (``opt_state`` None if skipped).

  Raises:
    CheckpointError: from another model, or unreadable (corrupt, missing files);
      an export (``saving.is_export``) asked for an optimizer state.
  """
  if saving.is_export(workdir):
    return _restore_export(workdir, params, opt_state), None
  saving.quiet_orbax()
  step_dir = saving.epath.Path(saving.folder(workdir)) / str(step)
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
    handler = saving.ocp.StandardCheckpointHandler()
    try:
      saved = _saved_tree(handler, step_dir / item)
      if item == "params":
        check_matches(str(step_dir), saved, template)
      else:   # another optimizer's state would fail inside Orbax, unnamed
        check_optimizer_state(str(step_dir), saved, template)
      restored[item] = handler.restore(step_dir / item,
                                       args=saving.ocp.args.StandardRestore(template))
    except CheckpointError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f"{step_dir} is not a readable checkpoint ({saving.one_line(e)}); delete "
          "that folder to resume from the step before, or point --workdir "
          "elsewhere.") from None
    finally:
      handler.close()
  sys.unraisablehook = previous_hook
  asyncio_log.removeFilter(_UNRETRIEVED)
  return restored["params"], restored["opt_state"]


def _restore_export(path: str, params: Any, opt_state: Optional[Any]) -> Any:
  """An export's parameters in the tree, shapes and shardings of ``params``."""
  if opt_state is not None:
    raise CheckpointError(f"{path} is an export of parameters alone (train.py "
                          "--export_npz): it holds no optimizer state.")
  host = _unflatten_like(params, read_arrays(path), "parameter",
                         "model flags (e.g. --num_layers, --d_model, --pattern, --bias)")
  return jax.tree_util.tree_map(
      lambda array, s: jax.make_array_from_callback(array.shape, s.sharding,
                                                    lambda index: array[index]),
      host, params)


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
  saved = saving.flatten(tree)
  for key, leaf in saving.flatten(template).items():
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
  extra = sorted(set(saved) - set(saving.flatten(template)))
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
  saved, want = saving.flatten(metadata), saving.flatten(template)
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
  (keys as ``saving.flatten`` makes them).

  Args:
    workdir: the run's folder.
    step: a committed step; the latest if None.
    item: ``"params"`` or ``"opt_state"`` (an export holds the parameters alone).
  """
  if saving.is_export(workdir):
    if item != "params":
      raise CheckpointError(f"{workdir} is an export of parameters alone (train.py "
                            f"--export_npz): it holds no {item}.")
    return saving.load_npz(workdir)
  step = saving.latest(workdir)[0] if step is None else step
  path = saving.epath.Path(saving.folder(workdir)) / str(step) / item
  handler = saving.ocp.StandardCheckpointHandler()
  try:
    tree = handler.metadata(path).tree
    restore_args = jax.tree_util.tree_map(
        lambda _: saving.ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = saving.ocp.PyTreeCheckpointHandler().restore(
        path, args=saving.ocp.args.PyTreeRestore(item=tree, restore_args=restore_args))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"{path} is not a readable checkpoint ({saving.one_line(e)}).") from None
  finally:
    handler.close()
  return {k: np.asarray(v) for k, v in saving.flatten(restored).items()}


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
    step: a committed step of it (see ``saving.latest``).
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
  """Saved params (``saving.flatten``'s keys) at another depth, in ``fresh``'s tree.

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
  fresh_stacked, _ = split(saving.flatten(fresh))
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
  """``fresh``'s tree with the leaves of ``flat`` (by ``saving.flatten``'s keys), checked."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(fresh)
  leaves = []
  for path, want in paths:
    key = saving.path_key(path)
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
  extra = sorted(set(flat) - {saving.path_key(p) for p, _ in paths})
  if extra:
    raise CheckpointError(f"the checkpoint has {what}s the model lacks ({', '.join(extra[:3])}"
                          f"{', ...' if len(extra) > 3 else ''}): it was written with other "
                          f"{flags}.")
  return jax.tree_util.tree_unflatten(treedef, leaves)
