r"""Question: does the example GPT learn as well as nanoGPT on the same text?

Trains examples/gpt/train.py with nanoGPT's published CPU configuration for
shakespeare_char (4 layers, 4 heads, 128 wide, block 64, batch 12, 2000
iterations, no dropout, lr 1e-3 decayed to 1e-4 after 100 warmup steps, weight
decay 0.1, gradient clip 1.0) and prints the final validation loss, to compare
with nanoGPT's reported 1.88 on the same text:

  python benchmarks/nanogpt_cpu.py --data_path=shakespeare.txt

Nothing is downloaded: bring the text file (nanoGPT's input.txt). Without
--data_path it trains on the standard-library corpus, whose loss is not
comparable with 1.88. Differences that remain: nanoGPT's AdamW uses beta2 =
0.99 (here optax's 0.999), and nanoGPT evaluates on 200 random batches.
Writes benchmarks/results/nanogpt_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NANOGPT_CPU_FLAGS = {
    "num_layers": 4, "num_heads": 4, "d_model": 128, "seq_len": 64,
    "batch_size": 12, "steps": 2000, "learning_rate": 1e-3,
    "warmup_steps": 100, "weight_decay": 0.1, "grad_clip": 1.0,
    "eval_every": 250, "eval_batches": 200, "log_every": 100,
    "remat": "none", "sample_tokens": 0,
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_path", default=None, help="UTF-8 text file (nanoGPT's input.txt).")
  parser.add_argument("--steps", type=int, default=2000, help="Iterations (nanoGPT: 2000).")
  parser.add_argument("--results_dir", default=os.path.join(REPO, "benchmarks", "results"))
  args = parser.parse_args()
  flags = dict(NANOGPT_CPU_FLAGS, steps=args.steps)
  if args.data_path:
    if not os.path.isfile(args.data_path):
      sys.exit(f"error: --data_path={args.data_path!r} does not exist.")
    flags["data_path"] = os.path.abspath(args.data_path)
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, os.path.join(REPO, "examples", "gpt", "train.py"),
               f"--workdir={workdir}"] + [f"--{k}={v}" for k, v in flags.items()]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - start
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      records = [json.loads(line) for line in f]
  valid = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
  result = {"config": flags, "data_path": args.data_path, "wall_seconds": seconds,
            "valid_loss": valid, "final_valid_loss": valid[-1][1],
            "nanogpt_reported_valid_loss": 1.88 if args.data_path else None}
  os.makedirs(args.results_dir, exist_ok=True)
  with open(os.path.join(args.results_dir, "nanogpt_cpu.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"final validation loss {valid[-1][1]:.4f} after {flags['steps']} steps "
        f"({seconds:.0f} s); nanoGPT reports 1.88 on shakespeare_char")


if __name__ == "__main__":
  main()
