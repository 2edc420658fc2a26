r"""Does Muon per layer train the example GPT better than Muon on stacked tensors, and does stochastic depth save step time?

Two questions, one process, the example's model (``examples/gpt/model.py``)
and corpus (this Python's standard-library sources):

1. **Optimizers.** The same model, initialisation, batches and steps,
   trained three ways, and the validation loss after the last step (the mean
   over fixed validation batches):

   * ``adamw``: AdamW on every parameter;
   * ``muon_over_layers``: Muon (``optax.contrib.muon``) on each layer's
     weight matrices through ``st.over_layers``, AdamW on the rest (the
     embeddings, the head, norms and biases), as modded-nanoGPT splits them;
   * ``muon_stacked``: the same split, but Muon given the stacked ``[L, in,
     out]`` weights with its default dimension numbers (reduction axis 0,
     output axis 1), so it orthogonalizes ``(L, in)`` slices, one per output
     column: what Muon does to a stacked tensor unless told otherwise.

   All use the example's schedule (linear warmup, cosine decay to a tenth)
   and gradient clipping; the runs take turns, one round each.

2. **Stochastic depth.** Seconds per training step (forward, backward,
   AdamW) of the same model with ``layer_drop=0.5`` on every layer, against
   ``layer_drop=0`` and against a stack of half the layers (what skipping
   half the layers would cost if skipping were free), timed side by side in
   rounds whose order alternates; each step draws new layers to skip. The
   ratio of medians is the saving.

  python -m benchmarks.layer_rules            # a few minutes on 2 CPU cores
  python -m benchmarks.layer_rules --quick    # seconds: the smoke test's mode

Writes ``benchmarks/results/layer_rules.json`` and ``layer_rules.png``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Optional

import haiku as hk
import jax
import numpy as np
import optax

from benchmarks.common import harness
from examples.gpt import data as data_lib
from examples.gpt import model as model_lib
from examples.gpt import model_config
import stacktools as st

NAME = "layer_rules"
OPTIMIZERS = ("adamw", "muon_over_layers", "muon_stacked")
LABELS = {"adamw": "AdamW", "muon_over_layers": "Muon per layer (st.over_layers)",
          "muon_stacked": "Muon on the stacked tensors"}
DROPS = ("rate_0", "rate_0.5", "half_depth")


# ---------------------------------------------------------------------------
# Optimizers.


def _schedule(peak: float, steps: int, warmup: int):
  return optax.warmup_cosine_decay_schedule(0.0, peak, min(warmup, steps - 1), steps,
                                            end_value=peak / 10)


def _matrices(params):
  """"muon" for the blocks' weight matrices, "adamw" for every other leaf."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "muon" if (str(path[0].key).startswith("h/")
                                 and path[-1].key == "w") else "adamw", params)


def make_optimizer(name: str, args) -> optax.GradientTransformation:
  adamw = optax.adamw(_schedule(args.learning_rate, args.steps, args.warmup_steps),
                      weight_decay=args.weight_decay)
  if name == "adamw":
    tx = adamw
  else:
    dims = None
    if name == "muon_stacked":   # muon's default dimension numbers on [L, in, out]
      dims = lambda p: jax.tree.map(  # pylint: disable=unnecessary-lambda-assignment
          lambda a: optax.contrib.MuonDimensionNumbers() if a.ndim >= 2 else None, p)
    muon = optax.contrib.muon(_schedule(args.muon_learning_rate, args.steps, args.warmup_steps),
                              weight_decay=args.weight_decay,
                              muon_weight_dimension_numbers=dims)
    tx = optax.partition({"muon": muon, "adamw": adamw}, _matrices)
    if name == "muon_over_layers":
      tx = st.over_layers(tx, stacked=["h"])
  return optax.chain(optax.clip_by_global_norm(1.0), tx)


def _config(args, vocab_size: int, **changes) -> model_config.GPTConfig:
  return model_config.GPTConfig(vocab_size=vocab_size, seq_len=args.seq_len,
                                num_layers=args.num_layers, num_heads=args.num_heads,
                                d_model=args.d_model, remat="full", bias=False, **changes)


def train(name: str, args, dataset: data_lib.CharDataset, valid: list[np.ndarray]
          ) -> dict[str, Any]:
  """Trains ``args.steps`` steps with one optimizer; the validation curve."""
  cfg = _config(args, dataset.vocab_size)
  model = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)))
  sampler = data_lib.BatchSampler(dataset.train, args.batch_size, args.seq_len, args.seed)
  params = model.init(jax.random.PRNGKey(args.seed), sampler.next())
  tx = make_optimizer(name, args)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    (loss, _), grads = jax.value_and_grad(model.apply, has_aux=True)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  evaluate = jax.jit(lambda p, t: model.apply(p, t)[0])
  curve, start = [], time.perf_counter()
  for i in range(1, args.steps + 1):
    params, opt_state, loss = step(params, opt_state, sampler.next())
    if i % args.eval_every == 0 or i == args.steps:
      curve.append([i, float(np.mean([evaluate(params, b) for b in valid]))])
  return {"valid_loss": curve, "final_valid_loss": curve[-1][1],
          "final_train_loss": float(loss), "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------------
# Stochastic depth: step time.


@dataclasses.dataclass(frozen=True)
class _UniformDrop(model_config.GPTConfig):
  """The example's config with one drop rate on every layer (not linear)."""

  def drop_rates(self) -> list[float]:
    return [self.layer_drop] * self.num_layers


def time_layer_drop(args, dataset: data_lib.CharDataset) -> dict[str, Any]:
  """Seconds per training step: rate 0, rate 0.5 everywhere, half the depth."""
  sampler = data_lib.BatchSampler(dataset.train, args.batch_size, args.seq_len, args.seed)
  tokens = sampler.next()
  configs = {
      "rate_0": _config(args, dataset.vocab_size),
      "rate_0.5": _UniformDrop(**dataclasses.asdict(_config(args, dataset.vocab_size)) |
                               {"layer_drop": 0.5}),
      "half_depth": _config(args, dataset.vocab_size) if args.num_layers < 2 else
                    dataclasses.replace(_config(args, dataset.vocab_size),
                                        num_layers=args.num_layers // 2),
  }
  steps = {}
  for name, cfg in configs.items():
    model = hk.transform(lambda t, cfg=cfg: model_lib.loss_fn(cfg, t, training=True))
    params = model.init(jax.random.PRNGKey(0), tokens)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)

    def step(params, opt_state, key, tokens, model=model, tx=tx):
      (loss, _), grads = jax.value_and_grad(model.apply, has_aux=True)(params, key, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, opt_state, jax.random.PRNGKey(0), tokens).compile()
    steps[name] = [compiled, params, opt_state]
  seconds = {name: [] for name in configs}
  key = jax.random.PRNGKey(1)
  for r in range(args.rounds):
    for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
      compiled, params, opt_state = steps[name]
      params, opt_state, loss = compiled(params, opt_state, key, tokens)   # warm
      jax.block_until_ready(loss)
      start = time.perf_counter()
      for _ in range(args.timed_steps):
        key, sub = jax.random.split(key)
        params, opt_state, loss = compiled(params, opt_state, sub, tokens)
      jax.block_until_ready(loss)
      seconds[name].append((time.perf_counter() - start) / args.timed_steps)
      steps[name][1:] = [params, opt_state]
  median = {name: statistics.median(s) for name, s in seconds.items()}
  return {"seconds_per_step": seconds, "median_s": median,
          "ratio_drop_over_plain": median["rate_0.5"] / median["rate_0"],
          "ratio_half_depth_over_plain": median["half_depth"] / median["rate_0"]}


# ---------------------------------------------------------------------------
# Output.


def markdown(payload: dict[str, Any]) -> str:
  runs = payload["optimizers"]
  lines = ["| optimizer | validation loss | train loss (last step) |", "|---|---|---|"]
  for name in OPTIMIZERS:
    lines.append(f"| {LABELS[name]} | {runs[name]['final_valid_loss']:.4f} | "
                 f"{runs[name]['final_train_loss']:.4f} |")
  drop = payload["layer_drop"]
  lines += ["", "| training step | ms per step | over layer_drop=0 |", "|---|---|---|"]
  titles = {"rate_0": "layer_drop=0", "rate_0.5": "layer_drop=0.5 (every layer)",
            "half_depth": "half the layers, no drop"}
  for name in DROPS:
    lines.append(f"| {titles[name]} | {1000 * drop['median_s'][name]:.2f} | "
                 f"{drop['median_s'][name] / drop['median_s']['rate_0']:.2f} |")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  def fig_fn(plt):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in OPTIMIZERS:
      curve = np.array(payload["optimizers"][name]["valid_loss"])
      ax1.plot(curve[:, 0], curve[:, 1], marker="o", label=LABELS[name])
    ax1.set_xlabel("step")
    ax1.set_ylabel("validation loss (nats per character)")
    ax1.set_title("GPT example, same steps and data")
    ax1.legend()
    drop = payload["layer_drop"]["median_s"]
    ax2.bar(range(len(DROPS)), [1000 * drop[n] for n in DROPS])
    ax2.set_xticks(range(len(DROPS)), ["drop 0", "drop 0.5", "half depth"])
    ax2.set_ylabel("ms per training step")
    ax2.set_title("Stochastic depth: training step time")
    fig.tight_layout()
    return fig
  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--steps", type=int, default=300, help="training steps per optimizer")
  p.add_argument("--eval_every", type=int, default=50)
  p.add_argument("--eval_batches", type=int, default=8)
  p.add_argument("--learning_rate", type=float, default=2e-3, help="AdamW's peak")
  p.add_argument("--muon_learning_rate", type=float, default=0.02, help="Muon's peak")
  p.add_argument("--warmup_steps", type=int, default=30)
  p.add_argument("--weight_decay", type=float, default=0.01)
  p.add_argument("--num_layers", type=int, default=4)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--drop_layers", type=int, default=8,
                 help="depth of the stochastic-depth timing model")
  p.add_argument("--rounds", type=int, default=5, help="timing rounds, order alternated")
  p.add_argument("--timed_steps", type=int, default=10, help="steps per timing round")
  p.add_argument("--seed", type=int, default=0)
  return p


QUICK = ["--steps", "6", "--eval_every", "3", "--eval_batches", "1", "--warmup_steps", "1",
         "--num_layers", "2", "--num_heads", "2", "--d_model", "16", "--seq_len", "16",
         "--batch_size", "4", "--drop_layers", "2", "--rounds", "2", "--timed_steps", "2"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()
  dataset = data_lib.load_dataset(None)
  eval_sampler = data_lib.BatchSampler(dataset.valid, args.batch_size, args.seq_len,
                                       args.seed + 1)
  valid = [eval_sampler.next() for _ in range(args.eval_batches)]
  optimizers = {}
  for name in OPTIMIZERS:
    optimizers[name] = train(name, args, dataset, valid)
    harness.log(f"{name:18s}: validation loss {optimizers[name]['final_valid_loss']:.4f} "
                f"after {args.steps} steps ({optimizers[name]['seconds']:.0f} s)")
  drop = time_layer_drop(_with(args, num_layers=args.drop_layers), dataset)
  harness.log(f"layer_drop=0.5 over 0: {drop['ratio_drop_over_plain']:.2f}; half the "
              f"depth over full: {drop['ratio_half_depth_over_plain']:.2f}")
  best = min(OPTIMIZERS, key=lambda n: optimizers[n]["final_valid_loss"])
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {k: v for k, v in vars(args).items() if k not in ("results_dir",)},
      "optimizers": optimizers,
      "layer_drop": drop,
      "summary": {
          "final_valid_loss": {n: optimizers[n]["final_valid_loss"] for n in OPTIMIZERS},
          "best": best,
          "muon_over_layers_beats_stacked": (optimizers["muon_over_layers"]["final_valid_loss"]
                                             < optimizers["muon_stacked"]["final_valid_loss"]),
          "drop_step_time_ratio": drop["ratio_drop_over_plain"],
          "half_depth_step_time_ratio": drop["ratio_half_depth_over_plain"],
      },
      "environment": harness.environment(),
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


def _with(args, **changes):
  """A copy of an argparse namespace with ``changes``."""
  out = type(args)(**vars(args))
  for k, v in changes.items():
    setattr(out, k, v)
  return out


if __name__ == "__main__":
  main()
