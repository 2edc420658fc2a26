"""The harness around every benchmark script: its flags, log, JSON and plot.

Every script takes ``--quick`` (tiny sizes, seconds: the smoke test's mode),
``--results_dir`` and ``--no_plot``, prints its results as a Markdown table,
and writes ``<results_dir>/<name>.json`` (with the command line and the
:func:`environment` it ran in) and, when matplotlib is installed,
``<results_dir>/<name>.png``.

Only a full run writes into ``benchmarks/results`` by default, where the
published results live: a run of a preset (``--quick``, or a script's own
``--small``) writes into a scratch folder of its own,
``<tmp>/stacktools-benchmarks/<preset>/`` (:func:`results_dir`), unless
``--results_dir`` is given, so a smoke run never replaces what the docs quote.

The scripts import the shared modules as ``benchmarks.common.<module>``: run
them as modules from the repository root (``python -m benchmarks.memory``),
or from anywhere with the root on ``PYTHONPATH``; no script edits
``sys.path``. A script that runs itself again in a child process does so
with :func:`run_module`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import haiku as hk
import jax

import stacktools as st

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
#: The flags of the presets that write into a scratch folder (``quick``: every
#: script; ``small``: a script's CPU-sized run, where it has one).
PRESETS = ("quick", "small")
SCRATCH_RESULTS_DIR = Path(tempfile.gettempdir()) / "stacktools-benchmarks"
NO_MATPLOTLIB = "matplotlib not installed: skipping the plot (pip install matplotlib)"


# ---------------------------------------------------------------------------
# Command lines.


def parser(doc: Optional[str]) -> argparse.ArgumentParser:
  """An argument parser with the flags every benchmark takes."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  p = argparse.ArgumentParser(
      prog=(f"python -m {spec.name}" if spec is not None
            and spec.name.startswith("benchmarks.") else None),
      description=(doc or "").strip().splitlines()[0] if doc else None,
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes, a few seconds: the smoke test's mode")
  p.add_argument("--results_dir", type=Path, default=None,
                 help="where <name>.json and <name>.png are written (default: "
                      f"{_display(DEFAULT_RESULTS_DIR)}; with --quick or --small, "
                      f"{SCRATCH_RESULTS_DIR}/<preset>, never the published results)")
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
  args.results_dir = results_dir(args)
  return args


def results_dir(args: argparse.Namespace) -> Path:
  """Where this run writes: ``--results_dir`` when given; else
  ``benchmarks/results`` for a full run and a scratch folder for a preset
  (``<tmp>/stacktools-benchmarks/quick``), so that a ``--quick`` or
  ``--small`` run never overwrites the published results of a full one."""
  if args.results_dir is not None:
    return Path(args.results_dir)
  preset = next((p for p in PRESETS if getattr(args, p, False)), None)
  return DEFAULT_RESULTS_DIR if preset is None else SCRATCH_RESULTS_DIR / preset


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


def command_line() -> str:
  """How this run was invoked, for the JSON: ``python -m benchmarks.<name>
  ...`` for a script run as a module."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  if spec is not None and spec.name.startswith("benchmarks."):
    return " ".join(["python", "-m", spec.name] + sys.argv[1:])
  return " ".join(["python", _display(Path(sys.argv[0]))] + sys.argv[1:])


def run_module(module: str, argv: Sequence[str], env: Optional[dict[str, str]] = None,
               **kwargs: Any) -> subprocess.CompletedProcess:
  """Runs ``python -m <module> <argv>`` in a child process, the repository
  root first on its ``PYTHONPATH`` (so it runs from any folder), with
  ``env`` (default: this process's) and ``subprocess.run``'s ``kwargs``."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  return subprocess.run([sys.executable, "-m", module, *argv], env=env, check=False,
                        **kwargs)


def log(message: str) -> None:
  """Prints one progress line at once (flushed)."""
  print(message, flush=True)


# ---------------------------------------------------------------------------
# Results and plots.


def publish(args: argparse.Namespace, name: str, payload: dict[str, Any],
            markdown: Callable[[dict[str, Any]], str],
            draw: Callable[[dict[str, Any]], Callable[[Any], Any]]) -> dict[str, Any]:
  """Prints the results table, writes the JSON and (unless --no_plot) the PNG."""
  payload["markdown"] = markdown(payload)
  print(payload["markdown"])
  write_json(results_dir(args), name, payload)
  if not args.no_plot:
    save_plot(results_dir(args), name, draw(payload))
  return payload


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
  ``environment`` (last); an ``environment`` it already has is kept (a run
  that writes its JSON as it goes states the one it started in).
  """
  results_dir.mkdir(parents=True, exist_ok=True)
  path = results_dir / f"{name}.json"
  env = payload.pop("environment", None) or environment()
  full = {"benchmark": name, **payload, "environment": env}
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


def _display(path: Path) -> str:
  try:
    return str(path.resolve().relative_to(Path.cwd()))
  except ValueError:
    return str(path)
