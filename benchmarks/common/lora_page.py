"""What the ``lora`` page shows: its summary, its table and its figure.

Built from the results' JSON alone (the payload ``benchmarks/lora.py``
writes), over the parts that ran (``--parts``): the ratios the issue set
goals for (:func:`summary`), the table of each against its goal
(:func:`markdown`) and a figure of the parameter bytes, the ratios and the
fine-tunes' losses (:func:`draw`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import report

#: The measurements ``benchmarks/lora.py`` can run, in its order.
PARTS = ("steps", "wide", "gpt2_small", "decode", "quality")


def summary(payload: dict[str, Any]) -> dict[str, float]:
  """The ratios of the parts in ``payload``, by the issue's goals."""
  s, w, g, d, q = (payload.get(k, {}) for k in PARTS)
  return {k: v for k, v in {
      "params_over_base_plus_adapters": s.get("memory", {}).get("over_base_plus_adapters"),
      "train_temp_lora_over_frozen": s.get("lora_over_frozen_temp"),
      "optimizer_state_lora_over_full_gpt2_small": g.get("lora_over_full"),
      "step_time_lora_over_full": s.get("lora_over_full_step_time"),
      "step_time_lora_over_full_wide": w.get("lora_over_full_step_time"),
      "train_temp_lora_over_frozen_wide": w.get("lora_over_frozen_temp"),
      "decode_eight_over_one": d.get("eight_over_one"),
      "quality_lora_gain_over_full_gain": q.get("lora_gain_over_full_gain"),
  }.items() if v is not None}


def markdown(payload: dict[str, Any]) -> str:
  """The goals' table over the parts that ran, then the quality's losses."""
  mib = lambda b: f"{b / 2**20:.2f}"
  rows = []
  if s := payload.get("steps"):
    m = s["memory"]
    rows += [
        ("parameters: base + 8 adapters (MiB)", mib(m["params_with_8_bytes"]), ""),
        ("  over base + 8 x adapter bytes", f"{m['over_base_plus_adapters']:.4f}", "<= 1.01"),
        ("  8 merged copies instead (MiB)", mib(m["eight_merged_copies_bytes"]), ""),
        ("train-step temp: LoRA / frozen base", f"{s['lora_over_frozen_temp']:.3f}", "<= 1.05"),
        ("  temp MiB: full, frozen base, LoRA", ", ".join(
            mib(s["temp_bytes"][n]) for n in ("full", "frozen_base", "lora")), ""),
        ("step time: LoRA / full fine-tune", f"{s['lora_over_full_step_time']:.3f}", "<= 1.15"),
        ("  ms per step: full, LoRA", ", ".join(
            f"{1e3 * s['median_s'][n]:.2f}" for n in ("full", "lora")), "")]
  if w := payload.get("wide"):
    rows += [(f"at width {w['size']['d_model']}: step time LoRA / full",
              f"{w['lora_over_full_step_time']:.3f}", "<= 1.15"),
             (f"at width {w['size']['d_model']}: temp LoRA / frozen base",
              f"{w['lora_over_frozen_temp']:.3f}", "<= 1.05")]
  if g := payload.get("gpt2_small"):
    rows.append(("optimizer state at GPT-2-small: LoRA / full",
                 f"{g['lora_over_full']:.4f}", "<= 0.02"))
  if d := payload.get("decode"):
    rows += [("decode: 8 rows on 8 adapters / on one", f"{d['eight_over_one']:.3f}", "<= 1.15"),
             ("  ms per token: one adapter, 8 adapters", ", ".join(
                 f"{1e3 * d['median_s'][n]:.2f}" for n in ("one_adapter", "eight_adapters")), "")]
  if q := payload.get("quality"):
    rows.append(("quality: LoRA gain / full fine-tune gain",
                 f"{q['lora_gain_over_full_gain']:.3f}", ">= 0.5"))
  lines = report.table(["measure", "value", "goal"], rows, align="lrr")
  if q:
    lines += ["", *report.table(["validation loss on the new text", "nats/char"], [
        ("base", f"{q['base_valid_loss']:.4f}"), ("full fine-tune", f"{q['full_valid_loss']:.4f}"),
        (f"LoRA rank {payload['config']['rank']}", f"{q['lora_valid_loss']:.4f}")])]
  return "\n".join(lines)


def draw(payload: dict[str, Any]):
  """Parameter bytes, the ratios against their goals, the losses: those that ran."""
  def memory(ax):
    m = payload["steps"]["memory"]
    ax.bar(["base", "base + 8 adapters", "8 merged copies"],
           [m[k] / 2**20 for k in ("base_bytes", "params_with_8_bytes", "eight_merged_copies_bytes")])
    ax.set(ylabel="parameter MiB on the device", title="Many adapters, one base")

  def ratios(ax):
    names = {"step_time_lora_over_full": "step time\nLoRA / full",
             "train_temp_lora_over_frozen": "step temp\nLoRA / frozen",
             "decode_eight_over_one": "decode\n8 adapters / 1"}
    shown = {names[k]: v for k, v in payload["summary"].items() if k in names}
    ax.bar(list(shown), list(shown.values()))
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title("Ratios (1: no cost)")

  def quality(ax):
    q = payload["quality"]
    ax.bar(["base", "full", "LoRA"], [q[f"{k}_valid_loss"] for k in ("base", "full", "lora")])
    ax.set(ylabel="validation loss on the new text (nats/char)",
           title="Fine-tuning on another text")

  panels = [f for f, part in ((memory, "steps"), (ratios, None), (quality, "quality"))
            if part is None or part in payload]

  def fig_fn(plt):
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4), squeeze=False)
    for panel, ax in zip(panels, axes[0]):
      panel(ax)
    return fig
  return fig_fn
