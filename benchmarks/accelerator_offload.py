"""On an accelerator: what does offloading a stack's kept values to the host cost against recomputing them?

A residual MLP (width 2048, batch 8192, L=32, float32) and the example's
GPT at d=2048 with ``remat="full"`` against ``"offload"``: gradients
compared (also with float32 matmuls), device temp and host bytes from the
compiled programs, the steps timed side by side in alternated rounds; and
the host link's bandwidth both ways (measured inside a jitted program, as an
offloading loop moves its carries: see :func:`host_link`), from which the
time that moving the offloaded bytes out and back takes. The GPT's batch is
halved until full's step fits in 80% of ``memory_stats()["bytes_limit"]``.

  python -m benchmarks.accelerator_offload           # on the accelerator
  python -m benchmarks.accelerator_offload --small   # CPU sizes
  python -m benchmarks.accelerator_offload --quick   # the smoke test (tinier still)

Writes ``benchmarks/results/accelerator_offload_<device>.json`` and ``.png``
(``benchmarks/common/accelerator.py``); ``--small`` and ``--quick`` write
into a scratch folder unless ``--results_dir`` is given.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import stacktools as st
from benchmarks.common import accelerator
from benchmarks.common import harness
from benchmarks.common import instruments
from benchmarks.common.accelerator import GPTParams, gpt_loss, gpt_tokens
from benchmarks.common.device_runs import (cells, compile_runs, failure, fit_batch, gib,
                                           hold_programs, max_abs_diff, time_runs, x)

NAME = "accelerator_offload"


def host_link(nbytes: int, reps: int) -> dict[str, Any]:
  """The host link's bandwidth both ways, as an offloading program sees it.

  Inside one jitted program, as offloading moves a loop's carries: ``rows``
  blocks written one by one to a ``pinned_host`` buffer and read back in
  reverse (out and back), and the same blocks read from a ``pinned_host``
  argument (back only). ``jax.device_put`` of a whole array to the host is
  not that link: it allocates and pins a fresh host buffer each call (0.9
  GB/s on a TPU v5e, where the program moves 14 GB/s).
  """
  device = jax.devices()[0]
  out: dict[str, Any] = {"bytes": nbytes, "reps": reps, "device_to_host_gb_s": None,
                         "host_to_device_gb_s": None}
  kinds = sorted(m.kind for m in device.addressable_memories())
  if jax.default_backend() == "cpu":
    out["why_not"] = ("CPU backend: the device's memory is the host's, there is no "
                      "link between them to measure")
    return out
  if "pinned_host" not in kinds:
    out["why_not"] = f"{device.device_kind} has no pinned_host memory (it has {kinds})"
    return out
  rows = 16
  block = jnp.ones((nbytes // rows // 4,), jnp.float32)
  host, on_device = jax.memory.Space.Host, jax.memory.Space.Device

  def read_back(total, row):   # the whole row comes to the device
    return total + jnp.sum(jax.device_put(row, on_device)), None

  def out_and_back():
    def write(_, i):
      return None, jax.device_put(block * i.astype(jnp.float32), host)
    _, hosted = lax.scan(write, None, jnp.arange(rows))
    return lax.scan(read_back, 0.0, hosted, reverse=True)[0]

  hosted = jax.device_put(jnp.ones((rows,) + block.shape, jnp.float32),
                          jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
  programs = {"out_and_back": (jax.jit(out_and_back), ()),
              "back": (jax.jit(lambda h: lax.scan(read_back, 0.0, h)[0]), (hosted,))}
  times: dict[str, list[float]] = {name: [] for name in programs}
  for name, (fn, args) in programs.items():
    jax.block_until_ready(fn(*args))        # compiled and warm
  for _ in range(reps):                     # alternated
    for name, (fn, args) in programs.items():
      times[name].append(instruments.timed(lambda: fn(*args))[0])  # pylint: disable=cell-var-from-loop
  back, both = (instruments.median(times[n]) for n in ("back", "out_and_back"))
  out.update({f"{name}_s": ts for name, ts in times.items()})
  out["host_to_device_gb_s"] = nbytes / back / 1e9
  out["device_to_host_gb_s"] = nbytes / max(both - back, 1e-9) / 1e9
  out["memory_kinds"] = kinds
  return out


def mlp_step(remat: str, size: dict[str, int]):
  """``(loss, (ws, x))`` of the residual MLP ``h + tanh(h @ w)``: a pure-JAX ``st.fold``."""
  width, layers = size["width"], size["layers"]
  ws = jax.random.normal(jax.random.PRNGKey(0), (layers, width, width)) / width ** 0.5
  x = jax.random.normal(jax.random.PRNGKey(1), (size["batch"], width))
  layer = lambda h, w: h + jnp.tanh(h @ w)  # noqa: E731
  loss = lambda ws, x: jnp.mean(st.fold(layer, remat=remat)(x, ws) ** 2)  # noqa: E731
  return jax.value_and_grad(loss), (ws, x)


def full_against_offload(model: str, steps: dict[str, tuple[Callable, tuple]], args,
                         options, fitted=None) -> dict[str, Any]:
  """``full`` and ``offload`` compiled, their gradients compared, timed alternated."""
  remats = ("full", "offload")
  runs = dict(zip(remats, compile_runs(
      [({"label": f"{model}, {remat}", "remat": remat}, *steps[remat],
        fitted if remat == "full" else None) for remat in remats],
      options, args.compile_threads)))
  out = {remat: run.record for remat, run in runs.items()}
  results = {}   # each one's (loss, gradients), on the host
  for remat, run in runs.items():
    if run.ok:
      try:
        results[remat] = jax.tree.map(np.asarray, run.compiled(*run.args))
      except Exception as e:  # pylint: disable=broad-except
        run.record.update(failure(e))
        run.compiled = None
    if not hold_programs():   # timed now, and dropped before the next runs
      time_runs([run], args.rounds, args.steps)
  if hold_programs():
    time_runs(list(runs.values()), args.rounds, args.steps)
  if len(results) == 2:
    (loss_f, grads_f), (loss_o, grads_o) = results["full"], results["offload"]
    out["loss_abs_diff"] = abs(float(loss_f) - float(loss_o))
    out["grads_max_abs_diff"] = max_abs_diff(grads_f, grads_o)
    out["grads_max_abs"] = float(max(np.max(np.abs(g)) for g in jax.tree.leaves(grads_f)))
    out["grads_max_abs_diff_highest"] = exact_grads_diff(steps, options)
  del results
  if all("step_s" in r for r in (out["full"], out["offload"])):
    out["offload_over_full_step"] = out["offload"]["step_s"] / out["full"]["step_s"]
  harness.log(f"  {model}: " + ", ".join(
      f"{remat} {1e3 * out[remat]['step_s']:.1f} ms" for remat in ("full", "offload")
      if "step_s" in out[remat]))
  return out


def exact_grads_diff(steps: dict[str, tuple[Callable, tuple]], options) -> Optional[float]:
  """``full``'s and ``offload``'s gradients compared with float32 matmuls.

  At the default precision a TPU computes a float32 matmul in bfloat16
  passes, and two programs that fuse differently round differently; at
  ``"highest"`` both multiply in float32, so a difference left is
  offload's own. (On a CPU the default is float32 already.)
  """
  grads = []
  for remat in ("full", "offload"):
    fn, fn_args = steps[remat]
    try:
      with jax.default_matmul_precision("highest"):
        compiled = jax.jit(fn).lower(*fn_args).compile(compiler_options=options)
      grads.append(jax.tree.map(np.asarray, compiled(*fn_args)[1]))
    except Exception as e:  # pylint: disable=broad-except
      harness.log(f"  gradients at the highest precision: {failure(e)}")
      return None
    del compiled
  return max_abs_diff(*grads)


def with_transfer(result: dict[str, Any], link: dict[str, Any]) -> dict[str, Any]:
  """Adds the time moving the offloaded bytes out and back takes at the
  measured bandwidths, and offload's step over the larger of it and full's."""
  host = result["offload"].get("host_temp_bytes")
  out, back = link["device_to_host_gb_s"], link["host_to_device_gb_s"]
  if not host or out is None or back is None:
    result["transfer_s"] = None
    result["why_no_transfer"] = ("no bytes offloaded to host memory" if not host
                                 else link.get("why_not", "bandwidth not measured"))
    return result
  result["transfer_s"] = host / (out * 1e9) + host / (back * 1e9)
  if "step_s" in result["offload"] and "step_s" in result["full"]:
    result["offload_over_max_full_transfer"] = result["offload"]["step_s"] / max(
        result["full"]["step_s"], result["transfer_s"])
  return result


def measure(part: dict[str, Any], sizes: dict[str, Any], args, options,
            limit: Optional[int], report: Callable[[], None]) -> None:
  """The host link, then full against offload on the residual MLP and on the
  wide GPT, into ``part``; ``report()`` after each."""
  harness.log("offload: the host link")
  link = host_link(min(sizes["link_bytes"], int(0.1 * limit) if limit else sizes["link_bytes"]),
                   reps=5)
  if link["device_to_host_gb_s"] is not None:
    harness.log(f"  device->host {link['device_to_host_gb_s']:.1f} GB/s, "
                f"host->device {link['host_to_device_gb_s']:.1f} GB/s")
  else:
    harness.log(f"  not measured: {link['why_not']}")
  part["link"] = link
  harness.log("offload: residual MLP")
  mlp = sizes["mlp"]
  part["mlp"] = with_transfer(full_against_offload(
      "MLP", {r: mlp_step(r, mlp) for r in ("full", "offload")}, args, options), link)
  part["mlp"]["size"] = mlp
  gc.collect()
  report()

  wide = sizes["wide_gpt"]
  harness.log(f"offload: GPT at d={wide['d_model']}")
  params = GPTParams(wide)
  step = lambda remat: jax.value_and_grad(  # noqa: E731
      gpt_loss(wide, "scan", remat, "float32")[1])
  batch, fitted, tries = fit_batch(
      wide["batch"], lambda b: jax.jit(step("full")).lower(
          params.get("scan"), gpt_tokens(wide, b)).compile(compiler_options=options),
      limit, "wide gpt")
  tokens = gpt_tokens(wide, batch)
  part["wide_gpt"] = with_transfer(full_against_offload(
      f"GPT d={wide['d_model']}",
      {r: (step(r), (params.get("scan"), tokens)) for r in ("full", "offload")},
      args, options, fitted), link)
  part["wide_gpt"]["size"] = {**wide, "batch": batch}
  part["wide_gpt"]["batch_fitting"] = tries
  del params, fitted
  gc.collect()


def summarise(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Optional[bool]]]:
  """Offload over full (and over the transfer), the link; the goals."""
  goals: dict[str, Optional[bool]] = {}
  part = payload["offload"]
  out = {
      "mlp_offload_over_full_step": part.get("mlp", {}).get("offload_over_full_step"),
      "mlp_offload_over_max_full_transfer":
          part.get("mlp", {}).get("offload_over_max_full_transfer"),
      "wide_gpt_offload_over_full_step":
          part.get("wide_gpt", {}).get("offload_over_full_step"),
      "device_to_host_gb_s": part.get("link", {}).get("device_to_host_gb_s"),
      "host_to_device_gb_s": part.get("link", {}).get("host_to_device_gb_s")}
  compared = [part[k] for k in ("mlp", "wide_gpt") if k in part]
  r = out["mlp_offload_over_max_full_transfer"]
  goals["offload MLP: <= 1.15x max(full, transfer)"] = None if r is None else r <= 1.15
  r = out["wide_gpt_offload_over_full_step"]
  goals["offload GPT d=2048: <= 1.2x full"] = None if r is None else r <= 1.2
  # Compared with float32 matmuls where measured (exact_grads_diff).
  diffs = [m.get("grads_max_abs_diff_highest", m.get("grads_max_abs_diff"))
           for m in compared]
  goals["offload: gradients equal full's (within 1e-5 of their largest)"] = (
      None if not compared or any(d is None for d in diffs)
      else all(d <= 1e-5 * max(1.0, m["grads_max_abs"]) for d, m in zip(diffs, compared)))
  return out, goals


def tables(payload: dict[str, Any]) -> list[str]:
  """Full against offload on each model, and the host link."""
  part = payload["offload"]
  if not part.get("link"):
    return []
  link = part["link"]
  lines = ["**Offload against full** (float32; temp: device, host: the offloaded "
           "bytes; transfer: those bytes out and back at the measured bandwidths):", "",
           "| model | full ms | offload ms | offload / full | full temp GiB | "
           "offload temp GiB | host GiB | transfer ms | offload / max(full, transfer) | "
           "gradients' max abs diff | the same, float32 matmuls |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for key in ("mlp", "wide_gpt"):
    if key not in part:
      continue
    m, size = part[key], part[key]["size"]
    model = (f"residual MLP (width {size['width']}, batch {size['batch']}, L={size['layers']})"
             if key == "mlp" else f"GPT (L={size['layers']}, d={size['d_model']}, "
             f"T={size['seq_len']}, batch {size['batch']})")
    f, o = m["full"], m["offload"]
    lines.append(" | ".join([
        f"| {model}", cells(f)[0], cells(o)[0], x(m.get("offload_over_full_step")),
        gib(f.get("temp_bytes")), gib(o.get("temp_bytes")), gib(o.get("host_temp_bytes")),
        "" if m.get("transfer_s") is None else f"{1e3 * m['transfer_s']:.1f}",
        x(m.get("offload_over_max_full_transfer")),
        "" if m.get("grads_max_abs_diff") is None else f"{m['grads_max_abs_diff']:.1e}",
        "" if m.get("grads_max_abs_diff_highest") is None
        else f"{m['grads_max_abs_diff_highest']:.1e}"]) + " |")
  if link["device_to_host_gb_s"] is not None:
    lines += ["", f"Host link (inside a jitted program: {link['bytes'] / 2**30:.2f} GiB "
              f"in 16 blocks to `pinned_host` and back, median of {link['reps']}): device to "
              f"host {link['device_to_host_gb_s']:.1f} GB/s, host to device "
              f"{link['host_to_device_gb_s']:.1f} GB/s."]
  else:
    lines += ["", f"Host link not measured: {link['why_not']}."]
  return lines + [""]


def draw(ax: Any, payload: dict[str, Any]) -> None:
  """Full's and offload's steps on each model, and the transfer's time."""
  part = payload.get("offload", {})
  models = [k for k in ("mlp", "wide_gpt") if k in part]
  for i, (what, key) in enumerate((("full", "full"), ("offload", "offload"),
                                   ("transfer", None))):
    values = []
    for k in models:
      if key is None:
        values.append(1e3 * (part[k].get("transfer_s") or 0))
      else:
        values.append(1e3 * part[k][key].get("step_s", 0))
    ax.bar([j + 0.25 * (i - 1) for j in range(len(models))], values, width=0.25, label=what)
  ax.set_xticks(range(len(models)), ["residual MLP" if k == "mlp" else "GPT, wide"
                                     for k in models])
  ax.set_ylabel("ms")
  ax.set_title("Offload against full, and the transfer time")
  if models:
    ax.legend(fontsize=8)
  else:   # a run cut short before a model was measured
    ax.set_axis_off()
    ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center",
            transform=ax.transAxes)


PART = accelerator.Part("offload", __doc__, ("mlp", "wide_gpt", "link_bytes"), measure,
                        summarise, tables, draw)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
  return accelerator.main(PART, argv)


if __name__ == "__main__":
  main()
