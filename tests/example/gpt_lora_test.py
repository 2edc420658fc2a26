"""Tests for the example's low-rank adapters: train.py --lora_rank, sample.py --adapters.

Every claim against an independent reference:

* the checkpoints of a LoRA run hold its adapters and their optimizer state,
  no base parameter; its base's checkpoint is bit for bit what it was;
* a LoRA run stopped and resumed (--resume) trains as one that never stopped;
* --export_npz writes the merged parameters: the base's, with each adapted
  ``w`` plus ``(alpha / rank) * lora_a @ lora_b``, computed here in numpy from
  the run's own checkpoint;
* that export is a run: sample.py --workdir=<it> decodes greedily what the
  LoRA run decodes on its adapters, and --init_from=<it> starts from exactly
  its parameters (a run at learning rate 0 keeps them);
* sample.py --adapters=A,B decodes each row on its own adapters, greedily
  the text that --adapters=A and --adapters=B decode alone;
* mistakes stop at start-up with one line and write nothing (a missing or
  unreadable export among them);
* the loss a LoRA run trains is the loss of the merged parameters: each
  adapter added once, as sampling and the export add it.
"""

import json
import os

import jax
import numpy as np
import pytest

import gpt_driver
import stacktools as st
from examples.gpt import model_config
from examples.gpt import step as step_lib
from subprocesses import wait

TINY = gpt_driver.TINY
STOP = 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
  return gpt_driver.write_corpus(str(tmp_path_factory.mktemp("data") / "text.txt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
  tmp = str(tmp_path_factory.mktemp("runs"))

  def path(name):
    return os.path.join(tmp, name)

  def spec(name, **flags):
    return {"name": name, "flags": {**TINY, "data_path": corpus, "workdir": path(name),
                                    **flags}}

  lora = dict(init_from=path("base"), lora_rank=2)
  specs = [spec("base", export_npz=path("base.npz")), spec("other_base", seed=1),
           spec("lora", stop_after=STOP, checkpoint_every=5, **lora),
           spec("lora_resumed", workdir=path("lora"), resume=True, lora_rank=2,
                export_npz=path("merged.npz")),
           spec("lora_straight", **lora),
           spec("lora_b", init_from=path("base"), lora_rank=2, lora_alpha=4.0,
                lora_targets="attn", learning_rate=5e-2, seed=3),
           spec("lora_other", init_from=path("other_base"), lora_rank=2),
           # The export as a run: one step at learning rate 0 keeps its parameters.
           spec("from_export", init_from=path("merged.npz"), learning_rate=0.0, steps=1,
                warmup_steps=0),
           # Mistakes: one line each, nothing written.
           spec("rank_over", init_from=path("base"), lora_rank=17),
           spec("no_match", init_from=path("base"), lora_rank=2, lora_targets="nothing"),
           spec("resume_other", workdir=path("lora"), resume=True, lora_rank=4),
           spec("resume_without", workdir=path("lora"), resume=True),
           spec("init_from_adapters", init_from=path("lora"), lora_rank=2),
           spec("resume_plain_as_lora", workdir=path("base"), resume=True, lora_rank=2),
           spec("missing_export", init_from=path("missing.npz")),
           spec("mapped_export", init_from=path("merged.npz"), init_opt_state="mapped")]
  proc, out_path = gpt_driver.start_driver(tmp, "lora", specs, gpt_driver.xla_env())
  try:
    wait(proc)
  finally:
    proc.log.close()
  with open(out_path, encoding="utf-8") as f:
    out = {run["name"]: run for run in json.load(f)["runs"]}
  return {"out": out, "path": path}


def _ok(runs, name):
  run = runs["out"][name]
  assert run["error"] is None and run["exit"] is None, run
  return runs["path"](name)


def test_checkpoints_hold_the_adapters_and_their_state_not_the_base(runs):
  arrays = gpt_driver.load_checkpoint(_ok(runs, "lora_straight"))
  params = [k for k in arrays if k.startswith("params/")]
  assert params and all(k.endswith(("/lora_a", "/lora_b")) for k in params), params
  moments = [k for k in arrays if k.startswith("opt_state/") and "/mu/" in k]
  assert moments and all(k.endswith(("/lora_a", "/lora_b")) for k in moments), moments
  base = gpt_driver.load_checkpoint(_ok(runs, "base"))
  base_bytes = sum(v.nbytes for k, v in base.items() if k.startswith("params/"))
  assert sum(arrays[k].nbytes for k in params) < base_bytes / 4
  record = gpt_driver.load_meta(runs["path"]("lora_straight"))["lora"]
  assert (record["rank"], record["targets"]) == (2, "attn,mlp")
  assert record["base"] == os.path.abspath(runs["path"]("base"))


def test_a_resumed_lora_run_trains_as_one_that_never_stopped(runs):
  _ok(runs, "lora_resumed")
  resumed, straight = runs["path"]("lora"), _ok(runs, "lora_straight")
  mine = {r["step"]: r["train_loss"] for r in gpt_driver.read_metrics(resumed)}
  theirs = {r["step"]: r["train_loss"] for r in gpt_driver.read_metrics(straight)}
  assert sorted(mine) == sorted(theirs) == list(range(1, TINY["steps"] + 1))
  np.testing.assert_allclose([mine[s] for s in sorted(mine)],
                             [theirs[s] for s in sorted(theirs)], rtol=1e-5, atol=1e-6)
  assert "Resumed the adapters from step 10" in runs["out"]["lora_resumed"]["log"]


def test_export_is_the_base_with_the_adapters_merged_in(runs):
  _ok(runs, "lora_resumed")
  merged, meta = gpt_driver.load_export(runs["path"]("merged.npz"))
  base_meta = gpt_driver.load_meta(runs["path"]("base"))
  assert {k: meta[k] for k in ("config", "chars", "dtype")} == {
      k: base_meta[k] for k in ("config", "chars", "dtype")}
  assert "lora" not in meta and meta["step"] == TINY["steps"]
  base = {k[len("params/"):]: v for k, v in gpt_driver.load_checkpoint(
      runs["path"]("base")).items() if k.startswith("params/")}
  adapters = {k[len("params/"):]: v for k, v in gpt_driver.load_checkpoint(
      runs["path"]("lora")).items() if k.startswith("params/")}
  assert set(merged) == set(base)
  adapted = {k.rsplit("/", 1)[0] for k in adapters}
  assert adapted == {"h/block/attn/qkv", "h/block/attn/proj", "h/block/fc", "h/block/fc_out"}
  for key, value in base.items():
    module = key.rsplit("/", 1)[0]
    if module in adapted and key.endswith("/w"):
      delta = np.einsum("lir,lro->lio", adapters[f"{module}/lora_a"],
                        adapters[f"{module}/lora_b"])   # alpha = rank: a scale of 1
      assert np.abs(delta).max() > 0, key
      np.testing.assert_allclose(merged[key], value + delta, rtol=1e-5, atol=1e-6)
    else:
      np.testing.assert_array_equal(merged[key], value)


@pytest.mark.parametrize("block", ["fold", "scan"])
def test_the_trained_loss_is_the_loss_of_the_merged_parameters(block):
  cfg = model_config.GPTConfig(vocab_size=13, seq_len=8, num_layers=2, num_heads=2,
                               d_model=16, block=block, remat="full", lora_rank=2,
                               lora_alpha=4.0)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 9), 0, 13)
  model = step_lib.transform(cfg)
  base, adapters = st.adapters.split(model.init(jax.random.PRNGKey(0), tokens))
  adapters = jax.tree.map(lambda a: a + 0.1, adapters)   # lora_b no longer zero
  params = st.adapters.join(base, adapters)
  loss = model.apply(params, tokens, training=True)[0]
  merged = st.adapters.merge(params, alpha=cfg.lora_alpha)
  want = step_lib.transform(cfg.without_adapters()).apply(merged, tokens, training=True)[0]
  np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_the_base_is_bit_identical_after_fine_tunes(runs):
  # Four LoRA runs read the base's checkpoint after the base run exported its
  # final parameters: the checkpoint is still, bit for bit, that export.
  for name in ("lora_resumed", "lora_straight", "lora_b"):
    _ok(runs, name)
  exported, _ = gpt_driver.load_export(runs["path"]("base.npz"))
  saved = {k[len("params/"):]: v for k, v in gpt_driver.load_checkpoint(
      runs["path"]("base")).items() if k.startswith("params/")}
  assert set(saved) == set(exported)
  for key, value in saved.items():
    np.testing.assert_array_equal(value, exported[key])
  assert gpt_driver.load_meta(runs["path"]("base"))["step"] == TINY["steps"]


def test_init_from_the_export_starts_from_the_merged_parameters(runs):
  started = gpt_driver.load_checkpoint(_ok(runs, "from_export"))
  merged, _ = gpt_driver.load_export(runs["path"]("merged.npz"))
  params = {k[len("params/"):]: v for k, v in started.items() if k.startswith("params/")}
  assert set(params) == set(merged)
  for key, value in merged.items():
    np.testing.assert_array_equal(params[key], value, err_msg=key)
  assert "Initialized from " + runs["path"]("merged.npz") in runs["out"]["from_export"]["log"]


@pytest.mark.parametrize("name, fragments", [
    ("rank_over", ["rank=17 is over the width of", "give a rank of at most 16"]),
    ("no_match", ["the target 'nothing' matches no hk.Linear"]),
    ("resume_other", ["--resume", "holds adapters of --lora_rank=2", "this run has --lora_rank=4"]),
    ("resume_without", ["holds adapters of --lora_rank=2", "this run has no --lora_rank"]),
    ("init_from_adapters", ["holds low-rank adapters, not a whole model", "start from their base"]),
    ("resume_plain_as_lora", ["is a whole model's, not adapters", "drop --lora_rank"]),
    ("missing_export", ["--init_from=", "There is no export at", "missing.npz",
                        "or the .npz of its --export_npz"]),
    ("mapped_export", ["--init_opt_state=mapped", "is an export of parameters alone",
                       "pass --init_opt_state=fresh"]),
])
def test_mistakes_stop_with_one_line(runs, name, fragments):
  run = runs["out"][name]
  assert run["error"] is None and run["exit"], run
  line = run["exit"]
  assert "\n" not in line.strip(), line
  for fragment in fragments:
    assert fragment in line, (fragment, line)
  if name in ("rank_over", "no_match", "init_from_adapters", "missing_export", "mapped_export"):
    assert not os.path.exists(os.path.join(runs["path"](name), "checkpoints"))


@pytest.fixture(scope="module")
def samples(runs, tmp_path_factory):
  """sample.py's greedy output for each ``--adapters`` list, in one driver."""
  for name in ("lora_straight", "lora_b", "lora_other", "lora_resumed"):
    _ok(runs, name)
  path, base = runs["path"], runs["path"]("base")
  tmp = str(tmp_path_factory.mktemp("samples"))
  not_npz, no_meta = os.path.join(tmp, "not.npz"), os.path.join(tmp, "no_meta.npz")
  with open(not_npz, "w", encoding="utf-8") as f:
    f.write("not an archive\n")
  np.savez(no_meta, **{"h/block/fc/w": np.zeros(2)})
  common = ["--num_tokens=24", "--temperature=0", "--prompt=the "]
  specs = {"both": [f"--workdir={base}", f"--adapters={path('lora_straight')},{path('lora_b')}"],
           "a": [f"--workdir={base}", f"--adapters={path('lora_straight')}"],
           "b": [f"--workdir={path('lora_b')}"],
           "base": [f"--workdir={base}"],
           "other_base": [f"--workdir={base}", f"--adapters={path('lora_other')}"],
           "no_lora": [f"--workdir={base}", f"--adapters={base}"],
           # The LoRA run on its adapters, and its export: the adapters merged in.
           "lora": [f"--workdir={path('lora')}"],
           "export": [f"--workdir={path('merged.npz')}"],
           "missing_export": [f"--workdir={path('missing.npz')}"],
           "not_npz": [f"--workdir={not_npz}"],
           "no_meta": [f"--workdir={no_meta}"]}
  cli = gpt_driver.CliRuns(tmp, "samples", {k: v + common for k, v in specs.items()},
                           gpt_driver.xla_env(), script=gpt_driver.SAMPLE)
  yield cli
  cli.close()


def test_each_row_decodes_on_its_own_adapters_as_that_adapter_alone(samples):
  texts = {}
  for key in ("both", "a", "b", "base"):
    rc, out, err = samples[key]
    assert rc == 0, err
    texts[key] = out[:-1].split("\n" + "-" * 40 + "\n")   # print ends with a newline
  assert texts["both"] == texts["a"] + texts["b"]
  assert texts["a"] != texts["base"] or texts["b"] != texts["base"]


def test_sampling_the_export_is_sampling_the_lora_run_on_its_adapters(samples):
  (rc, lora_text, err), (export_rc, export_text, export_err) = samples["lora"], samples["export"]
  assert rc == 0, err
  assert export_rc == 0, export_err
  assert export_text == lora_text and lora_text.startswith("the ")


@pytest.mark.parametrize("key, fragments", [
    ("missing_export", ["There is no export at", "missing.npz",
                        "Pass the .npz that train.py --export_npz wrote"]),
    ("not_npz", ["not.npz is not an .npz that train.py --export_npz wrote (not a zip archive)"]),
    ("no_meta", ["no_meta.npz holds no run metadata (step, config, dtype, chars",
                 "pass the --workdir of the run instead"]),
    ("other_base", ["--adapters", "were trained on the parameters of", "pass that base"]),
    ("no_lora", ["--adapters", "holds a whole model's checkpoints, not adapters"]),
])
def test_what_sample_cannot_read_is_refused_in_one_line(samples, key, fragments):
  rc, _, err = samples[key]
  gpt_driver.one_line_error(rc, err, fragments, key)


@pytest.fixture(scope="module")
def bad_flags(tmp_path_factory, corpus):
  tmp = tmp_path_factory.mktemp("bad_flags")
  runs = gpt_driver.bad_flag_runs(str(tmp), "lora_bad_flags", BAD_FLAGS,
                                  {**TINY, "data_path": corpus})
  yield runs, tmp
  runs.close()


BAD_FLAGS = [
    ({"lora_rank": 8}, ["--lora_rank=8 needs --init_from=DIR"]),
    ({"lora_alpha": 16.0}, ["--lora_alpha needs --lora_rank=R"]),
    ({"lora_rank": -1}, ["--lora_rank"]),
    ({"init_from": "x", "lora_rank": 8, "depth_map": "repeat"},
     ["--lora_rank fine-tunes adapters on --init_from's model as it is"]),
]


@pytest.mark.parametrize("flags, fragments", BAD_FLAGS)
def test_bad_lora_flags_stop_at_start_up(bad_flags, flags, fragments):
  runs, tmp = bad_flags
  i = BAD_FLAGS.index((flags, fragments))
  returncode, _, stderr = runs[i]
  gpt_driver.one_line_error(returncode, stderr, fragments)
  assert not (tmp / f"work{i}").exists()
