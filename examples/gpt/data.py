"""Character-level text data, with no download and no TensorFlow.

The default corpus is built from the running Python's own standard-library
sources: a fixed, sorted list of module files (about 1.5 MB of text), joined
and cached to a file on first use, so the example runs on any machine with
nothing else installed. ``--data_path`` takes any UTF-8 text file instead.

Tokens are characters; the vocabulary is the sorted set of characters in the
text. The first 90% of the text trains, the last 10% validates. Batches are
random windows drawn with a seeded numpy generator whose state is saved with
each checkpoint, so a resumed run draws the same batches. :class:`Prefetched`
puts each batch on the devices one step ahead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sysconfig
from typing import Any, Callable, Optional

import numpy as np

from examples.gpt import files

# Standard-library modules present in CPython 3.10+ (one missing from some
# version is skipped); the order here is the order in the corpus.
STDLIB_MODULES = (
    "argparse.py", "ast.py", "base64.py", "bdb.py", "calendar.py", "cmd.py",
    "code.py", "codecs.py", "collections/__init__.py", "configparser.py",
    "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "decimal.py",
    "difflib.py", "dis.py", "doctest.py", "email/message.py",
    "email/_header_value_parser.py", "enum.py", "fractions.py", "ftplib.py",
    "functools.py", "gettext.py", "glob.py", "gzip.py", "heapq.py", "hmac.py",
    "http/client.py", "http/server.py", "imaplib.py", "inspect.py",
    "ipaddress.py", "json/decoder.py", "json/encoder.py", "locale.py",
    "logging/__init__.py", "mailbox.py", "ntpath.py", "optparse.py", "os.py", "pathlib.py", "pdb.py", "pickle.py", "pickletools.py",
    "platform.py", "posixpath.py", "pprint.py", "pydoc.py", "random.py", "re/_parser.py",
    "shutil.py", "smtplib.py", "socket.py", "ssl.py", "statistics.py",
    "string.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py",
    "threading.py", "tokenize.py", "traceback.py", "typing.py", "urllib/parse.py",
    "urllib/request.py", "uuid.py", "warnings.py", "zipfile.py",
)
CORPUS_CHARS = 1_500_000


def stdlib_corpus(cache_dir: Optional[str] = None) -> str:
  """The default corpus: this Python's standard-library sources, cached.

  Args:
    cache_dir: where to cache the text; defaults to
      ``$XDG_CACHE_HOME/stacktools`` (``~/.cache/stacktools``).

  Returns:
    About 1.5 MB of Python source text.
  """
  if cache_dir is None:
    cache_dir = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "stacktools")
  stdlib = sysconfig.get_paths()["stdlib"]
  version = "{}.{}".format(*__import__("sys").version_info[:2])
  cache = os.path.join(cache_dir, f"stdlib-corpus-py{version}.txt")
  if os.path.exists(cache):
    with open(cache, encoding="utf-8") as f:
      return f.read()
  parts, size = [], 0
  for name in STDLIB_MODULES:
    path = os.path.join(stdlib, name)
    if not os.path.exists(path):
      continue
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    parts.append(text)
    size += len(text)
    if size >= CORPUS_CHARS:
      break
  text = "\n".join(parts)[:CORPUS_CHARS]
  if len(text) < 100_000:
    raise RuntimeError(f"Found only {len(text)} characters of standard-library "
                       f"source under {stdlib}; pass --data_path=<a text file>.")
  os.makedirs(cache_dir, exist_ok=True)
  files.atomic_write(cache, lambda f: f.write(text), mode="w")
  return text


@dataclasses.dataclass
class CharDataset:
  """A text split 90/10, encoded as int32 character ids."""

  chars: str
  train: np.ndarray
  valid: np.ndarray

  @classmethod
  def from_text(cls, text: str, valid_fraction: float = 0.1) -> "CharDataset":
    chars = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.int32, count=len(text))
    split = int(len(ids) * (1 - valid_fraction))
    return cls(chars=chars, train=ids[:split], valid=ids[split:])

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    lookup = {c: i for i, c in enumerate(self.chars)}
    missing = sorted(set(text) - set(lookup))
    if missing:
      raise ValueError(f"Characters {missing!r} are not in the corpus vocabulary.")
    return np.array([lookup[c] for c in text], dtype=np.int32)

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)

  def unigram_entropy(self) -> float:
    """Entropy (nats) of the training characters: the loss of a model that
    knows the character frequencies and nothing else."""
    counts = np.bincount(self.train, minlength=self.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def load_dataset(data_path: Optional[str]) -> CharDataset:
  """The corpus at ``data_path``, or the standard-library corpus.

  Raises:
    ValueError: one line naming --data_path, for a path that is not a file
      or a file that is not UTF-8 text.
  """
  if data_path is None:
    return CharDataset.from_text(stdlib_corpus())
  if not os.path.isfile(data_path):
    raise ValueError(f"--data_path={data_path!r} does not exist or is not a file; "
                     "pass a UTF-8 text file, or omit the flag to train on the "
                     "standard-library corpus.")
  try:
    with open(data_path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise ValueError(f"--data_path={data_path!r} is not UTF-8 text ({e}).") from None
  return CharDataset.from_text(text)


def check_batches(dataset: CharDataset, batch_size: int, seq_len: int) -> None:
  """Checks that each split holds at least one batch of ``seq_len + 1`` windows.

  Raises:
    ValueError: one line naming --data_path and the flags of the batch.
  """
  need = batch_size * (seq_len + 1)
  for split, ids in (("training", dataset.train), ("validation", dataset.valid)):
    if len(ids) < max(need, seq_len + 2):
      raise ValueError(
          f"--data_path: the {split} split has {len(ids)} characters, "
          f"fewer than one batch (--batch_size={batch_size} x (--seq_len="
          f"{seq_len} + 1) = {need}); use a longer text or smaller flags.")


class BatchSampler:
  """Random windows of ``seq_len + 1`` ids, from a seeded numpy generator."""

  def __init__(self, ids: np.ndarray, batch_size: int, seq_len: int, seed: int):
    if len(ids) < seq_len + 2:
      raise ValueError(f"The text has {len(ids)} characters, fewer than one "
                       f"sequence of {seq_len + 1}.")
    self.ids = ids
    self.batch_size = batch_size
    self.seq_len = seq_len
    self.rng = np.random.Generator(np.random.PCG64(seed))
    self._offsets = np.arange(seq_len + 1)

  def zeros(self) -> np.ndarray:
    """A batch of the right shape, all zeros, without advancing the generator."""
    return np.zeros((self.batch_size, self.seq_len + 1), np.int32)

  def next(self) -> np.ndarray:
    starts = self.rng.integers(0, len(self.ids) - self.seq_len - 1, self.batch_size)
    # One gather for the whole batch (the rows np.stack of slices would make).
    return self.ids[starts[:, None] + self._offsets]

  def get_state(self) -> str:
    """The generator's state as JSON text (saved with checkpoints, no pickle)."""
    return json.dumps(self.rng.bit_generator.state)

  def set_state(self, state: str) -> None:
    self.rng.bit_generator.state = json.loads(state)


class Prefetched:
  """A sampler's batches, each put on the devices one batch ahead.

  :meth:`next` returns the batch it put on the previous call and puts the one
  after it, so that batch's copy to the devices is under way while the step
  that takes the returned one runs: after a pause (a log line that waits for
  the losses, an evaluation, a checkpoint) the next step starts at once.
  :meth:`get_state` is the sampler's state after the batches returned so
  far: the one put ahead is drawn again by a run resumed from it, as by an
  uninterrupted one.

  Example::

    batches = Prefetched(BatchSampler(ids, 16, 64, seed=0), jax.device_put)
    tokens = batches.next()     # on the device; the next batch is on its way
  """

  def __init__(self, sampler: BatchSampler, put: Callable[[np.ndarray], Any]):
    self._sampler = sampler
    self._put = put
    self._ahead: Any = None   # the batch put ahead, once next() has run
    self._state = sampler.get_state()

  def next(self) -> Any:
    if self._ahead is None:
      self._ahead = self._put(self._sampler.next())
    batch, self._state = self._ahead, self._sampler.get_state()
    self._ahead = self._put(self._sampler.next())
    return batch

  def get_state(self) -> str:
    """The sampler's state as of the batches :meth:`next` has returned."""
    return self._state
