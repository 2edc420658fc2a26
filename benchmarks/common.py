"""Shared helpers for the benchmarks: models, contenders, timing, JSON, plots.

Every benchmark builds the same two block stacks:

* ``mlp``: a residual MLP block, ``x + W2 gelu(W1 LayerNorm(x))``, on a carry
  of shape ``[batch, width]``; the hidden activation is tagged
  ``"mlp_hidden"``.
* ``gpt``: a small GPT-like pre-LayerNorm transformer block (causal
  multi-head self-attention, then a 4x MLP), on a carry of shape
  ``[batch, seq_len, width]``; the attention output is tagged ``"attn_out"``
  and the MLP hidden activation ``"mlp_hidden"``.

and applies them ``num_layers`` times in one of four ways (a *contender*):

* ``stacked``: ``st.Stacked(...).fold`` with ``remat=<policy>``.
* ``blockseq``: ``st.BlockSeq(...).fold``, the unrolled Python loop.
* ``hk_layer_stack``: ``hk.layer_stack`` over the block wrapped in
  ``hk.remat(policy=...)``, as a Haiku user writes it by hand (``nested``:
  an ``hk.layer_stack`` of remat-ed ``hk.layer_stack`` chunks).
* ``lax_scan``: a hand-written ``jax.lax.scan(jax.checkpoint(body,
  policy=...))`` over parameters stacked with ``jax.vmap(init)``
  (``nested``: a scan of checkpointed scans over reshaped parameters).

A *gradient step* is ``jax.jit(jax.value_and_grad(loss))(params, x)`` with
``loss = mean(stack(x) ** 2)``.

The scripts import this module as ``benchmarks.common``; run them from the
repository root (``python benchmarks/memory.py``) or anywhere else: each
script puts the repository root on ``sys.path`` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import stacktools as st
from stacktools.loops import nested_split

PyTree = Any
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
NO_MATPLOTLIB = "matplotlib not installed: skipping the plot (pip install matplotlib)"

#: The policies every benchmark knows, in display order: stacktools' remat
#: aliases, then ``save_named``, which keeps the one internal named by
#: ``--save_name`` (default ``mlp_hidden``).
POLICIES = tuple(st.REMAT_ALIASES) + ("save_named",)
#: The ways of applying a block N times, in display order.
IMPLS = ("stacked", "blockseq", "hk_layer_stack", "lax_scan")
IMPL_LABELS = {
    "stacked": "st.Stacked",
    "blockseq": "st.BlockSeq (Python loop)",
    "hk_layer_stack": "hk.layer_stack + hk.remat",
    "lax_scan": "lax.scan + jax.checkpoint",
}
#: The name the hand-written contenders give the carry (and per-layer
#: parameters) so that an offloading jax policy can refer to them.
HAND_CARRY = "hand_carry"
HAND_INPUT = "hand_input"


# ---------------------------------------------------------------------------
# Models.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The sizes of one block stack's carry and block.

  Attributes:
    kind: ``"mlp"`` or ``"gpt"``.
    width: model width (``d_model``).
    batch: batch size.
    seq_len: sequence length (``gpt`` only; ignored by ``mlp``).
    heads: attention heads (``gpt`` only).
  """

  kind: str
  width: int
  batch: int
  seq_len: int = 1
  heads: int = 1

  def __post_init__(self):
    if self.kind not in ("mlp", "gpt"):
      raise ValueError(f"ModelConfig.kind must be 'mlp' or 'gpt', got {self.kind!r}.")
    if self.kind == "gpt" and self.width % self.heads:
      raise ValueError(f"gpt: width={self.width} must be a multiple of "
                       f"heads={self.heads}.")

  @property
  def carry_shape(self) -> tuple[int, ...]:
    if self.kind == "mlp":
      return (self.batch, self.width)
    return (self.batch, self.seq_len, self.width)

  @property
  def carry_bytes(self) -> int:
    """Bytes of one carry (float32): the guide's ``C``, computed analytically."""
    return 4 * math.prod(self.carry_shape)

  @property
  def param_bytes_per_layer(self) -> int:
    """Bytes of one block's parameters (float32), from their shapes."""
    block = hk.transform(lambda x: make_block(self)()(x))
    shapes = jax.eval_shape(block.init, jax.random.PRNGKey(0),
                            jax.ShapeDtypeStruct(self.carry_shape, jnp.float32))
    return sum(4 * math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))

  def describe(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    if self.kind == "mlp":
      del out["seq_len"], out["heads"]
    out["carry_shape"] = list(self.carry_shape)
    out["carry_bytes"] = self.carry_bytes
    out["param_bytes_per_layer"] = self.param_bytes_per_layer
    return out


class MLPBlock(hk.Module):
  """``x + W2 gelu(W1 LayerNorm(x))``; the hidden activation is ``mlp_hidden``."""

  def __init__(self, width: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.width = width

  def __call__(self, x: jax.Array) -> jax.Array:
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
    h = jax.nn.gelu(hk.Linear(4 * self.width, name="fc")(h))
    h = st.checkpoint_name(h, "mlp_hidden")
    return x + hk.Linear(self.width, name="out")(h)


class GPTBlock(hk.Module):
  """A pre-LayerNorm transformer block: causal self-attention, then an MLP."""

  def __init__(self, width: int, heads: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.width, self.heads = width, heads

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, seq_len, width = x.shape
    head_dim = width // self.heads
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln1")(x)
    qkv = hk.Linear(3 * width, name="qkv")(h)
    q, k, v = jnp.split(qkv.reshape(batch, seq_len, 3, self.heads, head_dim), 3, axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)
    attn = st.checkpoint_name(attn.reshape(batch, seq_len, width), "attn_out")
    x = x + hk.Linear(width, name="proj")(attn)
    h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln2")(x)
    h = jax.nn.gelu(hk.Linear(4 * width, name="fc")(h))
    h = st.checkpoint_name(h, "mlp_hidden")
    return x + hk.Linear(width, name="out")(h)


def make_block(cfg: ModelConfig) -> Callable[[], hk.Module]:
  """A factory of the block ``cfg`` describes, as ``st.Stacked`` takes it."""
  if cfg.kind == "mlp":
    return lambda: MLPBlock(cfg.width, name="block")
  return lambda: GPTBlock(cfg.width, cfg.heads, name="block")


def example_input(cfg: ModelConfig, seed: int = 1) -> jax.Array:
  return jax.random.normal(jax.random.PRNGKey(seed), cfg.carry_shape, jnp.float32)


# ---------------------------------------------------------------------------
# Policies, as stacktools takes them and as a user writes them in JAX.


def st_remat(policy: str, save_name: str = "mlp_hidden") -> st.CheckpointPolicy:
  """The ``remat=`` value stacktools takes for a benchmark policy name."""
  if policy == "save_named":
    return st.CheckpointPolicy(save_block_internals=[save_name])
  return st.CheckpointPolicy.from_remat(policy)


def jax_policy(policy: str, save_name: str = "mlp_hidden") -> Optional[Callable[..., Any]]:
  """The ``jax.checkpoint_policies`` entry a user writes for a policy name.

  ``None`` for ``"none"`` (no checkpoint at all). ``"full"`` and ``"nested"``
  keep nothing but the checkpointed function's inputs; ``"offload"`` moves
  the values tagged :data:`HAND_CARRY` and :data:`HAND_INPUT` to host memory.
  """
  cp = jax.checkpoint_policies
  if policy == "none":
    return None
  if policy in ("full", "nested"):
    return cp.nothing_saveable
  if policy == "save_all":
    return cp.everything_saveable
  if policy == "save_named":
    return cp.save_only_these_names(save_name)
  if policy == "offload":
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[HAND_CARRY, HAND_INPUT],
        offload_src="device", offload_dst="pinned_host")
  raise ValueError(f"Unknown policy {policy!r}; expected one of {POLICIES}.")


def supports(impl: str, policy: str, num_layers: int) -> bool:
  """Whether ``impl`` can express ``policy`` at this depth.

  ``hk_layer_stack`` writes ``nested`` as a layer_stack of layer_stacks, so
  only when ``st.nested_split`` divides the depth exactly.
  """
  if impl == "hk_layer_stack" and policy == "nested":
    return nested_split(num_layers, True)[2] == 0
  return impl in IMPLS and policy in POLICIES


# ---------------------------------------------------------------------------
# Contenders: (loss(params, x), params) for an implementation and a policy.


@dataclasses.dataclass
class Contender:
  """One way of computing the loss of an N-layer stack.

  Attributes:
    name: ``"<impl>/<policy>"``.
    impl: one of :data:`IMPLS`.
    policy: one of :data:`POLICIES`.
    loss: ``loss(params, x) -> scalar``.
    init: ``init(key, x) -> params``.
  """

  name: str
  impl: str
  policy: str
  loss: Callable[[PyTree, jax.Array], jax.Array]
  init: Callable[[jax.Array, jax.Array], PyTree]

  def grad_step(self) -> Callable[[PyTree, jax.Array], tuple[jax.Array, PyTree]]:
    """A fresh (never traced) jitted gradient step."""
    return jax.jit(jax.value_and_grad(self.loss))

  def abstract_params(self, x: jax.Array) -> PyTree:
    """The parameters' shapes and dtypes, without running init."""
    return jax.eval_shape(self.init, jax.random.PRNGKey(0), x)

  def synthetic_params(self, x: jax.Array, seed: int = 0) -> PyTree:
    """Parameters of the right shapes without compiling the init.

    For timing only: LayerNorm scales are ones, offsets and biases zeros, and
    weights ``normal / sqrt(fan_in)``. Leaves are drawn one by one, eagerly,
    so each distinct shape compiles a tiny random op once, shared by every
    contender, instead of one init program per contender.
    """
    abstract = self.abstract_params(x)
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    values = []
    for key, (path, leaf) in zip(keys, leaves):
      last = jax.tree_util.keystr(path[-1:])
      if "scale" in last:
        values.append(jnp.ones(leaf.shape, leaf.dtype))
      elif "offset" in last or "'b'" in last:
        values.append(jnp.zeros(leaf.shape, leaf.dtype))
      else:
        fan_in = leaf.shape[-2] if len(leaf.shape) >= 2 else 1
        values.append(jax.random.normal(key, leaf.shape, leaf.dtype) / math.sqrt(fan_in))
    return jax.tree_util.tree_unflatten(tree, values)


def _mean_square(y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.square(y))


def _haiku_contender(name, impl, policy, forward) -> Contender:
  model = hk.without_apply_rng(hk.transform(lambda x: _mean_square(forward(x))))
  return Contender(name, impl, policy, model.apply, model.init)


def _hk_remat(f, policy: str, save_name: str):
  """``f`` wrapped in ``hk.remat`` as a Haiku user writes it (default prevent_cse)."""
  if policy == "none":
    return f
  if policy == "offload":
    return hk.remat(lambda x: f(jax.ad_checkpoint.checkpoint_name(x, HAND_CARRY)),
                    policy=jax_policy(policy))
  return hk.remat(f, policy=jax_policy(policy, save_name))


def _lax_scan_contender(cfg, policy, num_layers, save_name, name) -> Contender:
  block = hk.without_apply_rng(hk.transform(lambda x: make_block(cfg)()(x)))
  name_ = jax.ad_checkpoint.checkpoint_name

  def body(x, p):
    if policy == "offload":
      x, p = name_(x, HAND_CARRY), jax.tree_util.tree_map(lambda a: name_(a, HAND_INPUT), p)
    return block.apply(p, x), None

  def checkpointed(f):
    if policy == "none":
      return f
    # The JAX docs' advice inside scan: prevent_cse=False.
    return jax.checkpoint(f, policy=jax_policy(policy, save_name), prevent_cse=False)

  def forward(params, x):
    if policy != "nested":
      return jax.lax.scan(checkpointed(body), x, params)[0]
    outer, inner, remainder = nested_split(num_layers, True)
    step = checkpointed(body)

    def chunk(x, p):
      return jax.lax.scan(step, x, p)[0], None

    main = jax.tree_util.tree_map(
        lambda a: a[:outer * inner].reshape((outer, inner) + a.shape[1:]), params)
    x = jax.lax.scan(checkpointed(chunk), x, main)[0]
    if remainder:
      rest = jax.tree_util.tree_map(lambda a: a[outer * inner:], params)
      x = checkpointed(chunk)(x, rest)[0]
    return x

  def init(key, x):
    return jax.vmap(block.init, in_axes=(0, None))(jax.random.split(key, num_layers), x)

  return Contender(name, "lax_scan", policy,
                   lambda p, x: _mean_square(forward(p, x)), init)


def build(impl: str, policy: str, cfg: ModelConfig, num_layers: int, *,
          save_name: str = "mlp_hidden") -> Contender:
  """The contender ``impl`` with ``policy`` on an N-layer stack of ``cfg``."""
  if not supports(impl, policy, num_layers):
    raise ValueError(f"{impl} cannot express policy {policy!r} at {num_layers} layers.")
  name = f"{impl}/{policy}"
  block = make_block(cfg)
  if impl == "stacked":
    remat = st_remat(policy, save_name)
    return _haiku_contender(name, impl, policy, lambda x: st.Stacked(
        block, num_layers, remat=remat, name="h").fold(x))
  if impl == "blockseq":
    remat = st_remat(policy, save_name)
    return _haiku_contender(name, impl, policy, lambda x: st.BlockSeq(
        block, num_layers, remat=remat, name="h").fold(x))
  if impl == "hk_layer_stack":
    def forward(x):
      layer = _hk_remat(lambda x: block()(x), policy if policy != "nested" else "full",
                        save_name)
      if policy != "nested":
        return hk.layer_stack(num_layers, name="h")(layer)(x)
      outer, inner, _ = nested_split(num_layers, True)
      chunk = hk.remat(lambda x: hk.layer_stack(inner, name="inner")(layer)(x),
                       policy=jax.checkpoint_policies.nothing_saveable)
      return hk.layer_stack(outer, name="h")(chunk)(x)
    return _haiku_contender(name, impl, policy, forward)
  return _lax_scan_contender(cfg, policy, num_layers, save_name, name)


# ---------------------------------------------------------------------------
# Measuring.


#: XLA options that cut the CPU compile time of a memory measurement by about
#: half. They only change LLVM's optimisation of the generated code, which runs
#: after XLA's buffer assignment, so the temp bytes are the same (memory.py
#: checks this on one contender per run and falls back to the defaults if not).
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


def temp_bytes(contender: Contender, x: jax.Array,
               compiler_options: Optional[dict[str, Any]] = None) -> int:
  """Compiled temp memory of one gradient step (lowered and compiled, never run)."""
  lowered = contender.grad_step().lower(contender.abstract_params(x), x)
  compiled = lowered.compile(compiler_options=compiler_options)
  return int(compiled.memory_analysis().temp_size_in_bytes)


def block(tree: PyTree) -> PyTree:
  """``jax.block_until_ready`` on every leaf; returns ``tree``."""
  return jax.block_until_ready(tree)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  """Seconds that ``fn()`` takes until its result is ready, and the result."""
  start = time.perf_counter()
  out = block(fn())
  return time.perf_counter() - start, out


def clocks() -> tuple[float, float]:
  """``(wall, cpu)`` seconds now: ``time.perf_counter`` and this process's CPU
  time (all threads, ``time.process_time``), which a busy machine disturbs less."""
  return time.perf_counter(), time.process_time()


def fastest(repeats: Sequence[dict[str, float]]) -> dict[str, float]:
  """Each quantity's minimum over repeats (the least disturbed measurement)."""
  return {key: min(r[key] for r in repeats) for key in repeats[0]}


def median(values: Iterable[float]) -> float:
  return float(statistics.median(list(values)))


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
  """Least-squares ``(intercept, slope)`` of ``ys`` against ``xs``."""
  slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
  return float(intercept), float(slope)


# ---------------------------------------------------------------------------
# Command lines, results and plots.


def parser(doc: Optional[str]) -> argparse.ArgumentParser:
  """An argument parser with the flags every benchmark takes."""
  p = argparse.ArgumentParser(
      description=(doc or "").strip().splitlines()[0] if doc else None,
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes, a few seconds: the smoke test's mode")
  p.add_argument("--results_dir", type=Path, default=DEFAULT_RESULTS_DIR,
                 help="where <name>.json and <name>.png are written")
  p.add_argument("--no_plot", action="store_true", help="write the JSON only")
  return p


def parse_args(build_parser: Callable[[], argparse.ArgumentParser],
               quick_args: Sequence[str],
               argv: Optional[Sequence[str]]) -> argparse.Namespace:
  """Parses ``argv``; with ``--quick``, the quick sizes come first, so flags
  given on the command line still win."""
  args = build_parser().parse_args(argv)
  if args.quick:
    given = list(argv if argv is not None else sys.argv[1:])
    args = build_parser().parse_args(list(quick_args) + given)
  return args


def model_config(args: argparse.Namespace) -> "ModelConfig":
  """The ModelConfig of the flags --model --width --batch --seq_len --heads."""
  gpt = args.model == "gpt"
  return ModelConfig(args.model, width=args.width, batch=args.batch,
                     seq_len=args.seq_len if gpt else 1, heads=args.heads if gpt else 1)


def publish(args: argparse.Namespace, name: str, payload: dict[str, Any],
            markdown: Callable[[dict[str, Any]], str],
            draw: Callable[[dict[str, Any]], Callable[[Any], Any]]) -> dict[str, Any]:
  """Prints the results table, writes the JSON and (unless --no_plot) the PNG."""
  payload["markdown"] = markdown(payload)
  print(payload["markdown"])
  write_json(args.results_dir, name, payload)
  if not args.no_plot:
    save_plot(args.results_dir, name, draw(payload))
  return payload


def int_list(text: str) -> list[int]:
  """``"4,8,16"`` -> ``[4, 8, 16]`` (an argparse ``type``)."""
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected comma-separated integers such as 4,8,16, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def str_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
  """An argparse ``type`` for a comma-separated subset of ``choices``."""
  def parse(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in choices]
    if unknown or not values:
      raise argparse.ArgumentTypeError(
          f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
    return values
  return parse


def environment() -> dict[str, Any]:
  """Versions and the machine, stated in every result."""
  device = jax.devices()[0]
  return {
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
      "dm_haiku": hk.__version__,
      "stacktools": st.__version__,
      "backend": jax.default_backend(),
      "device": getattr(device, "device_kind", str(device)),
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
  }


def _jaxlib_version() -> Optional[str]:
  try:
    import jaxlib  # pylint: disable=import-outside-toplevel
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


def write_json(results_dir: Path, name: str, payload: dict[str, Any]) -> Path:
  """Writes ``payload`` to ``<results_dir>/<name>.json``.

  ``payload`` gains (in place) the keys ``benchmark`` (first) and
  ``environment`` (last).
  """
  results_dir.mkdir(parents=True, exist_ok=True)
  path = results_dir / f"{name}.json"
  full = {"benchmark": name, **payload, "environment": environment()}
  payload.clear()
  payload.update(full)
  path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n", encoding="utf-8")
  print(f"wrote {_display(path)}")
  return path


def save_plot(results_dir: Path, name: str, draw: Callable[[Any], Any]) -> Optional[Path]:
  """Draws a figure with ``draw(pyplot)`` and saves ``<results_dir>/<name>.png``.

  Without matplotlib (an optional extra: ``pip install stacktools[plot]``)
  prints one line and returns ``None``.
  """
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(NO_MATPLOTLIB)
    return None
  results_dir.mkdir(parents=True, exist_ok=True)
  path = results_dir / f"{name}.png"
  fig = draw(pyplot)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  pyplot.close(fig)
  print(f"wrote {_display(path)}")
  return path


def depth_axis(ax: Any, depths: Iterable[int]) -> None:
  """A log2 x axis labelled "layers L", ticked at the measured depths."""
  depths = sorted(set(depths))
  ax.set_xscale("log", base=2)
  ax.set_xticks(depths, [str(d) for d in depths])
  ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
  ax.set_xlabel("layers L")


def _display(path: Path) -> str:
  try:
    return str(path.resolve().relative_to(Path.cwd()))
  except ValueError:
    return str(path)


def command_line() -> str:
  """How this run was invoked, for the JSON."""
  return " ".join(["python", _display(Path(sys.argv[0]))] + sys.argv[1:])


def log(message: str) -> None:
  print(message, flush=True)
