r"""Does the example GPT train faster than nanoGPT on the same CPU, and as well?

Trains ``examples/gpt/train.py`` with nanoGPT's published CPU configuration
for shakespeare_char (4 layers, 4 heads, 128 wide, block 64, batch 12, 2000
iterations, no dropout, lr 1e-3 decayed to 1e-4 after 100 warmup steps,
weight decay 0.1, gradient clip 1.0) and, given a nanoGPT checkout and a
Python with torch, nanoGPT's own ``train.py`` with the same configuration on
the same text, alternating the two programs round by round (ours first in
even rounds, nanoGPT first in odd ones):

  python -m benchmarks.nanogpt_cpu                        # ours alone
  python -m benchmarks.nanogpt_cpu --nanogpt_dir=../nanoGPT \
      --nanogpt_python=/path/to/venv/bin/python --rounds=3  # side by side

Nothing is downloaded. The text is ``--data_path`` (nanoGPT's input.txt, say)
or this Python's standard-library sources (the example's default corpus);
``benchmarks/common/nanogpt_prep.py`` writes it as nanoGPT's train.bin, val.bin and
meta.pkl (the same ids and 90/10 split the example makes), in a temporary
folder that is also nanoGPT's working directory, so nothing is written into
the checkout. torch is never a dependency of this project: the user brings
the Python that has it.

For each run it reports the validation loss after the last step (the mean
over ``--eval_batches`` batches: fixed ones for ours, random ones for
nanoGPT, which also evaluates the training split) and the median step time:
steps are grouped in windows of ``--window`` consecutive steps, each
window's mean training step time is taken without evaluation (ours: what
train.py logs, which leaves evaluation and checkpoints out; nanoGPT: its
per-iteration times, less the iterations that include an evaluation), the
first window (warm-up; ours compiles before its first step) is dropped, and
the median over windows is the run's step time. Training tokens/s is
``batch_size * seq_len`` over it. The headline ratio is ours over nanoGPT,
pooled over every round's windows, with the per-round ratios as its spread.

Ours runs without biases in its linear layers and layer norms
(``--bias=False``), as nanoGPT's configuration does. Differences that remain:
nanoGPT's AdamW uses beta2 = 0.99 (ours optax's 0.999) and decays only
matrices, it ties the output head to the token embedding, and its GELU is
exact (ours the tanh approximation).

Writes ``benchmarks/results/nanogpt_cpu.json`` and ``nanogpt_cpu.png``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from benchmarks.common import harness
from benchmarks.common import nanogpt_prep
from benchmarks.common import report

NAME = "nanogpt_cpu"
TRAIN = harness.REPO_ROOT / "examples" / "gpt" / "train.py"
DATASET = "stacktools_char"  # nanoGPT's --dataset: data/<DATASET>/ in its working directory
# nanoGPT's files this script runs or reads.
NANOGPT_FILES = ("train.py", "model.py", "configurator.py",
                 os.path.join("config", "train_shakespeare_char.py"))
ITER_LINE = re.compile(r"^iter (\d+): loss ([-\d.naninf]+), time ([\d.]+)ms")
EVAL_LINE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
PROGRAMS = ("ours", "nanogpt")
LABELS = {"ours": "examples/gpt (stacktools)", "nanogpt": "nanoGPT (torch)"}
TARGET = 1.10  # ours over nanoGPT, training tokens/s


class RunError(RuntimeError):
  """A training run failed; the message has the end of its output."""


# ---------------------------------------------------------------------------
# The two programs.


def our_flags(args) -> dict[str, Any]:
  """train.py's flags for nanoGPT's CPU configuration (plus the timing window)."""
  return {"num_layers": args.num_layers, "num_heads": args.num_heads,
          "d_model": args.d_model, "seq_len": args.seq_len,
          "batch_size": args.batch_size, "steps": args.steps,
          # nanoGPT's 100 warmup steps; a --quick run of fewer steps warms up
          # over all but its last (train.py refuses a warmup it never ends).
          "learning_rate": 1e-3, "warmup_steps": min(100, args.steps - 1),
          "weight_decay": 0.1,
          "grad_clip": 1.0, "eval_every": args.eval_every,
          "eval_batches": args.eval_batches, "log_every": args.window,
          "remat": args.remat, "bias": False, "sample_tokens": 0}


def nanogpt_args(args) -> dict[str, Any]:
  """nanoGPT's overrides of config/train_shakespeare_char.py: its README's CPU run."""
  return {"device": "cpu", "compile": False, "dataset": DATASET,
          "n_layer": args.num_layers, "n_head": args.num_heads, "n_embd": args.d_model,
          "block_size": args.seq_len, "batch_size": args.batch_size,
          "max_iters": args.steps, "lr_decay_iters": args.steps, "dropout": 0.0,
          "eval_interval": args.eval_every, "eval_iters": args.eval_batches,
          "log_interval": 1}


def _run(command: list[str], cwd: str, log_path: str) -> float:
  """Runs ``command`` with its output in ``log_path``; returns its wall seconds."""
  start = time.perf_counter()
  with open(log_path, "w", encoding="utf-8") as log:
    done = subprocess.run(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                          check=False)
  seconds = time.perf_counter() - start
  if done.returncode:
    with open(log_path, encoding="utf-8") as log:
      tail = log.read()[-4000:]
    raise RunError(f"{shlex.join(command)} exited with {done.returncode}:\n{tail}")
  return seconds


def windows_of(step_seconds: dict[int, float], window: int, steps: int) -> list[dict[str, Any]]:
  """Mean step time of each window of ``window`` steps, from per-step times
  (steps left out, e.g. those with an evaluation, are absent)."""
  out = []
  for end in range(window, steps + 1, window):
    times = [step_seconds[s] for s in range(end - window + 1, end + 1) if s in step_seconds]
    if times:
      out.append({"step": end, "step_time_s": sum(times) / len(times), "steps": len(times)})
  return out


def run_ours(args, data_path: str, tmp: str, index: int) -> dict[str, Any]:
  workdir = os.path.join(tmp, f"ours{index}")
  flags = dict(our_flags(args), data_path=data_path, workdir=workdir)
  command = ([sys.executable, str(TRAIN)] + [f"--{k}={v}" for k, v in flags.items()]
             + shlex.split(args.train_flags))
  seconds = _run(command, str(harness.REPO_ROOT), os.path.join(tmp, f"ours{index}.log"))
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  windows = [{"step": r["step"], "step_time_s": r["step_time_s"], "steps": args.window}
             for r in records if "step_time_s" in r and r["step"] % args.window == 0]
  valid = [[r["step"], r["valid_loss"]] for r in records if "valid_loss" in r]
  return {"command": shlex.join(command[1:]), "wall_s": seconds, "windows": windows,
          "valid_loss": valid}


def run_nanogpt(args, tmp: str, index: int) -> dict[str, Any]:
  cwd = os.path.join(tmp, f"nanogpt{index}")
  os.makedirs(cwd)
  # nanoGPT reads configurator.py and data/<dataset>/ from its working directory.
  shutil.copy(os.path.join(args.nanogpt_dir, "configurator.py"), cwd)
  os.symlink(os.path.join(tmp, "data"), os.path.join(cwd, "data"))
  overrides = dict(nanogpt_args(args), out_dir=os.path.join(cwd, "out"))
  command = ([args.nanogpt_python, os.path.join(args.nanogpt_dir, "train.py"),
              os.path.join(args.nanogpt_dir, "config", "train_shakespeare_char.py")]
             + [f"--{k}={v}" for k, v in overrides.items()])
  log_path = os.path.join(tmp, f"nanogpt{index}.log")
  seconds = _run(command, cwd, log_path)
  step_seconds, valid = {}, []
  with open(log_path, encoding="utf-8") as f:
    for line in f:
      match = ITER_LINE.match(line)
      if match:
        it, ms = int(match.group(1)), float(match.group(3))
        # Iteration i is training step i + 1; an iteration whose number is a
        # multiple of eval_interval evaluated first, inside its time.
        if it < args.steps and it % args.eval_every:
          step_seconds[it + 1] = ms / 1000
      match = EVAL_LINE.match(line)
      if match and int(match.group(1)) > 0:
        valid.append([int(match.group(1)), float(match.group(3))])
  if not step_seconds or not valid:
    raise RunError(f"no iteration or evaluation lines in nanoGPT's output ({log_path})")
  return {"command": shlex.join(command[1:]), "wall_s": seconds,
          "windows": windows_of(step_seconds, args.window, args.steps),
          "valid_loss": valid}


def check_nanogpt_flags(args) -> None:
  if bool(args.nanogpt_dir) != bool(args.nanogpt_python):
    sys.exit("error: --nanogpt_dir and --nanogpt_python go together: the nanoGPT "
             "checkout and a Python that has torch; pass both, or neither to run "
             "ours alone.")
  if not args.nanogpt_dir:
    return
  missing = [f for f in NANOGPT_FILES if not os.path.isfile(os.path.join(args.nanogpt_dir, f))]
  if missing:
    sys.exit(f"error: --nanogpt_dir={args.nanogpt_dir!r} lacks {', '.join(missing)}; "
             "pass a checkout of github.com/karpathy/nanoGPT.")
  args.nanogpt_dir = os.path.abspath(args.nanogpt_dir)


# ---------------------------------------------------------------------------
# Statistics.


def run_summary(run: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
  """Median step time over the run's windows (the first dropped), and more."""
  windows = run["windows"][1:]
  times = sorted(w["step_time_s"] for w in windows)
  median = statistics.median(times)
  quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [median] * 3
  steps = sum(w["steps"] for w in windows)
  seconds = sum(w["step_time_s"] * w["steps"] for w in windows)
  return {"median_step_s": median, "q1_step_s": quartiles[0], "q3_step_s": quartiles[2],
          "tokens_per_s": tokens_per_step / median,
          "mean_tokens_per_s": tokens_per_step * steps / seconds,
          "timed_steps": steps, "final_valid_loss": run["valid_loss"][-1][1]}


def summarise(runs: dict[str, list[dict[str, Any]]], tokens_per_step: int) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for program, program_runs in runs.items():
    if not program_runs:
      continue
    per_run = [run_summary(r, tokens_per_step) for r in program_runs]
    pooled = run_summary({"windows": [w for r in program_runs for w in r["windows"][1:]],
                          "valid_loss": [[0, statistics.median(
                              s["final_valid_loss"] for s in per_run)]]},
                         tokens_per_step)
    # Pooled: every round's windows (each run's first already dropped).
    pooled["runs"] = per_run
    out[program] = pooled
  if runs.get("nanogpt"):
    per_round = [o["tokens_per_s"] / n["tokens_per_s"]
                 for o, n in zip(out["ours"]["runs"], out["nanogpt"]["runs"])]
    ratio = out["ours"]["tokens_per_s"] / out["nanogpt"]["tokens_per_s"]
    out["ours_over_nanogpt"] = {
        "tokens_per_s": ratio, "per_round": per_round,
        "min": min(per_round), "max": max(per_round),
        "mean_tokens_per_s": out["ours"]["mean_tokens_per_s"] / out["nanogpt"]["mean_tokens_per_s"],
        "target": TARGET, "met": ratio >= TARGET,
        "valid_loss_difference": (out["ours"]["final_valid_loss"]
                                  - out["nanogpt"]["final_valid_loss"]),
        "valid_loss_no_worse": out["ours"]["final_valid_loss"] <= out["nanogpt"]["final_valid_loss"]}
  return out


# ---------------------------------------------------------------------------
# Report.


def markdown(payload: dict[str, Any]) -> str:
  summary = payload["summary"]
  lines = report.table(["", "validation loss", "median train step [quartiles]",
                        "training tokens/s (median)", "per run: median step"], "lrrrl")
  for program in ("nanogpt", "ours"):
    s = summary.get(program)
    if s is None:
      continue
    label = LABELS[program]
    if program == "ours":
      label += f", `--remat={payload['config']['remat']}`"
      if payload["config"]["remat"] in ("full", "nested", "offload") and \
          "--save_names" not in payload["config"]["train_flags"]:
        label += " (keeps the matmul outputs)"
      if payload["config"]["train_flags"]:
        label += f" `{payload['config']['train_flags']}`"
    else:
      label += f" {payload['nanogpt_versions']['torch']}, " \
               f"{payload['nanogpt_versions']['torch_threads']} threads"
    per_run = ", ".join(f"{1000 * r['median_step_s']:.1f}" for r in s["runs"])
    losses = ", ".join(f"{r['final_valid_loss']:.3f}" for r in s["runs"])
    lines.append(report.row(
        label, f"{s['final_valid_loss']:.3f} ({losses})",
        f"{1000 * s['median_step_s']:.1f} ms [{1000 * s['q1_step_s']:.1f}, "
        f"{1000 * s['q3_step_s']:.1f}]", f"{s['tokens_per_s'] / 1000:.1f}k", f"{per_run} ms"))
  ratio = summary.get("ours_over_nanogpt")
  if ratio:
    verdict = "met" if ratio["met"] else "**missed**"
    lines.append("")
    lines.append(
        f"ours / nanoGPT, training tokens/s: **{ratio['tokens_per_s']:.2f}x** (per round "
        f"{', '.join(f'{r:.2f}' for r in ratio['per_round'])}; over whole runs "
        f"{ratio['mean_tokens_per_s']:.2f}x); target >= {ratio['target']:.2f}x {verdict}. "
        f"Validation loss ours - nanoGPT: {ratio['valid_loss_difference']:+.3f} "
        f"({'no worse' if ratio['valid_loss_no_worse'] else '**worse**'}).")
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  runs = payload["runs"]

  def fig_fn(plt):
    fig, (ax_time, ax_loss) = plt.subplots(1, 2, figsize=(13, 4.6))
    colors = {"ours": "C0", "nanogpt": "C1"}
    for program, program_runs in runs.items():
      for i, run in enumerate(program_runs):
        label = LABELS[program] if i == 0 else None
        steps = [w["step"] for w in run["windows"][1:]]
        ms = [1000 * w["step_time_s"] for w in run["windows"][1:]]
        ax_time.plot(steps, ms, color=colors[program], alpha=0.6, lw=0.8, label=label)
        ax_loss.plot(*zip(*run["valid_loss"]), color=colors[program], marker="o",
                     alpha=0.7, label=label)
    cfg = payload["config"]
    ax_time.set(title=f"mean step time per {cfg['window']} steps, evaluation left out",
                xlabel="step", ylabel="ms per training step")
    ax_time.set_ylim(bottom=0)
    ax_loss.set(title=f"validation loss ({cfg['eval_batches']} batches)", xlabel="step",
                ylabel="nats per character")
    for ax in (ax_time, ax_loss):
      report.finish(ax, grid="major")
    return fig

  return fig_fn


def build_parser():
  p = harness.parser(__doc__)
  p.add_argument("--nanogpt_dir", default=None,
                 help="a checkout of nanoGPT (with train.py, model.py, configurator.py)")
  p.add_argument("--nanogpt_python", default=None, help="a Python that has torch and numpy")
  p.add_argument("--data_path", default=None,
                 help="UTF-8 text (default: the standard-library corpus)")
  p.add_argument("--rounds", type=int, default=1, help="runs of each program, alternated")
  p.add_argument("--steps", type=int, default=2000, help="iterations (nanoGPT: 2000)")
  p.add_argument("--eval_every", type=int, default=250, help="nanoGPT's eval_interval")
  p.add_argument("--eval_batches", type=int, default=200, help="nanoGPT's eval_iters")
  p.add_argument("--window", type=int, default=10, help="steps per timing window")
  p.add_argument("--remat", default="full",
                 help="train.py's --remat (full, its default, which keeps every "
                 "matmul's output by default, is the fastest here)")
  p.add_argument("--train_flags", default="", help="more flags for train.py, e.g. '--unroll=1'")
  p.add_argument("--num_layers", type=int, default=4)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--d_model", type=int, default=128)
  p.add_argument("--seq_len", type=int, default=64, help="nanoGPT's block_size")
  p.add_argument("--batch_size", type=int, default=12)
  return p


QUICK = ["--steps", "24", "--eval_every", "12", "--eval_batches", "2", "--window", "4",
         "--num_layers", "2", "--num_heads", "2", "--d_model", "16", "--seq_len", "16",
         "--batch_size", "4"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  args = harness.parse_args(build_parser, QUICK, argv)
  check_nanogpt_flags(args)
  if args.data_path and not os.path.isfile(args.data_path):
    sys.exit(f"error: --data_path={args.data_path!r} does not exist.")
  if args.steps % args.window or args.eval_every % args.window:
    sys.exit(f"error: --steps={args.steps} and --eval_every={args.eval_every} must be "
             f"multiples of --window={args.window}.")
  versions = nanogpt_prep.nanogpt_versions(args) if args.nanogpt_dir else None
  start = time.perf_counter()
  runs: dict[str, list[dict[str, Any]]] = {"ours": [], "nanogpt": []}
  with tempfile.TemporaryDirectory(prefix="nanogpt_cpu.") as tmp:
    text = nanogpt_prep.load_text(args.data_path)
    data_path = os.path.join(tmp, "input.txt")
    with open(data_path, "w", encoding="utf-8") as f:
      f.write(text)
    corpus = nanogpt_prep.prepare(text, os.path.join(tmp, "data", DATASET))
    programs = PROGRAMS if args.nanogpt_dir else ("ours",)
    for r in range(args.rounds):
      for program in (programs if r % 2 == 0 else programs[::-1]):
        load = os.getloadavg()[0]
        run = (run_ours(args, data_path, tmp, r) if program == "ours"
               else run_nanogpt(args, tmp, r))
        run.update(round=r, load_before=load, load_after=os.getloadavg()[0])
        runs[program].append(run)
        s = run_summary(run, args.batch_size * args.seq_len)
        harness.log(f"round {r} {program:8s}: median step {1000 * s['median_step_s']:.1f} ms "
                    f"({s['tokens_per_s']:.0f} tokens/s), validation loss "
                    f"{s['final_valid_loss']:.4f}, {run['wall_s']:.0f} s; load "
                    f"{load:.1f} -> {run['load_after']:.1f}")
  runs = {k: v for k, v in runs.items() if v}
  payload = {
      "question": __doc__.strip().splitlines()[0],
      "command": harness.command_line(),
      "quick": args.quick,
      "config": {"ours_flags": our_flags(args), "nanogpt_overrides": nanogpt_args(args)
                 if args.nanogpt_dir else None,
                 "remat": args.remat, "train_flags": args.train_flags,
                 "rounds": args.rounds, "window": args.window,
                 "eval_batches": args.eval_batches,
                 "data": args.data_path or "standard-library corpus", **corpus,
                 "tokens_per_step": args.batch_size * args.seq_len,
                 "statistic": "median over windows of each window's mean training step "
                              "time, evaluation left out, each run's first window dropped; "
                              "pooled over rounds"},
      "nanogpt_versions": versions,
      "runs": runs,
      "summary": summarise(runs, args.batch_size * args.seq_len),
      "seconds": time.perf_counter() - start,
  }
  return harness.publish(args, NAME, payload, markdown, draw)


if __name__ == "__main__":
  main()
