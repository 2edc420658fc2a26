"""sample.py through the command line: greedy text against a full recompute.

Checkpoints of random parameters (no training: any parameters will do) are
written for three models: a plain stack, an unrolled one (``st.BlockSeq``)
and a mixed one whose local layers' window (3) is shorter than the text, so
their ring caches wrap. For each, ``sample.py --temperature=0`` must print
what a full recompute of the prefix picks at every step (nanoGPT's
``generate``: the forward pass over the whole text, its last logits'
argmax), up to a near tie; ``--num_samples=4`` prints that text four times
and ``--top_k=1`` at temperature 1 prints it too. Bad ``--num_samples``,
``--top_k`` and ``--temperature`` (NaN once sampled token 0 every time) stop
with one line naming the flag; a prompt longer than the model's ``seq_len``
(once cut without a word) is continued from its end, with one log line that
says so; no run's log starts with JAX's line for a backend the machine
lacks. The decode step also traces
under a policy that keeps every named internal, as train.py's end-of-run
sample runs it.

Every command line runs in one interpreter (``gpt_driver.drive_cli``), as
each would run alone: one process pays the imports for all of them.
gpt_test.py runs sample.py as a command of its own without a workdir, and
gpt_dtype_test.py greedy from a trained checkpoint.
"""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpt_driver
from examples.gpt import data as data_lib
from examples.gpt import decoding
from examples.gpt import model as model_lib
from examples.gpt import model_config
from examples.gpt import sample as sample_lib
from examples.gpt import saving
import stacktools as st

CHARS = "abcdefgh "
PROMPT, NUM_TOKENS = "abc", 12     # 15 positions of 16: no refill
MODELS = {
    "plain": dict(),
    "unrolled": dict(stack="unrolled"),
    "mixed": dict(pattern="LG", window=3, num_layers=3),
}


def config(name):
  return model_config.GPTConfig(**{**dict(vocab_size=len(CHARS), seq_len=16, num_layers=2,
                                          num_heads=2, d_model=16), **MODELS[name]})


def random_params(cfg):
  """Random parameters whose greedy text varies: the head is the token
  embedding, transposed (random heads mostly repeat one character)."""
  forward = hk.without_apply_rng(hk.transform(lambda t: model_lib.forward(cfg, t)))
  shapes = jax.eval_shape(forward.init, jax.random.PRNGKey(0),
                          jnp.zeros((1, cfg.seq_len), jnp.int32))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
  params["head"] = {"w": params["tok_embed"]["embeddings"].T,
                    "b": np.zeros(cfg.vocab_size, np.float32)}
  return params


def greedy_by_recompute(cfg, params):
  """Each step: the forward pass over the whole text so far; its argmax.

  Returns the text and, per step, the gap between the two likeliest
  characters (a near tie may go either way in another summation order).
  """
  forward = hk.without_apply_rng(hk.transform(lambda t: model_lib.forward(cfg, t)[0]))
  logits_of = jax.jit(forward.apply)
  ids = [CHARS.index(c) for c in PROMPT]
  gaps = []
  for _ in range(NUM_TOKENS):
    padded = np.zeros((1, cfg.seq_len), np.int32)   # causal: the padding is unseen
    padded[0, :len(ids)] = ids
    logits = np.asarray(logits_of(params, padded))[0, len(ids) - 1]
    top = np.sort(logits)[-2:]
    gaps.append(float(top[1] - top[0]))
    ids.append(int(np.argmax(logits)))
  return PROMPT + "".join(CHARS[i] for i in ids[len(PROMPT):]), gaps


def assert_greedy(text, want, gaps):
  assert len(text) == len(want), (text, want)
  for j, (got_c, want_c) in enumerate(zip(text[len(PROMPT):], want[len(PROMPT):])):
    if got_c != want_c:   # only a near tie may differ; the rest follows from it
      assert gaps[j] < 1e-4, (j, text, want, gaps[j])
      return


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
  """``{name: (workdir, cfg, params)}``: one checkpoint per model."""
  out = {}
  for name in MODELS:
    cfg = config(name)
    params = random_params(cfg)
    workdir = str(tmp_path_factory.mktemp(name))
    manager = saving.Manager(workdir, keep=1, asynchronous=False)
    meta = {"sampler_state": "{}", "chars": CHARS,
            "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                       if f.name not in ("remat", "pipeline")}}
    manager.save(1, params, {"count": np.zeros((), np.int32)}, meta)
    manager.close()
    out[name] = (workdir, cfg, params)
  return out


#: Bad flags of sample.py, and a fragment of the one line each stops with.
BAD_FLAGS = [("--num_samples=0", "--num_samples"), ("--top_k=-1", "--top_k"),
             (f"--top_k={len(CHARS) + 1}", f"--top_k={len(CHARS) + 1} is more than"),
             ("--temperature=nan", "--temperature must be a finite number >= 0 (0: greedy)")]
#: A prompt longer than the model's seq_len (16).
LONG_PROMPT = (CHARS * 3)[:16 + 5]


@pytest.fixture(scope="module")
def runs(workdirs, tmp_path_factory):
  """Every command line of this module, run in one interpreter, started
  when a test first needs one (see ``gpt_driver.CliRuns``)."""
  common = [f"--prompt={PROMPT}", f"--num_tokens={NUM_TOKENS}"]
  specs = {}
  for name, (workdir, _, _) in workdirs.items():
    specs[name, "greedy"] = [f"--workdir={workdir}", "--temperature=0", *common]
    specs[name, "top_k=1"] = [f"--workdir={workdir}", "--temperature=1", "--top_k=1",
                              "--seed=3", *common]
  workdir = workdirs["mixed"][0]
  specs["mixed", "four"] = [f"--workdir={workdir}", "--temperature=0",
                            "--num_samples=4", *common]
  specs["mixed", "sampled"] = [f"--workdir={workdir}", "--temperature=1",
                               "--num_samples=4", "--top_k=3", *common]
  workdir = workdirs["plain"][0]
  for flag, _ in BAD_FLAGS:
    specs["bad", flag] = [f"--workdir={workdir}", flag]
  specs["long prompt"] = [f"--workdir={workdir}", f"--prompt={LONG_PROMPT}",
                          "--temperature=0", "--num_tokens=1"]
  r = gpt_driver.CliRuns(str(tmp_path_factory.mktemp("cli")), "sample", specs,
                         gpt_driver.xla_env(), script=gpt_driver.SAMPLE)
  yield r
  r.close()


def test_greedy_cli_equals_full_recompute(workdirs, runs):
  # The recomputes here, while the driver samples.
  recomputed = {name: greedy_by_recompute(cfg, params)
                for name, (_, cfg, params) in workdirs.items()}
  outputs = {}
  for key in runs.keys:
    if key[0] in MODELS:
      rc, stdout, stderr = runs[key]
      assert rc == 0, (key, stderr)
      assert "--prompt has" not in stderr, (key, stderr)   # it fits: nothing to say
      # JAX's line for a backend this machine lacks (libtpu on a CPU) once
      # came first: the backends start quietly.
      assert "Unable to initialize backend" not in stderr, (key, stderr)
      outputs[key] = stdout
  for name, (want, gaps) in recomputed.items():
    assert len(set(want[len(PROMPT):])) >= 2, want   # a text that varies
    assert_greedy(outputs[name, "greedy"].rstrip("\n"), want, gaps)
    assert outputs[name, "top_k=1"] == outputs[name, "greedy"], name
  one = outputs["mixed", "greedy"].rstrip("\n")
  assert outputs["mixed", "four"] == f"\n{sample_lib.SEPARATOR}\n".join([one] * 4) + "\n"
  samples = outputs["mixed", "sampled"].rstrip("\n").split(f"\n{sample_lib.SEPARATOR}\n")
  assert len(samples) == 4
  for text in samples:
    assert text.startswith(PROMPT) and len(text) == len(PROMPT) + NUM_TOKENS
    assert set(text) <= set(CHARS)


def test_bad_sampling_flags_stop_with_one_line(runs):
  for flag, fragment in BAD_FLAGS:
    rc, stdout, stderr = runs["bad", flag]
    assert not stdout
    gpt_driver.one_line_error(rc, stderr, [fragment], flag)


def test_a_prompt_longer_than_the_model_sees_is_said_and_continued_from_its_end(
    workdirs, runs):
  _, cfg, params = workdirs["plain"]
  prompt = LONG_PROMPT
  assert len(prompt) == cfg.seq_len + 5
  rc, stdout, stderr = runs["long prompt"]
  assert rc == 0, stderr
  said = [l for l in stderr.splitlines() if "--prompt has" in l]
  assert len(said) == 1, stderr
  assert said[0].endswith(f"--prompt has {len(prompt)} characters, more than the "
                          f"{cfg.seq_len} positions the model sees (the --seq_len it was "
                          f"trained with): the sample continues its last {cfg.seq_len} "
                          f"characters (pass at most {cfg.seq_len} to have all of it "
                          "seen)."), said[0]
  # The whole prompt is printed; its next character is the last window's argmax.
  forward = hk.without_apply_rng(hk.transform(lambda t: model_lib.forward(cfg, t)[0]))
  window = np.asarray([[CHARS.index(c) for c in prompt[-cfg.seq_len:]]], np.int32)
  logits = np.asarray(forward.apply(params, window))[0, -1]
  top = np.sort(logits)[-2:]
  text = stdout.rstrip("\n")
  assert text[:-1] == prompt and len(text) == len(prompt) + 1, text
  assert text[-1] == CHARS[int(np.argmax(logits))] or top[1] - top[0] < 1e-4
  # generate, called directly, refuses a NaN temperature too.
  dataset = data_lib.CharDataset(chars=CHARS, train=np.zeros(0, np.int32),
                                 valid=np.zeros(0, np.int32))
  with pytest.raises(ValueError, match=r"temperature=nan: use a finite number >= 0"):
    decoding.generate(cfg, params, dataset, "ab", 1, temperature=float("nan"))


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_traces_under_the_training_policy(name):
  """train.py samples with its run's config, remat included: a policy that
  keeps named internals must find every name in the decode step too."""
  policy = st.CheckpointPolicy(save_block_internals=list(model_config.CHECKPOINT_NAMES))
  cfg = dataclasses.replace(config(name), remat=policy)
  decode = hk.without_apply_rng(hk.transform(
      lambda t, c, p: decoding.decode(cfg, t, c, p)))
  params = random_params(config(name))
  cache = decoding.init_cache(cfg, 2)
  logits, new = jax.eval_shape(decode.apply, params, jnp.zeros((2, 1), jnp.int32), cache, 3)
  assert logits.shape == (2, 1, cfg.vocab_size)
  assert jax.tree.map(lambda a: a.shape, new) == jax.tree.map(lambda a: a.shape, cache)
