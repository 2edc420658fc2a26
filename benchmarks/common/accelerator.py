"""What the accelerator scripts share: the presets' sizes, the GPT, the run.

Four scripts measure the example on an accelerator, one question each, in
one process, their contenders alternated: ``accelerator_gpt`` (the scanned
stack against the unrolled one), ``accelerator_decode`` (decode against its
floor), ``accelerator_offload`` (offload against full, and the host link)
and ``accelerator_train`` (the example's train step). Each runs on
``python -m benchmarks.accelerator_<part>`` and takes the flags of
:func:`build_parser`; ``--small`` and ``--quick`` run the same code at CPU
sizes (:data:`SIZES`). Each writes ``accelerator_<part>_<device>.json``
(``<device>``: the device's kind as a slug, ``tpu_v5_lite``, ``cpu``) after
each step of its part, so that a run cut short still reports what it
measured, and at the end its plot ``accelerator_<part>_<device>.png``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp

import stacktools as st
from benchmarks.common import device_runs
from benchmarks.common import fast_compile
from benchmarks.common import harness
from examples.gpt import model as model_lib
from examples.gpt import model_config

#: The example's default remat: full, keeping the matmul outputs.
DEFAULT = st.CheckpointPolicy(save_block_internals=model_config.KEPT_MATMUL_OUTPUTS)
#: The sizes of each part, per preset: the published run's (``accelerator``)
#: and the CPU-sized ``--small`` and ``--quick``.
SIZES = {
    "accelerator": {
        "gpt": dict(layers=12, d_model=768, heads=12, seq_len=1024, batch=8),
        "decode": dict(layers=24, d_model=1024, heads=16, seq_len=4096,
                       points=((8, "float32"), (1, "float32"), (8, "bfloat16"))),
        "mlp": dict(width=2048, batch=8192, layers=32),
        "wide_gpt": dict(layers=8, d_model=2048, heads=16, seq_len=1024, batch=8),
        "link_bytes": 2**30,
        "train": dict(layers=12, d_model=768, heads=12, seq_len=1024, batches=(4, 8, 16, 32)),
    },
    "small": {
        "gpt": dict(layers=4, d_model=64, heads=2, seq_len=64, batch=4),
        "decode": dict(layers=4, d_model=64, heads=2, seq_len=256,
                       points=((4, "float32"), (1, "float32"), (4, "bfloat16"))),
        "mlp": dict(width=128, batch=256, layers=8),
        "wide_gpt": dict(layers=2, d_model=128, heads=4, seq_len=64, batch=4),
        "link_bytes": 2**24,
        "train": dict(layers=2, d_model=64, heads=2, seq_len=64, batches=(4,)),
    },
    "quick": {
        "gpt": dict(layers=2, d_model=32, heads=2, seq_len=16, batch=2),
        # Each dtype once, at one batch (a second float32 batch would
        # compile the same programs again at another size).
        "decode": dict(layers=2, d_model=32, heads=2, seq_len=32,
                       points=((2, "float32"), (2, "bfloat16"))),
        "mlp": dict(width=32, batch=16, layers=4),
        "wide_gpt": dict(layers=2, d_model=64, heads=2, seq_len=16, batch=2),
        "link_bytes": 2**20,
        "train": dict(layers=2, d_model=32, heads=2, seq_len=16, batches=(2,)),
    },
}
VOCAB = 256
#: The flags ``--quick`` adds (a script may add its own).
QUICK = ["--rounds", "2", "--steps", "1"]


# ---------------------------------------------------------------------------
# The GPT at a size: its config, its loss, its tokens, its parameters.


def gpt_config(size: dict[str, int], stack: str, remat: Any,
               dtype: str = "float32") -> model_config.GPTConfig:
  """The GPT of one configuration; ``dtype`` is its compute dtype (the
  example's mixed precision: float32 parameters either way)."""
  return model_config.GPTConfig(
      vocab_size=VOCAB, seq_len=size["seq_len"], num_layers=size["layers"],
      num_heads=size["heads"], d_model=size["d_model"], bias=False,
      stack="unrolled" if stack == "unrolled" else "scan",
      remat=False if stack == "hk_layer_stack" else remat, dtype=dtype)


def gpt_loss(size: dict[str, int], stack: str, remat: Any, dtype: str):
  """``(transformed, loss)``: the model's ``hk.transform`` and the float32
  ``loss(params, tokens)`` of one configuration."""
  cfg = gpt_config(size, stack, remat, dtype)
  if stack == "hk_layer_stack":
    def loss(tokens):
      with model_lib.precision(cfg):   # loss_fn enters it itself
        embed, head = model_lib.embed_and_head(cfg)
        x = embed(tokens[:, :-1])
        block = lambda x: model_lib.Block(cfg)(x)  # noqa: E731
        if remat is not None:
          block = hk.remat(block)
        x = hk.layer_stack(cfg.num_layers, name="h")(block)(x)
        logits = head(x).astype(jnp.float32)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
      return jnp.mean(nll)
  else:
    loss = lambda tokens: model_lib.loss_fn(cfg, tokens)[0]  # noqa: E731
  transformed = hk.transform(loss)
  return transformed, lambda p, t: transformed.apply(p, None, t).astype(jnp.float32)


def gpt_tokens(size: dict[str, int], batch: int) -> jax.Array:
  """``batch`` random sequences of ``seq_len + 1`` tokens."""
  return jax.random.randint(jax.random.PRNGKey(1), (batch, size["seq_len"] + 1), 0, VOCAB)


class GPTParams:
  """Float32 parameters, one set per layout (scanned, unrolled, hk.layer_stack),
  shared by every configuration of that layout."""

  def __init__(self, size: dict[str, int]):
    self.size, self.sets = size, {}

  def get(self, stack: str) -> Any:
    """The parameters of ``stack``'s layout, initialised on first use."""
    if stack not in self.sets:
      transformed, _ = gpt_loss(self.size, stack, "none", "float32")
      self.sets[stack] = jax.jit(transformed.init)(jax.random.PRNGKey(0),
                                                   gpt_tokens(self.size, 1))
    return self.sets[stack]


def remat_label(remat: Any) -> str:
  """A remat as the JSON names it."""
  if remat is DEFAULT:
    return "example default (full, keeping the matmul outputs)"
  return "none" if remat is None else str(remat)


# ---------------------------------------------------------------------------
# One part's run: its flags, its payload, its page's section and its plot.


def build_parser(doc: str) -> Any:
  """The flags every accelerator script takes."""
  p = harness.parser(doc)
  p.add_argument("--small", action="store_true",
                 help="CPU sizes (GPT L=4, d=64, T=64), seconds to minutes")
  p.add_argument("--rounds", type=int, default=5, help="timing rounds, order alternated")
  p.add_argument("--steps", type=int, default=4, help="steps per round")
  p.add_argument("--compile_threads", type=int, default=None,
                 help="programs compiled at once (default: 4 on an accelerator, 1 on a CPU)")
  return p


@dataclasses.dataclass(frozen=True)
class Part:
  """What one script measures and shows.

  ``measure(part, sizes, args, options, limit, report)`` fills the dict
  ``part`` (the JSON's ``payload[name]``) at the preset's ``sizes``,
  calling ``report()`` after each step; ``summarise(payload)`` gives
  ``(the part's ratios or None, its goals)``; ``tables(payload)`` the lines
  of its page's tables; ``draw(ax, payload)`` its plot's one panel.
  """

  name: str
  doc: str
  sizes: tuple[str, ...]
  measure: Callable[..., None]
  summarise: Callable[[dict[str, Any]], tuple[Any, dict[str, Optional[bool]]]]
  tables: Callable[[dict[str, Any]], list[str]]
  draw: Callable[[Any, dict[str, Any]], None]
  flags: Callable[[Any], None] = lambda parser: None
  quick: tuple[str, ...] = ()
  config: tuple[str, ...] = ()   # the args the JSON's config records besides these

  def result_name(self) -> str:
    """``accelerator_<part>_<device>``: the JSON's and the plot's name."""
    return f"accelerator_{self.name}_{device_runs.device_slug()}"

  def parser(self) -> Any:
    p = build_parser(self.doc)
    self.flags(p)
    return p


def run_table(payload: dict[str, Any]) -> list[str]:
  """The row every benchmark page starts with: when, on what, how long."""
  env = payload["environment"]
  devices = f"{jax.device_count()} x {env['device']}" if env["backend"] != "cpu" else (
      f"{env['cpu_count']} CPU cores")
  return ["| run | machine | versions | took |", "|---|---|---|---|",
          f"| {env['date_utc'].replace('T', ' ')[:16]} UTC | {devices}; "
          f"{env['backend']} backend, {env['platform'].split('-')[0]} | "
          f"Python {env['python']}, jax {env['jax']}, dm-haiku {env['dm_haiku']} | "
          f"{payload.get('seconds', 0):.0f} s |"]


def summarise(part: Part, payload: dict[str, Any]) -> dict[str, Any]:
  """The part's ratios (``None``: not measured) and its goals."""
  ratios, goals = part.summarise(payload) if payload.get(part.name) else (None, {})
  return {**({part.name: ratios} if ratios is not None else {}), "goals": goals}


def markdown(part: Part, payload: dict[str, Any]) -> str:
  """The page's section: the run, its command, the part's tables, the plot."""
  lines = run_table(payload) + ["", "```bash", payload["command"], "```", ""]
  if payload.get(part.name):
    lines += part.tables(payload)
  failed = payload.get(part.name, {}).get("failed")
  if failed:
    lines += [f"**{part.name}** stopped: " + (
        device_runs.oom_text(failed) if "out_of_memory" in failed else failed["error"])
              + ".", ""]
  goals = (payload.get("summary") or summarise(part, payload))["goals"]
  if goals:
    lines.append("Goals: " + ", ".join(
        f"{k}: {'not measured' if v is None else 'met' if v else 'missed'}"
        for k, v in goals.items()) + ".")
  lines += ["", f"![{payload['name']}](../../benchmarks/results/{payload['name']}.png)"]
  return "\n".join(lines).rstrip()


def draw(part: Part, payload: dict[str, Any]):
  def fig_fn(plt):
    fig, ax = plt.subplots(figsize=(7, 5))
    part.draw(ax, payload)
    fig.suptitle(f"{payload['environment']['device']}, jax {payload['environment']['jax']}")
    return fig
  return fig_fn


def main(part: Part, argv: Optional[list[str]]) -> dict[str, Any]:
  """Runs ``part`` at the preset's sizes; writes its JSON after each step
  and, at the end, its plot."""
  args = harness.parse_args(part.parser, QUICK + list(part.quick), argv)
  if args.compile_threads is None:
    args.compile_threads = 1 if jax.default_backend() == "cpu" else 4
  preset = "quick" if args.quick else "small" if args.small else "accelerator"
  sizes = SIZES[preset]
  # The presets compile with XLA's cheap settings on a CPU: they check that
  # the script runs.
  options = (fast_compile.CODEGEN if (args.quick or args.small)
             and jax.default_backend() == "cpu" else None)
  limit = device_runs.bytes_limit()
  name = part.result_name()
  start = time.perf_counter()
  payload: dict[str, Any] = {
      "question": part.doc.strip().splitlines()[0],
      "command": harness.command_line(), "quick": args.quick, "preset": preset,
      "name": name,
      "config": {"sizes": {k: sizes[k] for k in part.sizes}, "rounds": args.rounds,
                 "steps": args.steps, **{k: getattr(args, k) for k in part.config},
                 "bytes_limit": limit, "compile_threads": args.compile_threads,
                 "fit": device_runs.FIT},
      "environment": harness.environment(),
  }

  def report() -> None:
    payload["seconds"] = time.perf_counter() - start
    payload["summary"] = summarise(part, payload)
    payload["markdown"] = markdown(part, payload)
    harness.write_json(args.results_dir, name, payload)

  harness.log(f"{payload['environment']['device']} ({jax.default_backend()}), memory "
              f"{'not reported' if limit is None else f'{limit / 2**30:.1f} GiB'}; "
              f"preset {preset}; {part.name}")
  payload[part.name] = {}
  try:
    part.measure(payload[part.name], sizes, args, options, limit, report)
  except Exception as e:  # pylint: disable=broad-except
    payload[part.name]["failed"] = device_runs.failure(e)
  payload["seconds"] = time.perf_counter() - start
  payload["summary"] = summarise(part, payload)
  return harness.publish(args, name, payload, lambda p: markdown(part, p),
                         lambda p: draw(part, p))
