"""What does each device mesh cost per device in memory, and in step time?

The GPT example's train step (examples/gpt: AdamW, gradient clipping,
``st.Stacked`` blocks with ``remat=full``) over 8 virtual CPU devices, on
the meshes ``data:8``, ``data:4,fsdp:2``, ``data:2,fsdp:4`` and ``fsdp:8``,
with parameters and optimizer state placed by ``st.stacked_partition_specs``
(FSDP on the largest non-Layers axis) as ``train.py --mesh`` places them.
For each mesh:

* the bytes of parameters and of optimizer state that one device holds
  (``addressable_shards``), against the model's total;
* the compiled train step's temp memory per device (``memory_analysis``);
* the steady-state seconds per step (wall and process CPU), timed in
  ``--rounds`` rounds that visit every mesh, in a direction alternating
  every round so that drift in the machine's load cancels;
* the loss after ``--warmup`` steps, against the same steps on one device
  (sharding must not change the numbers).

Eight virtual devices share this machine's cores: the step times show the
cost of the collectives and of splitting small matmuls, not a speed-up.

  python -m benchmarks.sharding               # full run, ~2 min on 2 cores
  python -m benchmarks.sharding --quick       # seconds (the smoke test: 2 meshes)
  python -m benchmarks.sharding --meshes data:8 fsdp:8 --d_model 256

JAX fixes its device count when it starts, so this script puts
``--xla_force_host_platform_device_count=8`` into ``XLA_FLAGS`` before it
imports JAX. Writes ``benchmarks/results/sharding.json`` and ``sharding.png``.
"""

from __future__ import annotations

import sys

from benchmarks.common import virtual_devices

NUM_DEVICES = 8

if "jax" not in sys.modules:
  virtual_devices.ask_for(NUM_DEVICES)

# pylint: disable=wrong-import-position
import time
from typing import Any, Optional

import haiku as hk
import jax
import numpy as np
import optax

from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common import meshes
from examples.gpt import distributed
from examples.gpt import model as model_lib
from examples.gpt import model_config
# pylint: enable=wrong-import-position

NAME = "sharding"
MESHES = ("data:8", "data:4,fsdp:2", "data:2,fsdp:4", "fsdp:8")
QUICK = ["--d_model", "32", "--num_layers", "2", "--num_heads", "2", "--seq_len", "16",
         "--batch_size", "8", "--rounds", "2", "--steps", "2", "--warmup", "2",
         "--meshes", "data:4,fsdp:2", "fsdp:8"]


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--meshes", nargs="+", choices=MESHES, default=list(MESHES),
                 help="meshes over the 8 devices, separated by spaces")
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--num_layers", type=int, default=4)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--vocab_size", type=int, default=96)
  p.add_argument("--remat", default="full")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps per mesh")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--steps", type=int, default=5, help="steps per mesh per round")
  return p


class Setup:
  """One mesh's compiled train step and its (sharded) state.

  Every mesh starts from the same host copy of the initial state, placed with
  the shardings ``train.py`` uses; ``mesh_spec=None`` is the one-device
  reference, without shardings.
  """

  def __init__(self, mesh_spec: Optional[str], train_step, state: tuple, tokens: np.ndarray):
    self.spec = mesh_spec
    params, opt_state = state
    if mesh_spec is None:
      self.mesh = None
      device = jax.devices()[0]
      self.params, self.opt_state, self.batch = jax.device_put((params, opt_state, tokens),
                                                               device)
      step = jax.jit(train_step)
    else:
      self.mesh = distributed.make_mesh(distributed.parse_mesh(mesh_spec, jax.device_count()))
      param_shardings = distributed.tree_shardings(self.mesh, params)
      opt_shardings = distributed.tree_shardings(self.mesh, opt_state)
      batch_sharding = distributed.batch_sharding(self.mesh)
      replicated = distributed.replicated(self.mesh)
      self.params = distributed.put_tree(params, param_shardings)
      self.opt_state = distributed.put_tree(opt_state, opt_shardings)
      self.batch = distributed.put_global(tokens, batch_sharding)
      step = jax.jit(train_step,
                     in_shardings=(param_shardings, opt_shardings, batch_sharding),
                     out_shardings=(param_shardings, opt_shardings, replicated))
    start = time.perf_counter()
    self.step = step.lower(self.params, self.opt_state, self.batch).compile()
    self.compile_s = time.perf_counter() - start
    self.memory = self.step.memory_analysis()
    self.loss = None

  def run(self, steps: int) -> tuple[float, float]:
    """Wall-clock and process-CPU seconds per step over ``steps`` steps."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
      self.params, self.opt_state, self.loss = self.step(self.params, self.opt_state,
                                                         self.batch)
    instruments.block((self.params, self.opt_state, self.loss))
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps

  def row(self) -> dict[str, Any]:
    return {
        "mesh": self.spec, "mesh_shape": dict(self.mesh.shape),
        "param_bytes_per_device": distributed.per_device_bytes(self.params),
        "opt_bytes_per_device": distributed.per_device_bytes(self.opt_state),
        "temp_bytes": int(self.memory.temp_size_in_bytes),
        "argument_bytes": int(self.memory.argument_size_in_bytes),
        "compile_seconds": self.compile_s,
    }


def markdown(payload: dict[str, Any]) -> str:
  total = payload["total_bytes"]
  lines = [f"Model: {payload['config']['num_params']:,} parameters; "
           f"{(total['params'] + total['opt_state']) / 1024:.0f} KiB of parameters + "
           "optimizer state in all.", "",
           "| mesh | params + opt state per device (KiB) | x total | train-step temp "
           "(KiB) | state + temp (KiB) | ms/step (wall) | ms/step (CPU) "
           "| loss rel. diff vs 1 device |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  whole = total["params"] + total["opt_state"]
  for r in payload["meshes"]:
    held = r["param_bytes_per_device"] + r["opt_bytes_per_device"]
    lines.append(f"| {r['mesh']} | {held / 1024:.1f} | {held / whole:.3f} | "
                 f"{r['temp_bytes'] / 1024:.1f} | {(held + r['temp_bytes']) / 1024:.1f} | "
                 f"{r['step_seconds'] * 1e3:.1f} | "
                 f"{r['step_cpu_seconds'] * 1e3:.1f} | {r['loss_rel_diff']:.1e} |")
  lines.append("")
  lines.append("8 virtual CPU devices on one machine's cores: time shows the cost of "
               "the collectives, not a speed-up (median over rounds). FSDP gathers each "
               "weight for the step, so temp memory grows as the resident state shrinks.")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  rows = payload["meshes"]
  names = [r["mesh"] for r in rows]
  total = payload["total_bytes"]

  def fig_fn(plt):
    fig, (ax_mem, ax_temp, ax_time) = plt.subplots(1, 3, figsize=(14, 4.2))
    pos = np.arange(len(rows))
    params = np.array([r["param_bytes_per_device"] for r in rows]) / 1024
    opt = np.array([r["opt_bytes_per_device"] for r in rows]) / 1024
    ax_mem.bar(pos, params, label="parameters")
    ax_mem.bar(pos, opt, bottom=params, label="optimizer state")
    ax_mem.axhline((total["params"] + total["opt_state"]) / 1024, color="gray",
                   linestyle="--", label="whole model (1 device)")
    ax_mem.set_ylabel("KiB per device")
    ax_mem.set_title("Parameters + optimizer state per device\n(st.stacked_partition_specs)")
    ax_mem.legend(fontsize=8)
    ax_temp.bar(pos, [r["temp_bytes"] / 1024 for r in rows], color="C2")
    ax_temp.set_ylabel("KiB per device")
    ax_temp.set_title("Train step: compiled temp memory\n(all-gathered weights live here)")
    ax_time.bar(pos, [r["step_seconds"] * 1e3 for r in rows], color="C3", label="wall")
    ax_time.plot(pos, [r["step_cpu_seconds"] * 1e3 for r in rows], "D", color="black",
                 label="process CPU")
    ax_time.set_ylabel("ms per step")
    ax_time.set_title("Steady-state step time\n(8 virtual devices sharing the CPU cores)")
    ax_time.legend(fontsize=8)
    for ax in (ax_mem, ax_temp, ax_time):
      ax.set_xticks(pos, [n.replace(",", ",\n") for n in names])
      ax.set_xlabel("mesh")
      ax.grid(True, axis="y", alpha=0.3)
    return fig

  return fig_fn


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  if jax.device_count() < NUM_DEVICES:
    raise SystemExit(
        f"error: benchmarks/sharding.py needs {NUM_DEVICES} devices and JAX has "
        f"{jax.device_count()}: run it as a script (it sets XLA_FLAGS={virtual_devices.FLAG}="
        f"{NUM_DEVICES} before importing JAX), or set that flag yourself.")
  start = time.perf_counter()
  cfg = model_config.GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len,
                               num_layers=args.num_layers, num_heads=args.num_heads,
                               d_model=args.d_model, remat=args.remat)
  model = hk.without_apply_rng(hk.transform(lambda t: model_lib.loss_fn(cfg, t)))
  # As train.py: clipping, then AdamW with warmup and cosine decay.
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 2e-3, 2, 1000, 2e-4), weight_decay=0.01))
  tokens = np.random.default_rng(0).integers(
      0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1)).astype(np.int32)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
  state = jax.device_get((params, jax.jit(optimizer.init)(params)))

  def train_step(params, opt_state, tokens):
    (loss, _), grads = jax.value_and_grad(model.apply, has_aux=True)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  reference = Setup(None, train_step, state, tokens)
  reference.run(args.warmup)
  reference_loss = float(reference.loss)
  totals = {"params": meshes.total_bytes(reference.params),
            "opt_state": meshes.total_bytes(reference.opt_state)}
  num_params = int(sum(x.size for x in jax.tree_util.tree_leaves(reference.params)))
  harness.log(f"1 device: loss {reference_loss:.6f} after {args.warmup} steps; "
              f"{totals['params'] / 1024:.1f} KiB params, "
              f"{totals['opt_state'] / 1024:.1f} KiB optimizer state")
  del reference

  setups = []
  for spec in args.meshes:
    setup = Setup(spec, train_step, state, tokens)
    setup.run(args.warmup)  # the same steps as the reference
    setup.warm_loss = float(setup.loss)
    setups.append(setup)
    harness.log(f"{spec}: compiled in {setup.compile_s:.1f}s; loss {setup.warm_loss:.6f}")

  wall = {s.spec: [] for s in setups}
  cpu = {s.spec: [] for s in setups}
  for r in range(args.rounds):
    for setup in (setups if r % 2 == 0 else setups[::-1]):
      w, c = setup.run(args.steps)
      wall[setup.spec].append(w)
      cpu[setup.spec].append(c)
    harness.log(f"round {r}: " + ", ".join(f"{s} {wall[s][-1] * 1e3:.1f}ms" for s in wall))

  rows = []
  for setup in setups:
    row = setup.row()
    row.update({
        "held_fraction": (row["param_bytes_per_device"] + row["opt_bytes_per_device"])
                         / (totals["params"] + totals["opt_state"]),
        "step_seconds": instruments.median(wall[setup.spec]),
        "step_cpu_seconds": instruments.median(cpu[setup.spec]),
        "step_seconds_per_round": wall[setup.spec],
        "loss_after_warmup": setup.warm_loss,
        "loss_rel_diff": abs(setup.warm_loss - reference_loss) / abs(reference_loss),
    })
    rows.append(row)
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {"gpt": {"vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len,
                         "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                         "d_model": cfg.d_model, "remat": args.remat},
                 "batch_size": args.batch_size, "num_params": num_params,
                 "devices": jax.device_count(), "meshes": args.meshes,
                 "warmup": args.warmup, "rounds": args.rounds, "steps": args.steps,
                 "sharding": "st.stacked_partition_specs(stacked=['h']) over the fsdp "
                             "axis; the batch over data",
                 "optimizer": "clip_by_global_norm(1.0) + adamw(warmup cosine)"},
      "total_bytes": totals,
      "reference_loss": reference_loss,
      "meshes": rows,
      "summary": {r["mesh"]: {"held_fraction": round(r["held_fraction"], 4),
                              "temp_bytes": r["temp_bytes"],
                              "ms_per_step": round(r["step_seconds"] * 1e3, 2)}
                  for r in rows},
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
