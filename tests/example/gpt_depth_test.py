"""Tests for checkpoints across depth: --init_from, --depth_map and
--init_opt_state in the GPT example, and restoring.restore_across_depth.

Training runs go through one driver subprocess (``gpt_driver``). What is
checked:

* a 2-layer run's checkpoint (step 10) restores into a 4-layer run with
  ``--depth_map=zero_new --init_opt_state=mapped``, and training goes on: the
  loss of its first step (11) equals that of the 2-layer run going on
  uninterrupted, step 10's parameters being the same function; its last
  checkpoint holds 4 layers;
* ``--init_from`` with ``--freeze_layers=0:1 --layer_lr_decay=0.5`` (fresh
  optimizer state, same depth) starts from the checkpoint's parameters:
  block 0 ends bit-identical to the checkpoint's, block 1 trains;
* ``restoring.restore_across_depth`` equals the mapping done by hand on
  ``st.unstack_params`` (parameters, and AdamW and ``st.over_layers`` state
  row by row), plain and mixed-layer;
* an index out of range, an edit that breaks the pattern, a stack name that
  does not exist, a depth map without --init_from: one line, nothing written
  (bad flags: their command lines in one interpreter, ``gpt_driver.CliRuns``).
"""

import functools
import json
import os

import haiku as hk
import jax
import numpy as np
import optax
import pytest

import stacktools as st
from stacktools import depth
from examples.gpt import model as model_lib
from examples.gpt import model_config
from examples.gpt import restoring
from examples.gpt import saving
import gpt_driver
from subprocesses import wait

TINY = gpt_driver.TINY
STEPS = gpt_driver.STEPS   # 20
GROW_AT = 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
  return gpt_driver.write_corpus(str(tmp_path_factory.mktemp("data") / "text.txt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
  tmp = str(tmp_path_factory.mktemp("runs"))

  def spec(name, **flags):
    return {"name": name, "flags": {**TINY, "data_path": corpus,
                                    "workdir": os.path.join(tmp, name), **flags}}

  def path(name):
    return os.path.join(tmp, name)

  specs = [spec("two", stop_after=GROW_AT),
           spec("two_straight", checkpoint_every=GROW_AT),
           spec("grown", num_layers=4, init_from=path("two"), depth_map="zero_new",
                init_opt_state="mapped"),
           spec("tuned", init_from=path("two_straight"), freeze_layers="0:1",
                layer_lr_decay=0.5, steps=5, warmup_steps=0),
           spec("mixed", pattern="LG", window=4, stop_after=2),
           # Mistakes: each stops with one line, and nothing is written.
           spec("out_of_range", num_layers=4, init_from=path("two"),
                depth_map="take:0,5,new,1"),
           spec("breaks_pattern", pattern="LG", window=4, init_from=path("mixed"),
                depth_map="take:1,0"),
           spec("depth_differs", num_layers=3, init_from=path("two")),
           spec("flags_differ", d_model=32, init_from=path("two")),
           spec("no_checkpoint", init_from=path("nowhere"), depth_map="repeat", num_layers=4),
           spec("opt_state_differs", init_from=path("two"), init_opt_state="mapped",
                freeze_layers="0:1"),
           # --resume under other optimizer flags: the checkpoint is fine, the
           # flags are named; then with its own flags, it goes on.
           spec("resume_muon", workdir=path("two"), resume=True, optimizer="muon"),
           spec("resume_frozen", workdir=path("two"), resume=True, freeze_layers="0:1"),
           spec("two_resumed", workdir=path("two"), resume=True)]
  proc, out_path = gpt_driver.start_driver(tmp, "depth", specs, gpt_driver.xla_env())
  try:
    wait(proc)
  finally:
    proc.log.close()
  with open(out_path, encoding="utf-8") as f:
    out = {run["name"]: run for run in json.load(f)["runs"]}
  return {"tmp": tmp, "out": out, "path": path}


def _ok(runs, name):
  run = runs["out"][name]
  assert run["error"] is None and run["exit"] is None, run
  return runs["path"](name)


def _by_step(workdir):
  return {r["step"]: r for r in gpt_driver.read_metrics(workdir)}


def test_a_grown_checkpoint_goes_on_with_the_same_loss(runs):
  grown, straight = _ok(runs, "grown"), _ok(runs, "two_straight")
  assert "Initialized from" in runs["out"]["grown"]["log"]
  mine, theirs = _by_step(grown), _by_step(straight)
  assert sorted(mine) == list(range(GROW_AT + 1, STEPS + 1))   # it went on from step 10
  # Step 11's loss is that of step 10's parameters on batch 11: grown with
  # zeroed residual outputs, the model computes what the 2-layer one did.
  np.testing.assert_allclose(mine[GROW_AT + 1]["train_loss"],
                             theirs[GROW_AT + 1]["train_loss"], rtol=1e-6)
  # Then the fresh blocks train, and the two runs part.
  assert mine[STEPS]["train_loss"] != theirs[STEPS]["train_loss"]
  losses = [mine[s]["train_loss"] for s in sorted(mine)]
  assert np.all(np.isfinite(losses))
  arrays = gpt_driver.load_checkpoint(grown)
  assert gpt_driver.load_meta(grown)["step"] == STEPS
  assert arrays["params/h/block/fc/w"].shape[0] == 4
  # The optimizer state went on too: its step count, and 4 layers of moments.
  assert arrays["opt_state/1/0/count"] == STEPS
  assert arrays["opt_state/1/0/mu/h/block/fc/w"].shape[0] == 4


def test_init_from_fine_tunes_with_frozen_blocks(runs):
  tuned, source = _ok(runs, "tuned"), _ok(runs, "two_straight")
  assert sorted(_by_step(tuned)) == list(range(1, 6))   # a new run, from step 1
  before = gpt_driver.load_checkpoint(source)
  after = gpt_driver.load_checkpoint(tuned)
  blocks = [k for k in before if k.startswith("params/h/")]
  assert blocks
  for key in blocks:
    np.testing.assert_array_equal(after[key][0], before[key][0], err_msg=key)
    assert np.any(after[key][1] != before[key][1]), key
  # The optimizer state started fresh: the frozen block's count is 0.
  counts = [v for k, v in after.items()
            if k.startswith("opt_state/1/layers/h/") and k.endswith("/count")]
  assert counts and all(c.tolist() == [0, 5] for c in counts)


@pytest.mark.parametrize("name, fragments", [
    ("out_of_range", ["--depth_map=take:0,5,new,1 takes block 5, but the checkpoint has 2 "
                      "blocks (0 to 1): list blocks 0 to 1, and new for a fresh one."]),
    ("breaks_pattern", ["--depth_map=take:1,0 puts block 1, of kind G in --pattern=LG, at "
                        "position 0, whose kind is L: take a block of kind L there, or new "
                        "for a fresh one."]),
    ("depth_differs", ["has 2 blocks and --num_layers=3", "--depth_map"]),
    ("flags_differ", ["--init_from", "--d_model=16", "--d_model=32"]),
    ("no_checkpoint", ["--init_from=", "No checkpoint in"]),
    ("opt_state_differs", ["optimizer state", "--init_opt_state=fresh"]),
])
def test_mistakes_stop_with_one_line_and_write_nothing(runs, name, fragments):
  run = runs["out"][name]
  assert run["error"] is None, run["error"]
  message = run["exit"]
  assert message and message.startswith("error: ") and "\n" not in message, message
  for fragment in fragments:
    assert fragment in message, (fragment, message)
  assert "None" not in message, message   # the flag's word for a fresh block is new
  assert not os.path.exists(runs["path"](name))


@pytest.mark.parametrize("name, saved, given", [
    ("resume_muon", "--optimizer=adamw", "--optimizer=muon"),
    ("resume_frozen", "--freeze_layers=''", "--freeze_layers=0:1"),
])
def test_resume_under_other_optimizer_flags_names_them(runs, name, saved, given):
  """Before, Orbax failed to read the optimizer state, and the message called
  the checkpoint unreadable and advised deleting it."""
  message = runs["out"][name]["exit"]
  assert message and message.startswith("error: --resume: ") and "\n" not in message, message
  two = runs["path"]("two")
  for fragment in (f"checkpoints/{GROW_AT} holds another optimizer's state (it has no ",
                   "the checkpoint is readable, but it was written under other optimizer "
                   "flags (--optimizer, --freeze_layers, --layer_lr_decay, --grad_clip). "
                   f"It was trained with {saved}, but this run has {given}: pass its values",
                   f"drop --resume, pass --init_from={two!r} and a new --workdir."):
    assert fragment in message, (fragment, message)
  assert "delete" not in message and "not a readable" not in message, message
  # With its own flags, the run goes on from that checkpoint to the end.
  _ok(runs, "two_resumed")
  assert sorted(_by_step(two)) == list(range(1, STEPS + 1))
  assert gpt_driver.load_meta(two)["step"] == STEPS


#: ``(flags, fragments of the one line)``: bad flags, each stopping at start-up.
BAD_FLAGS = [
    ({"depth_map": "repeat"}, ["--depth_map needs --init_from=DIR"]),
    ({"init_from": "x", "depth_map": "double"}, ["--depth_map='double' must be one of repeat, "
                                                 "stack, zero_new or take:I,J,..."]),
    ({"init_from": "x", "resume": True}, ["--init_from", "--resume", "pass one of them"]),
]


@pytest.fixture(scope="module")
def bad_flags(tmp_path_factory, corpus):
  """``(runs, tmp)``: train.py's command line of each of BAD_FLAGS, run in one
  interpreter (``gpt_driver.bad_flag_runs``; case i's workdir ``tmp/work<i>``)."""
  tmp = tmp_path_factory.mktemp("bad_flags")
  runs = gpt_driver.bad_flag_runs(str(tmp), "bad_flags", BAD_FLAGS, {**TINY, "data_path": corpus})
  yield runs, tmp
  runs.close()


@pytest.mark.parametrize("flags, fragments", BAD_FLAGS)
def test_bad_flags_stop_at_start_up(bad_flags, flags, fragments):
  runs, tmp = bad_flags
  i = BAD_FLAGS.index((flags, fragments))
  returncode, _, stderr = runs[i]
  gpt_driver.one_line_error(returncode, stderr, fragments)
  assert not (tmp / f"work{i}").exists()


# ---------------------------------------------------------------------------
# restore_across_depth in this process, against the mapping by hand.


def _gpt_params(num_layers, pattern="", seed=0):
  """A tiny GPT's parameters on the host: a copy of those initialised once per
  model and seed (the tests ask for the same few models many times)."""
  return {module: {name: value.copy() for name, value in bundle.items()}
          for module, bundle in _gpt_params_once(num_layers, pattern, seed).items()}


@functools.lru_cache(maxsize=None)
def _gpt_params_once(num_layers, pattern, seed):
  cfg = model_config.GPTConfig(vocab_size=11, seq_len=8, num_layers=num_layers, num_heads=2,
                               d_model=8, pattern=pattern, window=4 if pattern else 0)
  model = hk.transform(lambda t: model_lib.forward(cfg, t))
  params = model.init(jax.random.PRNGKey(seed), np.zeros((1, 8), np.int32))
  return jax.device_get(params)


def _by_hand(saved, fresh, indices, pattern, zeroed):
  """Stacked params at the new depth through per-layer dicts."""
  layers = st.unstack_params(saved, "h", pattern=pattern)
  new = st.unstack_params(fresh, "h", pattern=pattern)
  out = {k: v for k, v in layers.items() if not k.startswith("h/layer_")}
  for p, i in enumerate(indices):
    source, head = (layers, f"h/layer_{i}") if i is not None else (new, f"h/layer_{p}")
    for key, bundle in source.items():
      if key.startswith(head + "/"):
        out[f"h/layer_{p}{key[len(head):]}"] = {
            n: np.zeros_like(v) if i is None and key.endswith(zeroed) else v
            for n, v in bundle.items()}
  return st.stack_params(out, "h", pattern=pattern)


def _save(tmp_path, params, opt_state):
  manager = saving.Manager(str(tmp_path), keep=1, asynchronous=False)
  manager.save(7, params, opt_state, {"config": {}})
  manager.close()


def _listing(root):
  return sorted((d, tuple(sorted(f)), os.path.getmtime(d)) for d, _, f in os.walk(root))


CASES = {
    "plain": ("", None, depth.insert_new(2, 4), lambda: optax.adamw(1e-3)),
    "mixed": ("LG", ("local", "global"), [0, 1, None, None],
              lambda: st.over_layers(optax.adamw(1e-3), stacked={"h": ("local", "global")},
                                     frozen=range(1))),
}


@pytest.mark.parametrize("case", CASES)
def test_restore_across_depth_equals_the_mapping_by_hand(tmp_path, case):
  pattern, kinds, indices, make_tx = CASES[case]
  saved, fresh = _gpt_params(2, pattern), _gpt_params(4, pattern, seed=1)
  tx = make_tx()
  # Moments and counts that are not zeros, so rows can be told apart.
  saved_opt = jax.device_get(tx.init(saved))
  saved_opt = jax.tree.map(lambda x: x + np.arange(x.size).reshape(x.shape).astype(x.dtype)
                           + 1, saved_opt)
  fresh_opt = jax.device_get(tx.init(fresh))
  _save(tmp_path, saved, saved_opt)
  before = _listing(tmp_path)
  params, opt_state = restoring.restore_across_depth(
      str(tmp_path), 7, fresh, fresh_opt, stack="h", indices=indices, pattern=kinds,
      zero=model_config.RESIDUAL_OUTPUTS)
  want = _by_hand(saved, fresh, indices, kinds, ("/attn/proj", "/fc_out"))
  assert jax.tree.structure(params) == jax.tree.structure(fresh)
  for module, bundle in want.items():
    for name, value in bundle.items():
      np.testing.assert_array_equal(params[module][name], value, err_msg=f"{module}/{name}")
  # The optimizer state, leaf by leaf: a leaf with the stack's rows is mapped
  # row by row (fresh rows from the fresh state), every other leaf is saved.
  got = saving.flatten(opt_state)
  saved_flat, fresh_flat = saving.flatten(saved_opt), saving.flatten(fresh_opt)
  rows = 0
  for key, value in fresh_flat.items():
    if "h/" not in key:
      np.testing.assert_array_equal(got[key], saved_flat[key], err_msg=key)
      continue
    rows += 1
    kind = next((k for k in (kinds or ()) if f"h/{k}/" in key), None)
    positions = [p for p in range(4) if kind is None or kinds[p % 2] == kind]
    old_rank = {i: r for r, i in enumerate(p for p in range(2)
                                           if kind is None or kinds[p % 2] == kind)}
    for row, p in enumerate(positions):
      i = indices[p]
      expected = fresh_flat[key][row] if i is None else saved_flat[key][old_rank[i]]
      np.testing.assert_array_equal(got[key][row], expected, err_msg=f"{key}[{row}]")
  assert rows > 10
  assert _listing(tmp_path) == before   # nothing written


@pytest.mark.parametrize("changes, error, message", [
    (dict(stack="g"), ValueError, "no module of params is named 'g'"),
    (dict(indices=[0, 2, None, None]), ValueError, r"indices\[1\]=2 is out of range"),
    (dict(indices=[1, 0, None, None], pattern="LG"), ValueError,
     r"puts layer 1, of kind 'global', at position 0, which pattern \('local', 'global'\)"),
    (dict(optimizer=optax.sgd(0.1, momentum=0.9)), saving.CheckpointError,
     "optimizer state"),
    (dict(fresh_pattern="LG"), ValueError, "h/block/attn/proj is in params but not in new="),
])
def test_restore_across_depth_mistakes(tmp_path, changes, error, message):
  pattern = changes.get("pattern", "")
  saved = _gpt_params(2, pattern)
  fresh = _gpt_params(4, changes.get("fresh_pattern", pattern), seed=1)
  tx = optax.adamw(1e-3)
  _save(tmp_path, saved, tx.init(saved))
  before = _listing(tmp_path)
  kinds = tuple(model_config.KINDS[c] for c in pattern) or None
  with pytest.raises(error, match=message) as info:
    restoring.restore_across_depth(
        str(tmp_path), 7, fresh, changes.get("optimizer", tx).init(fresh),
        stack=changes.get("stack", "h"), indices=changes.get("indices", depth.insert_new(2, 4)),
        pattern=kinds)
  assert "\n" not in str(info.value)
  assert _listing(tmp_path) == before
