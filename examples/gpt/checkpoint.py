"""Checkpoints: one .npz of arrays and JSON metadata, written atomically.

A checkpoint holds the parameters, the optimizer state, the step, the data
sampler's state, the model config and the vocabulary. It is written to a
temporary file in the same folder and renamed over the old one
(``files.atomic_write``), so a crash mid-write leaves the previous checkpoint
intact and never a partial file. It is read with
``np.load(allow_pickle=False)``: pytrees are rebuilt from a template (a
freshly initialised state of the same model), so nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import jax
import numpy as np

from examples.gpt import files

FILENAME = "checkpoint.npz"


class CheckpointError(Exception):
  """A checkpoint is missing, unreadable or does not match the model."""


class NotFoundError(CheckpointError):
  """There is no checkpoint file.

  The message only says where none is: what to do about it depends on the
  binary (train.py: drop --resume; sample.py: train first), so the caller
  adds that.
  """


def path_in(workdir: str) -> str:
  return os.path.join(workdir, FILENAME)


def _flatten(prefix: str, tree: Any) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {prefix + jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def save(workdir: str, trees: dict[str, Any], meta: dict[str, Any]) -> str:
  """Writes ``trees`` (name -> pytree) and ``meta`` (JSON-able) atomically."""
  arrays = {}
  for name, tree in trees.items():
    arrays.update(_flatten(name, tree))
  arrays["__meta__"] = np.array(json.dumps(meta))
  os.makedirs(workdir, exist_ok=True)
  files.atomic_write(path_in(workdir), lambda f: np.savez(f, **arrays))
  return path_in(workdir)


def load_meta(workdir: str) -> dict[str, Any]:
  """The metadata of the checkpoint in ``workdir``.

  Raises:
    NotFoundError: there is no checkpoint.
    CheckpointError: it is not a readable checkpoint.
  """
  with _open(workdir) as data:
    return json.loads(str(data["__meta__"]))


def load(workdir: str, templates: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """Reads the checkpoint in ``workdir`` into the structure of ``templates``.

  Args:
    workdir: the folder holding ``checkpoint.npz``.
    templates: name -> pytree with the expected structure, shapes and dtypes.

  Returns:
    ``(trees, meta)``.

  Raises:
    NotFoundError: there is no checkpoint.
    CheckpointError: corrupt, or from a different model.
  """
  path = path_in(workdir)
  with _open(workdir) as data:
    meta = json.loads(str(data["__meta__"]))
    trees = {}
    for name, template in templates.items():
      leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
      restored = []
      for key_path, leaf in leaves:
        key = name + jax.tree_util.keystr(key_path)
        if key not in data.files:
          raise CheckpointError(
              f"{path} has no {key}: it was written by a different model or "
              "flags (e.g. --num_layers, --stack). Use the same model flags, or "
              "a new --workdir.")
        value = _read(data, key, path)
        # Templates may be arrays or jax.ShapeDtypeStructs.
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        if value.shape != shape or value.dtype != dtype:
          raise CheckpointError(
              f"{path}: {key} is {value.dtype}{list(value.shape)} but the model "
              f"needs {dtype}{list(shape)}; the model flags differ from the run "
              "that wrote it.")
        restored.append(value)
      trees[name] = jax.tree_util.tree_unflatten(treedef, restored)
  return trees, meta


def _read(data, key: str, path: str) -> np.ndarray:
  try:
    return data[key]
  except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
    raise CheckpointError(f"{path}: {key} is unreadable ({e}); the file is "
                          "corrupt: delete it or point --workdir elsewhere.") from None


class _open:  # pylint: disable=invalid-name
  """``np.load`` with errors turned into CheckpointError."""

  def __init__(self, workdir: str):
    self.path = path_in(workdir)

  def __enter__(self):
    if not os.path.exists(self.path):
      raise NotFoundError(f"No checkpoint at {self.path}.")
    try:
      self.data = np.load(self.path, allow_pickle=False)
      if "__meta__" not in self.data.files:
        raise ValueError("no metadata")
      return self.data
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
      raise CheckpointError(
          f"{self.path} is not a readable checkpoint ({e}); delete it or "
          "point --workdir elsewhere.") from None

  def __exit__(self, *exc):
    self.data.close()
    return False
