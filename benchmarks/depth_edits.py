r"""Does progressive stacking (2 layers, grown to 4 by st.take_layers) beat 4 layers from scratch for the same compute, and which layers matter?

Two questions, one process, the example's model (``examples/gpt/model.py``)
and corpus (this Python's standard-library sources):

1. **Progressive stacking against training from scratch, at equal compute.**

   * ``scratch``: 4 layers from a fresh init, ``--steps`` steps;
   * ``progressive``: 2 layers for ``--grow_at`` steps, then grown to 4 with
     ``st.take_layers(params, "h", depth.insert_new(2, 4), new=fresh,
     zero=model.RESIDUAL_OUTPUTS)``: a fresh block after each trained one,
     its residual outputs zero, so the grown model computes what the 2-layer
     one did; the optimizer state is mapped the same way
     (``examples/gpt/restoring.py``'s ``map_opt_state``: the trained
     layers' AdamW moments, zeros for the fresh ones, the step count going
     on), and it trains on as 4 layers until it has spent the compute of
     ``scratch``'s steps.

   Compute is the train step's FLOPs, XLA's count for the same step with
   the layers unrolled (a scan's body would be counted once). Both arms use
   the example's schedule (warmup, cosine decay to a tenth) over their own
   number of steps, and AdamW; both see the same batches in the same order
   (the progressive arm, with cheaper early steps, sees more of them). The
   arms take turns, ``--chunk`` steps each, so a busy machine slows both
   alike: the training seconds of the two are a side-by-side ratio. The
   validation loss (mean over fixed batches) is measured every
   ``--eval_every`` steps of each arm, before and right after the grow.

2. **Pruning: the validation loss with each layer removed.** For each
   trained 4-layer model, ``st.take_layers`` with every layer but one (a
   3-layer model, same parameters otherwise), one row per layer.

  python -m benchmarks.depth_edits            # a few minutes on 2 CPU cores
  python -m benchmarks.depth_edits --quick    # seconds: the smoke test's mode

Writes ``benchmarks/results/depth_edits.json`` and ``depth_edits.png``.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import haiku as hk
import jax
import numpy as np
import optax

from benchmarks.common import harness
from examples.gpt import data as data_lib
from examples.gpt import model as model_lib
from examples.gpt import model_config
from examples.gpt import restoring
from examples.gpt import saving
import stacktools as st
from stacktools import depth

NAME = "depth_edits"
ARMS = ("scratch", "progressive")
LABELS = {"scratch": "4 layers from scratch",
          "progressive": "2 layers, grown to 4 (zeroed fresh layers)"}


def _config(args, vocab_size: int, num_layers: int, **changes) -> model_config.GPTConfig:
  return model_config.GPTConfig(vocab_size=vocab_size, seq_len=args.seq_len,
                                num_layers=num_layers, num_heads=args.num_heads,
                                d_model=args.d_model, remat="none", **changes)


def _model(cfg: model_config.GPTConfig) -> hk.Transformed:
  return hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)))


def _optimizer(args, steps: int) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.learning_rate, min(args.warmup_steps, steps - 1), steps,
      end_value=args.learning_rate / 10)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=args.weight_decay))


def _step_fn(model: hk.Transformed, tx: optax.GradientTransformation):
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(lambda p: model.apply(p, tokens)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def step_flops(args, vocab_size: int, num_layers: int, tokens: np.ndarray) -> float:
  """XLA's FLOPs of one train step, the layers unrolled (a BlockSeq)."""
  model = _model(_config(args, vocab_size, num_layers, stack="unrolled"))
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
  tx = _optimizer(args, 10)
  opt_state = jax.eval_shape(tx.init, params)
  cost = jax.jit(_step_fn(model, tx)).lower(params, opt_state, tokens).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


class Arm:
  """One training schedule, run ``chunk`` steps at a time by :meth:`run`."""

  def __init__(self, name: str, args, dataset: data_lib.CharDataset,
               valid: list[np.ndarray], phases: list[tuple[int, int]], flops: dict[int, float]):
    self.name, self.args, self.dataset, self.valid = name, args, dataset, valid
    self.phases = phases            # (num_layers, steps) in order
    self.flops = flops              # num_layers -> FLOPs per step
    self.curve: list[list[float]] = []   # [step, compute (4-layer steps), valid loss]
    self.seconds = 0.0
    self.events: dict[str, Any] = {}
    self.params: Any = None
    self._losses: dict[int, Any] = {}   # id(model) -> its jitted loss

  def evaluate(self, model: hk.Transformed, params: Any) -> float:
    if id(model) not in self._losses:
      self._losses[id(model)] = jax.jit(lambda p, t: model.apply(p, t)[0])
    loss = self._losses[id(model)]
    return float(np.mean([loss(params, b) for b in self.valid]))

  def run(self) -> Iterator[None]:
    """Trains; yields after every ``chunk`` steps (the turns of the arms)."""
    args = self.args
    total = sum(s for _, s in self.phases)
    tx = _optimizer(args, total)
    sampler = data_lib.BatchSampler(self.dataset.train, args.batch_size, args.seq_len, args.seed)
    tokens = np.zeros((args.batch_size, args.seq_len + 1), np.int32)
    step, compute, params, opt_state, model = 0, 0.0, None, None, None
    for num_layers, steps in self.phases:
      new_model = _model(_config(args, self.dataset.vocab_size, num_layers))
      fresh = new_model.init(jax.random.PRNGKey(args.seed + num_layers), tokens)
      if params is None:
        params, opt_state = fresh, tx.init(fresh)
        self.curve.append([0, 0.0, self.evaluate(new_model, params)])
      else:   # grow: the trained layers, a zeroed fresh one after each
        before = self.evaluate(model, params)
        indices = depth.insert_new(self.phases[0][0], num_layers)
        opt_state = restoring.map_opt_state(saving.flatten(jax.device_get(opt_state)),
                                            jax.device_get(tx.init(fresh)), stack="h",
                                            indices=indices)
        params = st.take_layers(params, "h", indices, new=fresh,
                                zero=model_config.RESIDUAL_OUTPUTS)
        after = self.evaluate(new_model, params)
        self.events = {"grow_step": step, "grow_compute": compute, "indices": indices,
                       "valid_loss_before": before, "valid_loss_after": after}
        harness.log(f"{self.name}: grown at step {step}: validation loss {before:.6f} "
                    f"before, {after:.6f} after")
      model = new_model
      compiled = jax.jit(_step_fn(model, tx)).lower(params, opt_state, tokens).compile()
      for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, sampler.next())
        jax.block_until_ready(loss)
        self.seconds += time.perf_counter() - start
        step += 1
        compute += self.flops[num_layers] / self.flops[4]
        if step % args.eval_every == 0 or step == total:
          self.curve.append([step, compute, self.evaluate(model, params)])
        if step % args.chunk == 0:
          yield
    self.params = params
    self.final_train_loss = float(loss)


def prune(args, vocab_size: int, trained: dict[str, Any], valid: list[np.ndarray]
          ) -> dict[str, Any]:
  """The validation loss of each 4-layer model with each layer removed."""
  full, short = (_model(_config(args, vocab_size, n)) for n in (4, 3))
  full_loss = jax.jit(lambda p, t: full.apply(p, t)[0])
  short_loss = jax.jit(lambda p, t: short.apply(p, t)[0])
  out = {}
  for name, params in trained.items():
    base = float(np.mean([full_loss(params, b) for b in valid]))
    rows = []
    for layer in range(4):
      kept = st.take_layers(params, "h", [i for i in range(4) if i != layer])
      loss = float(np.mean([short_loss(kept, b) for b in valid]))
      rows.append({"layer": layer, "valid_loss": loss, "increase": loss - base})
    out[name] = {"full": base, "rows": rows}
  return out


# ---------------------------------------------------------------------------
# Output.


def markdown(payload: dict[str, Any]) -> str:
  arms, s = payload["arms"], payload["summary"]
  lines = ["| schedule | steps | compute (4-layer steps) | validation loss | training s |",
           "|---|---|---|---|---|"]
  for name in ARMS:
    arm = arms[name]
    lines.append(f"| {LABELS[name]} | {arm['steps']} | {arm['curve'][-1][1]:.1f} | "
                 f"{arm['final_valid_loss']:.4f} | {arm['seconds']:.1f} |")
  grow = arms["progressive"]["events"]
  lines += ["", f"At the grow (step {grow['grow_step']}): validation loss "
            f"{grow['valid_loss_before']:.6f} before, {grow['valid_loss_after']:.6f} after. "
            f"Training time progressive / scratch: {s['seconds_ratio']:.2f}.", "",
            "| layer removed | " + " | ".join(f"{LABELS[n]}: loss (increase)" for n in ARMS) + " |",
            "|---|" + "---|" * len(ARMS)]
  lines.append("| none | " + " | ".join(f"{payload['pruning'][n]['full']:.4f}" for n in ARMS) + " |")
  for layer in range(4):
    cells = [payload["pruning"][n]["rows"][layer] for n in ARMS]
    lines.append(f"| {layer} | " + " | ".join(f"{c['valid_loss']:.4f} ({c['increase']:+.4f})"
                                             for c in cells) + " |")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  def fig_fn(plt):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ARMS:
      curve = np.array(payload["arms"][name]["curve"])
      ax1.plot(curve[:, 1], curve[:, 2], marker=".", label=LABELS[name])
    grow = payload["arms"]["progressive"]["events"]
    ax1.axvline(grow["grow_compute"], color="gray", linestyle=":", label="grow: 2 -> 4 layers")
    ax1.set_xlabel("compute (train steps of the 4-layer model)")
    ax1.set_ylabel("validation loss (nats per character)")
    ax1.set_title("Progressive stacking vs from scratch, same compute")
    ax1.set_ylim(top=min(4.0, ax1.get_ylim()[1]))
    ax1.legend()
    width = 0.38
    for k, name in enumerate(ARMS):
      rows = payload["pruning"][name]["rows"]
      ax2.bar(np.arange(4) + (k - 0.5) * width, [r["increase"] for r in rows], width,
              label=LABELS[name])
    ax2.set_xticks(range(4), [f"layer {i}" for i in range(4)])
    ax2.set_ylabel("validation loss increase with the layer removed")
    ax2.set_title("Pruning: one layer removed at a time")
    ax2.legend()
    fig.tight_layout()
    return fig
  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--steps", type=int, default=300, help="steps of the 4-layer run from scratch")
  p.add_argument("--grow_at", type=int, default=150, help="2-layer steps before the grow")
  p.add_argument("--eval_every", type=int, default=25)
  p.add_argument("--eval_batches", type=int, default=8)
  p.add_argument("--chunk", type=int, default=25, help="steps per turn of each arm")
  p.add_argument("--learning_rate", type=float, default=2e-3)
  p.add_argument("--warmup_steps", type=int, default=30)
  p.add_argument("--weight_decay", type=float, default=0.01)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--seed", type=int, default=0)
  return p


QUICK = ["--steps", "6", "--grow_at", "4", "--eval_every", "2", "--eval_batches", "1",
         "--chunk", "2", "--warmup_steps", "1", "--num_heads", "2", "--d_model", "16",
         "--seq_len", "16", "--batch_size", "4"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()
  dataset = data_lib.load_dataset(None)
  eval_sampler = data_lib.BatchSampler(dataset.valid, args.batch_size, args.seq_len,
                                       args.seed + 1)
  valid = [eval_sampler.next() for _ in range(args.eval_batches)]
  tokens = np.zeros((args.batch_size, args.seq_len + 1), np.int32)
  flops = {n: step_flops(args, dataset.vocab_size, n, tokens) for n in (2, 4)}
  # The progressive arm's 4-layer steps: the compute left of scratch's.
  after = int(round(args.steps - args.grow_at * flops[2] / flops[4]))
  arms = {"scratch": Arm("scratch", args, dataset, valid, [(4, args.steps)], flops),
          "progressive": Arm("progressive", args, dataset, valid,
                             [(2, args.grow_at), (4, after)], flops)}
  runs = {name: arm.run() for name, arm in arms.items()}
  turn = 0
  while runs:   # take turns, the order alternating each round
    order = list(runs) if turn % 2 == 0 else list(runs)[::-1]
    for name in order:
      if next(runs[name], StopIteration) is StopIteration:
        del runs[name]
    turn += 1
  for name, arm in arms.items():
    harness.log(f"{name:12s}: validation loss {arm.curve[-1][2]:.4f} after "
                f"{int(arm.curve[-1][0])} steps ({arm.seconds:.0f} s of training)")
  pruning = prune(args, dataset.vocab_size, {n: arm.params for n, arm in arms.items()}, valid)
  results = {name: {"phases": arm.phases, "steps": sum(s for _, s in arm.phases),
                    "curve": arm.curve, "final_valid_loss": arm.curve[-1][2],
                    "final_train_loss": arm.final_train_loss, "seconds": arm.seconds,
                    "events": arm.events} for name, arm in arms.items()}
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {k: v for k, v in vars(args).items() if k not in ("results_dir",)},
      "flops_per_step": {str(n): f for n, f in flops.items()},
      "arms": results,
      "pruning": pruning,
      "summary": {
          "final_valid_loss": {n: results[n]["final_valid_loss"] for n in ARMS},
          "progressive_minus_scratch": (results["progressive"]["final_valid_loss"]
                                        - results["scratch"]["final_valid_loss"]),
          "seconds_ratio": results["progressive"]["seconds"] / results["scratch"]["seconds"],
          "grow_loss_change": (results["progressive"]["events"]["valid_loss_after"]
                               - results["progressive"]["events"]["valid_loss_before"]),
          "flops_ratio_2_over_4": flops[2] / flops[4],
          "most_needed_layer": {n: max(pruning[n]["rows"], key=lambda r: r["increase"])["layer"]
                                for n in ARMS},
          "least_needed_layer": {n: min(pruning[n]["rows"], key=lambda r: r["increase"])["layer"]
                                 for n in ARMS},
      },
      "environment": harness.environment(),
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
