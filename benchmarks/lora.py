r"""Do low-rank adapters over a stacked GPT cost only their own bytes, train as fast as a full fine-tune, decode many adapters at once, and learn a new text?

The example's model (``examples/gpt/model.py``) with ``st.adapters.lora`` on
every linear layer of its blocks (``attn`` and ``mlp``), side by side in one
process; ``--parts`` picks among:

* ``steps``: **parameter memory**, the bytes on the device of one base and 8
  rank-8 adapters (``st.adapters.stack``, then ``join``: the base is never
  copied) against the base plus 8 adapters' own bytes and against 8 merged
  copies; **train-step memory**, the compiled temp of the LoRA train step
  (adapters' gradients, AdamW on them) against the *frozen-base* step (the
  same loss, backward through every layer, only the token embedding's
  gradient) and the full fine-tune's; **step time**, LoRA against the full
  fine-tune, rounds in alternating order, the ratio of medians.
* ``wide``: the same at :data:`WIDE` (width 512), where a step's time is its
  matmuls' rather than the per-op overhead of width 128.
* ``gpt2_small``: AdamW's state, rank-8 adapters / a full fine-tune (GPT-2-small).
* ``decode``: a decode step (one token, the in-place KV cache) of 8 rows each
  on its own adapter (an index per row) against 8 rows on one adapter.
* ``quality``: a base trained on the example's corpus (standard-library
  Python) is fine-tuned on another text (this repository's docs): a full and
  a rank-8 LoRA fine-tune of the same steps; the LoRA's gain in validation
  loss on the new text as a fraction of the full fine-tune's.

  python -m benchmarks.lora            # a few minutes on 2 CPU cores
  python -m benchmarks.lora --quick    # seconds: the smoke test's mode
  python -m benchmarks.lora --parts steps,decode --dtype bfloat16 \
      --num_layers 12 --d_model 768 --num_heads 12 --seq_len 1024 --batch_size 8

Writes ``benchmarks/results/lora.json`` and ``lora.png`` (on an accelerator
``lora_<device>``: the last command, at GPT-2-small's shape on a TPU).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import device_runs
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import lora_page
from examples.gpt import data as data_lib
from examples.gpt import decoding
from examples.gpt import lora as lora_lib
from examples.gpt import model as model_lib
from examples.gpt import model_config
import stacktools as st

NAME = "lora"
PARTS = lora_page.PARTS
ADAPTERS = 8
#: The steps part again at a width where a step's time is its matmuls'.
#: A quick run's is the steps part's own size: the same programs, compiled once.
WIDE = {"full": dict(d_model=512, num_heads=8, seq_len=128, batch_size=8)}
GPT2_SMALL = dict(vocab_size=50257, seq_len=1024, num_layers=12, num_heads=12, d_model=768)


def _cfg(args, vocab_size: int, rank: int = 0, **changes) -> model_config.GPTConfig:
  return model_config.GPTConfig(
      vocab_size=vocab_size, seq_len=args.seq_len, num_layers=args.num_layers,
      num_heads=args.num_heads, d_model=args.d_model, remat="full", lora_rank=rank,
      lora_targets="attn,mlp", dtype=args.dtype, **changes)


def _loss(cfg: model_config.GPTConfig) -> hk.Transformed:
  return hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)[0]))


def _nbytes(tree: Any) -> int:
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _live_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays())


def _trained_like(adapters: Any, seed: int) -> Any:
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return treedef.unflatten([a + 0.02 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


@functools.lru_cache
def _steps(cfg, lora_cfg):
  """AdamW and the three train steps: LoRA (adapters, base), frozen base (the
  token embedding alone), full fine-tune (every parameter); the same functions
  for the same configurations, so jit compiles each program once."""
  tx = optax.adamw(1e-3)
  def full(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(_loss(cfg).apply)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def frozen(embed, opt_state, tokens, base):
    loss_of = lambda e: _loss(cfg).apply({**base, "tok_embed": e}, tokens)
    loss, grads = jax.value_and_grad(loss_of)(embed)
    updates, opt_state = tx.update(grads, opt_state, embed)
    return optax.apply_updates(embed, updates), opt_state, loss

  def lora(adapters, opt_state, tokens, base):
    model = hk.Transformed(None, lambda p, t, training=False, seed=None: (
        _loss(lora_cfg).apply(p, t), None))
    return lora_lib.make_train_step(model, tx)(adapters, opt_state, tokens, base)[:3]

  return tx, full, frozen, lora


def measure_steps(args, vocab_size: int, tokens: np.ndarray) -> dict[str, Any]:
  """Parts 1, 2 and 4: parameter bytes, train-step temp memory, step time."""
  cfg, lora_cfg = _cfg(args, vocab_size), _cfg(args, vocab_size, rank=args.rank)
  before = _live_bytes()
  base = _loss(cfg).init(jax.random.PRNGKey(0), tokens)
  base_bytes = _live_bytes() - before
  one = st.adapters.split(_loss(lora_cfg).init(jax.random.PRNGKey(1), tokens))[1]
  before = _live_bytes()
  many = [_trained_like(one, seed) for seed in range(ADAPTERS)]
  stacked = st.adapters.stack(many)
  del many   # what lives on: the stacked adapters, beside the one base
  joined = st.adapters.join(base, stacked)   # no copy: the same buffers
  memory = {"base_bytes": base_bytes, "adapter_bytes": _nbytes(one),
            "params_with_8_bytes": base_bytes + _live_bytes() - before,
            "eight_merged_copies_bytes": ADAPTERS * base_bytes}
  memory["over_base_plus_adapters"] = memory["params_with_8_bytes"] / (
      base_bytes + ADAPTERS * memory["adapter_bytes"])
  del joined
  tx, full, frozen, lora = _steps(cfg, lora_cfg)
  runs = {"full": (full, [base, tx.init(base), tokens]),
          "frozen_base": (frozen, [base["tok_embed"], tx.init(base["tok_embed"]), tokens, base]),
          "lora": (lora, [one, tx.init(one), tokens, base])}
  compiled, temp = {}, {}
  for name, (fn, inputs) in runs.items():
    compiled[name] = jax.jit(fn, donate_argnums=(0, 1)).lower(*inputs).compile()
    temp[name] = int(compiled[name].memory_analysis().temp_size_in_bytes)
  seconds = {"full": [], "lora": []}
  state = {n: list(runs[n][1]) for n in seconds}
  for r in range(args.rounds):
    for name in (["full", "lora"] if r % 2 == 0 else ["lora", "full"]):
      inputs = state[name]
      inputs[:2] = [jax.tree.map(jnp.copy, t) for t in inputs[:2]]   # donated below
      out = instruments.block(compiled[name](*inputs))   # warm
      inputs[:2] = out[:2]
      start = time.perf_counter()
      for _ in range(args.timed_steps):
        out = compiled[name](*inputs)
        inputs[:2] = out[:2]
      instruments.block(out)
      seconds[name].append((time.perf_counter() - start) / args.timed_steps)
  median = {n: statistics.median(s) for n, s in seconds.items()}
  return {"memory": memory, "temp_bytes": temp,
          "lora_over_frozen_temp": temp["lora"] / temp["frozen_base"],
          "seconds_per_step": seconds, "median_s": median,
          "lora_over_full_step_time": median["lora"] / median["full"]}


def gpt2_small_optimizer_state(rank: int) -> dict[str, Any]:
  """Part 3: AdamW's state bytes, LoRA against a full fine-tune (shapes only)."""
  cfg = model_config.GPTConfig(**GPT2_SMALL, lora_rank=rank, lora_targets="attn,mlp")
  shapes = jax.eval_shape(_loss(cfg).init, jax.random.PRNGKey(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))
  base, adapters = st.adapters.split(shapes)
  tx = optax.adamw(1e-3)
  full, lora = (_nbytes(jax.eval_shape(tx.init, t)) for t in (base, adapters))
  return {"full_bytes": full, "lora_bytes": lora, "lora_over_full": lora / full,
          "base_params": sum(int(np.prod(a.shape)) for a in jax.tree.leaves(base)),
          "adapter_params": sum(int(np.prod(a.shape)) for a in jax.tree.leaves(adapters))}


def measure_decode(args, vocab_size: int) -> dict[str, Any]:
  """Part 5: seconds per decode step, 8 rows on 8 adapters against on one."""
  one_cfg = _cfg(args, vocab_size, rank=args.rank)
  many_cfg = dataclasses.replace(one_cfg, lora_count=ADAPTERS)
  tokens = jnp.zeros((ADAPTERS, 1), jnp.int32)
  params = _loss(one_cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, args.seq_len), jnp.int32))
  base, one = st.adapters.split(params)
  setups = {"one_adapter": (one_cfg, st.adapters.join(base, _trained_like(one, 0)), None),
            "eight_adapters": (many_cfg, st.adapters.join(base, st.adapters.stack(
                [_trained_like(one, s) for s in range(ADAPTERS)])), jnp.arange(ADAPTERS))}
  steps = {}
  for name, (cfg, p, index) in setups.items():
    model = hk.without_apply_rng(hk.transform(
        lambda t, c, pos, i, cfg=cfg: decoding.decode(cfg, t, c, pos, adapter_index=i)))
    step = jax.jit(lambda p, t, c, pos, i, model=model: model.apply(p, t, c, pos, i),
                   donate_argnums=2)
    steps[name] = (step, p, index)
  seconds = {n: [] for n in setups}
  for r in range(args.rounds):
    for name in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
      step, p, index = steps[name]
      cache = decoding.init_cache(setups[name][0], ADAPTERS)
      logits, cache = instruments.block(step(p, tokens, cache, 0, index))   # warm
      start = time.perf_counter()
      for pos in range(1, args.decode_tokens + 1):
        logits, cache = step(p, tokens, cache, pos, index)
      instruments.block(logits)
      seconds[name].append((time.perf_counter() - start) / args.decode_tokens)
  median = {n: statistics.median(s) for n, s in seconds.items()}
  return {"seconds_per_token": seconds, "median_s": median,
          "eight_over_one": median["eight_adapters"] / median["one_adapter"]}


def _train(cfg, params, trainable, tx, dataset, args, steps, valid, seed):
  """Trains ``trainable(params) -> (train, rest, join)`` for ``steps``; the
  validation losses on ``valid`` before and after."""
  train, rest, join = trainable(params)
  loss = _loss(cfg)
  evaluate = jax.jit(lambda t, r, b: loss.apply(join(t, r), b))
  opt_state = tx.init(train)

  @jax.jit
  def step(train, opt_state, rest, tokens):
    value, grads = jax.value_and_grad(lambda t: loss.apply(join(t, rest), tokens))(train)
    updates, opt_state = tx.update(grads, opt_state, train)
    return optax.apply_updates(train, updates), opt_state, value

  before = float(np.mean([evaluate(train, rest, b) for b in valid]))
  sampler = data_lib.BatchSampler(dataset.train, args.batch_size, args.seq_len, seed)
  for _ in range(steps):
    train, opt_state, _ = step(train, opt_state, rest, sampler.next())
  after = float(np.mean([evaluate(train, rest, b) for b in valid]))
  return join(train, rest), before, after


def _schedule(peak, steps):
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 10), steps, peak / 10)


def measure_quality(args) -> dict[str, Any]:
  """Part 6: base on the corpus, then full and LoRA fine-tunes on the docs."""
  corpus = data_lib.load_dataset(None)
  docs = "\n".join(p.read_text(encoding="utf-8")
                   for p in sorted((harness.REPO_ROOT / "docs").rglob("*.md")))
  docs = "".join(c for c in docs if c in corpus.chars)
  ids = corpus.encode(docs)
  split = int(0.9 * len(ids))
  new = data_lib.CharDataset(chars=corpus.chars, train=ids[:split], valid=ids[split:])
  valid_sampler = data_lib.BatchSampler(new.valid, args.batch_size, args.seq_len, 1)
  valid = [valid_sampler.next() for _ in range(args.eval_batches)]
  cfg, lora_cfg = _cfg(args, corpus.vocab_size), _cfg(args, corpus.vocab_size, rank=args.rank)
  whole = lambda p: (p, {}, lambda t, r: t)
  base0 = _loss(cfg).init(jax.random.PRNGKey(0), valid[0])
  base, _, _ = _train(cfg, base0, whole, optax.adamw(_schedule(args.learning_rate,
                                                                args.base_steps)),
                      corpus, args, args.base_steps, valid, 0)
  _, start, full = _train(cfg, base, whole, optax.adamw(_schedule(args.learning_rate,
                                                                  args.tune_steps)),
                          new, args, args.tune_steps, valid, 2)
  fresh = st.adapters.split(_loss(lora_cfg).init(jax.random.PRNGKey(3), valid[0]))[1]
  adapters = lambda p: (fresh, p, lambda t, r: st.adapters.join(r, t))
  _, lora_start, lora = _train(lora_cfg, base, adapters, optax.adamw(_schedule(
      args.lora_learning_rate, args.tune_steps)), new, args, args.tune_steps, valid, 2)
  assert abs(lora_start - start) < 1e-4, (lora_start, start)   # a fresh adapter: the base
  return {"base_valid_loss": start, "full_valid_loss": full, "lora_valid_loss": lora,
          "lora_gain_over_full_gain": (start - lora) / (start - full)}


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--num_layers", type=int, default=4)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5, help="timing rounds, order alternated")
  p.add_argument("--timed_steps", type=int, default=10, help="train steps per round")
  p.add_argument("--decode_tokens", type=int, default=32, help="decode steps per round")
  p.add_argument("--base_steps", type=int, default=400, help="the base's training steps")
  p.add_argument("--tune_steps", type=int, default=150, help="each fine-tune's steps")
  p.add_argument("--learning_rate", type=float, default=2e-3)
  p.add_argument("--lora_learning_rate", type=float, default=1e-2)
  p.add_argument("--eval_batches", type=int, default=8)
  p.add_argument("--dtype", default="float32", choices=model_config.DTYPES,
                 help="the compute dtype (GPTConfig.dtype): bfloat16 on a TPU")
  p.add_argument("--parts", type=harness.str_list(PARTS), default=list(PARTS),
                 help="which measurements to run, comma-separated")
  return p


QUICK = ["--num_layers", "2", "--num_heads", "2", "--d_model", "16", "--seq_len", "16",
         "--batch_size", "4", "--rank", "2", "--rounds", "2", "--timed_steps", "2",
         "--decode_tokens", "2", "--base_steps", "4", "--tune_steps", "2",
         "--eval_batches", "1"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  start = time.perf_counter()
  corpus = data_lib.load_dataset(None)
  wide = {k: getattr(args, k) for k in WIDE["full"]} if args.quick else WIDE["full"]

  def steps_at(a):
    return measure_steps(a, corpus.vocab_size,
                         data_lib.BatchSampler(corpus.train, a.batch_size, a.seq_len, 0).next())

  measures = {"steps": lambda: steps_at(args),
              "wide": lambda: {"size": wide, **steps_at(type(args)(**{**vars(args), **wide}))},
              "gpt2_small": lambda: gpt2_small_optimizer_state(8),
              "decode": lambda: measure_decode(args, corpus.vocab_size),
              "quality": lambda: measure_quality(args)}
  payload = {"question": __doc__.strip().splitlines()[0], "command": harness.command_line(),
             "quick": args.quick, "config": {**vars(args), "results_dir": None}}
  for part in args.parts:
    payload[part] = measures[part]()
    harness.log(f"{part}: {lora_page.summary({part: payload[part]})}")
  payload.update(summary=lora_page.summary(payload), environment=harness.environment(),
                 seconds=time.perf_counter() - start)
  return harness.publish(args, NAME if jax.default_backend() == "cpu" else
                         f"{NAME}_{device_runs.device_slug()}", payload, lora_page.markdown,
                         lora_page.draw)


if __name__ == "__main__":
  main()
