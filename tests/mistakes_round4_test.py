"""Mistakes that the library once accepted in silence, or named too vaguely (round four).

Every test here failed before its fix:

* a stack given parameters of a deeper stack ran their first rows, and of a
  shallower one failed inside ``lax.scan`` naming neither the stack nor its
  parameters (Stacked, ``remat="nested"``, ``layer_stack``, mixed and
  nested stacks);
* ``depth.repeat(4, 6)`` gave copies 2, 1, 2, 1 where its docstring promises
  the lower layers the extra ones;
* ``take_layers`` on a mixed-layer stack without ``pattern=`` picked each
  kind's rows;
* an in-place write at a concrete position past the row's end overwrote the
  last position;
* ``over_layers`` did not say that a pattern's order cannot be checked;
* ``stacked=``/``take_layers`` on a mixed stack without its pattern, or
  naming a module that is not a stack, said only that leaves disagree;
* a ``scale=`` function returning an array, and ``layer_drop=`` traced under
  ``jax.jit``, failed with JAX's or a generic message.

And of the GPT example's start-up, which once went on in silence: flags
that do nothing with ``--stack=unrolled`` (``--remat=nested``,
``--nested_outer``, ``--unroll``) or without ``--optimizer=muon``
(``--muon_learning_rate``), and ``--pattern`` with L layers whose
``--window`` default exceeds ``--seq_len``.

Shapes are tiny; the refusals are traced with ``jax.eval_shape`` (nothing
compiles), and each good case is checked against values written by hand.
The command lines run one after another in one interpreter
(``gpt_driver.drive_cli``), and each corrected one is shown to pass the
flag checks by stopping at the next check (a missing ``--data_path``).
"""

import json
import os

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gpt_driver
import stacktools as st
from stacktools import depth
from subprocesses import wait

D = 3
X = jnp.ones((2, D))
KEY = jax.random.PRNGKey(0)


def _block():
  return lambda x: x + hk.Linear(D)(x)


def _stacked(n, **kw):
  return hk.transform(lambda x: st.Stacked(_block, n, name="h", **kw).fold(x))


def _layer_stack(n):
  return hk.transform(lambda x: st.layer_stack(n, name="h")(
      lambda x: x + hk.Linear(D)(x))(x))


def _mixed(n):
  return hk.transform(lambda x: st.Stacked(
      {"A": _block, "B": _block}, n, pattern="AB", name="h").fold(x))


def _nested(n):
  inner = lambda: (lambda x: st.Stacked(_block, n, name="inner").fold(x))  # noqa: E731
  return hk.transform(lambda x: st.Stacked(inner, 2, name="h").fold(x))


def _loop(params, module, rows):
  """The stack's forward pass by hand: layer j uses row rows[j]."""
  w, b = params[module]["w"], params[module]["b"]
  x = X
  for r in rows:
    x = x + x @ w[r] + b[r]
  return x


# ---------------------------------------------------------------------------
# 1. Parameters deeper or shallower than the stack.


@pytest.mark.parametrize("make, fragment", [
    (lambda n: _stacked(n), "the stack has num_layers={want}"),
    (lambda n: _stacked(n, remat="nested"), "the stack has num_layers={want}"),
    (_layer_stack, "the stack has num_layers={want}"),
    (_mixed, "pattern=('A', 'B') gives the kind 'A' {half} of the stack's "
             "num_layers={want}"),
    (_nested, "the stack has num_layers={want}"),
])
@pytest.mark.parametrize("made, want", [(6, 2), (2, 6)])
def test_params_of_another_depth_are_refused(make, fragment, made, want):
  params = jax.eval_shape(make(made).init, KEY, X)
  with pytest.raises(ValueError) as info:
    jax.eval_shape(make(want).apply, params, None, X)
  message = str(info.value)
  rows = made // 2 if make is _mixed else made
  assert f"has {rows} rows on its leading (Layers) axis" in message, message
  assert fragment.format(want=want, half=want // 2) in message, message
  assert message.startswith("layer_stack: " if make is _layer_stack else "Stacked: ")
  if make is _mixed:
    assert "st.take_layers(params, 'h', indices, pattern=('A', 'B'))" in message
  elif make is _nested:   # its parameters have the outer axis too: no take_layers
    assert "build the stack with num_layers=" in message and "take_layers" not in message
  else:
    assert f"build the stack with num_layers={made}" in message, message
    assert "st.take_layers(params, 'h', indices)" in message, message


def test_params_cut_to_the_depth_run():
  params = _stacked(6).init(KEY, X)
  two = st.take_layers(params, "h", [0, 3])
  got = _stacked(2).apply(two, None, X)
  np.testing.assert_allclose(got, _loop(params, "h/linear", [0, 3]), rtol=1e-5)


# ---------------------------------------------------------------------------
# 3. depth.repeat: the lower layers get the extra copies.


@pytest.mark.parametrize("n, m, want", [
    (4, 6, [0, 0, 1, 1, 2, 3]),
    (3, 7, [0, 0, 0, 1, 1, 2, 2]),
    (2, 3, [0, 0, 1]),
    (3, 6, [0, 0, 1, 1, 2, 2]),
])
def test_repeat_gives_the_lower_layers_the_extra_copies(n, m, want):
  assert depth.repeat(n, m) == want
  # Per period, the same: repeat(4, 6) over periods of 2 layers.
  assert depth.repeat(2 * n, 2 * m, period=2) == [2 * u + j for u in want for j in (0, 1)]


# ---------------------------------------------------------------------------
# 4, 9, 10. Layouts: a mixed stack without its pattern, a module that is not a stack.


def _mixed_params(counts):
  return {f"h/{kind}/linear": {"w": np.arange(c * 4.0).reshape(c, 2, 2) + 100 * k}
          for k, (kind, c) in enumerate(counts.items())} | {
              "head": {"w": np.ones((3, 5)), "b": np.zeros(5)}}


def test_take_layers_on_a_mixed_stack_needs_its_pattern():
  params = _mixed_params({"A": 2, "B": 2})   # pattern AB over 4 layers
  with pytest.raises(ValueError, match=r"^take_layers: the modules under 'h' lie under "
                     r"\['A', 'B'\], as the kinds of a mixed-layer stack do.*the indices "
                     r"would pick each kind's rows.*Pass the pattern the stack was built "
                     r"with as pattern="):
    st.take_layers(params, "h", [0, 1])
  got = st.take_layers(params, "h", [0, 1], pattern="AB")   # layers 0 (A) and 1 (B)
  np.testing.assert_array_equal(got["h/A/linear"]["w"], params["h/A/linear"]["w"][:1])
  np.testing.assert_array_equal(got["h/B/linear"]["w"], params["h/B/linear"]["w"][:1])


def test_a_stack_of_one_block_laid_out_like_kinds_edits_one_scope_at_a_time():
  params = _mixed_params({"attn": 3, "mlp": 3})   # one block with two modules
  with pytest.raises(ValueError, match=r"edit one at a time: take_layers\(params, "
                     r"'h/attn', indices\), then 'h/mlp'"):
    st.take_layers(params, "h", [2, 0])
  got = st.take_layers(st.take_layers(params, "h/attn", [2, 0]), "h/mlp", [2, 0])
  for scope in ("h/attn/linear", "h/mlp/linear"):
    np.testing.assert_array_equal(got[scope]["w"], params[scope]["w"][[2, 0]])


@pytest.mark.parametrize("call, arg", [
    (lambda p: st.over_layers(optax.sgd(1.0), stacked=["h"]).init(p),
     r"stacked=\{'h': pattern\}"),
    (lambda p: st.take_layers(p, "h", [0, 1]), "pattern="),
    (lambda p: st.unstack_params(p, "h"), "pattern="),
])
def test_a_mixed_stack_whose_kinds_disagree_asks_for_its_pattern(call, arg):
  params = _mixed_params({"A": 4, "B": 2})   # pattern AAB over 6 layers
  with pytest.raises(ValueError, match=r"the leaves under 'h' disagree on the Layers "
                     r"axis: .*Each of \['A', 'B'\] has a Layers axis of its own, as the "
                     rf"kinds of a mixed-layer stack.*do: pass the pattern the stack was "
                     rf"built with as {arg}"):
    call(params)
  state = st.over_layers(optax.sgd(1.0, momentum=0.9), stacked={"h": "AAB"}).init(params)
  assert state.layers["h/A"][0].trace["h/A/linear"]["w"].shape == (4, 2, 2)


@pytest.mark.parametrize("call, subject, fix", [
    (lambda p: st.over_layers(optax.sgd(1.0), stacked=["head"]).init(p), "over_layers",
     "Pass as stacked= only the full name that a st.Stacked or st.layer_stack was "
     "given (e.g. 'model/h'); leaves under no stack go to the optimizer as they are, "
     "so drop it from stacked=."),
    (lambda p: st.take_layers(p, "head", [0]), "take_layers", "Pass as name= only"),
    (lambda p: st.unstack_params(p, "head"), "unstack_params", "Pass as prefix= only"),
])
def test_a_module_that_is_not_a_stack_is_named_so(call, subject, fix):
  params = _mixed_params({"A": 2, "B": 2})
  with pytest.raises(ValueError) as info:
    call(params)
  message = str(info.value)
  assert message.startswith(f"{subject}: 'head' is not a stack: a stack's leaves all "
                            "lead with its Layers axis (num_layers), but head/b has 5 "
                            "rows and head/w 3."), message
  assert fix in message, message


# ---------------------------------------------------------------------------
# 5. In-place writes past the row's end.


class _Writer(hk.Module):

  def __call__(self, x, cache, pos):
    cache = cache.write({"k": 1.0 + jnp.zeros((2, 1, D))}, at=(0, pos))
    return x, cache


def _writes(pos, t=4):
  f = hk.without_apply_rng(hk.transform(lambda c: st.Stacked(_Writer, 2, name="h").scan(
      X, st.per_layer(c, in_place=True), pos)[1]))
  return f.apply({}, {"k": jnp.zeros((2, 2, t, D))})


@pytest.mark.parametrize("pos, moved", [(4, 3), (7, 3), (-1, 0)])
def test_a_concrete_write_past_the_row_is_refused(pos, moved):
  with pytest.raises(ValueError, match=rf"write\(at=\(0, {pos}\)\) puts an update 1 long "
                     rf"on axis 1 of the row at {pos}, but that axis holds positions 0 to "
                     rf"3, so lax.dynamic_update_slice would move the write to {moved} and "
                     r"overwrite what is there: start between 0 and 3"):
    jax.eval_shape(lambda: _writes(pos))


def test_a_write_at_the_last_position_lands_there():
  got = np.asarray(_writes(3)["k"])
  want = np.zeros((2, 2, 4, D))
  want[:, :, 3] = 1.0
  np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------
# 6. over_layers: a pattern's order is not in the parameters, and the docs say so.


def test_over_layers_docs_say_that_only_the_counts_are_checked():
  said = "not the order of the kinds, so only the counts are checked"
  assert said in " ".join(st.over_layers.__doc__.split())
  guide = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "docs", "guides", "training-rules.md")
  with open(guide, encoding="utf-8") as f:
    assert said in " ".join(f.read().split())


# ---------------------------------------------------------------------------
# 11, 12. scale= that returns an array, layer_drop= traced under jit.


def _scaled_update(scale):
  params = {"h/linear": {"w": jnp.ones((4, 2, 2))}}
  tx = st.over_layers(optax.sgd(1.0), stacked=["h"], scale=scale)
  return tx.update(params, tx.init(params), params)[0]["h/linear"]["w"][:, 0, 0]


def test_scale_returning_an_array_is_named():
  with pytest.raises(TypeError, match=r"^over_layers: scale= returned an array of shape "
                     r"\(4,\) for layer 0 of 'h', not one number: it is called once per "
                     r"layer.*pass the sequence itself, scale=\[\.\.\.\]"):
    _scaled_update(lambda i: jnp.full(4, 0.5) ** i)
  # One number each (a 0-d array too) is fine: the update is -scale(i).
  np.testing.assert_allclose(_scaled_update(lambda i: jnp.float32(0.5) ** i),
                             [-1.0, -0.5, -0.25, -0.125])


def test_traced_layer_drop_is_named():
  params = jax.eval_shape(_stacked(2).init, KEY, X)
  apply = lambda rates: _stacked(2, layer_drop=rates).apply(params, KEY, X)  # noqa: E731
  with pytest.raises(TypeError, match=r"^Stacked: layer_drop= was given a traced value "
                     r"\(an array of shape \(2,\).*the rates are fixed when the stack is "
                     r"built, so they must be concrete: Python floats or a numpy array"):
    jax.eval_shape(apply, jnp.array([0.1, 0.2]))
  # Concrete rates, closed over, trace.
  assert jax.eval_shape(lambda: apply(np.array([0.1, 0.2]))).shape == X.shape


# ---------------------------------------------------------------------------
# The GPT example: flags that would do nothing, --window's default.

#: (flags, what the one line must say); None: the flags pass their checks.
CLI_CASES = {
    "nested_unrolled": ({"stack": "unrolled", "remat": "nested"},
                        ["--remat=nested: nested splits a scan into two levels, and "
                         "--stack=unrolled (st.BlockSeq, a Python loop) has no scan, so it "
                         "would act as full: write full in its place, or pass --stack=scan."]),
    "nested_outer_unrolled": ({"stack": "unrolled", "remat": "nested", "nested_outer": 2},
                              ["--remat=nested and --nested_outer: nested splits"]),
    "per_depth_nested_unrolled": ({"stack": "unrolled", "remat": "none:1,nested:1"},
                                  ["--remat=none:1,nested:1: nested splits"]),
    "unroll_unrolled": ({"stack": "unrolled", "unroll": 2},
                        ["--unroll=2 sets the layers per rolled iteration of --stack=scan's "
                         "loop", "drop --unroll, or pass --stack=scan."]),
    "muon_rate_without_muon": ({"muon_learning_rate": 0.05},
                               ["--muon_learning_rate is the peak learning rate of Muon's "
                                "matrices, which only --optimizer=muon has: pass "
                                "--optimizer=muon, or drop --muon_learning_rate"]),
    "window_default": ({"pattern": "LG"},
                       ["--pattern=LG has L layers, which attend to the last --window "
                        "positions, but --window, not given, defaults to 32, more than "
                        "--seq_len=16: pass --window=16 or less."]),
    "window_given": ({"pattern": "LG", "window": 20},
                     ["but --window=20 is more than --seq_len=16: pass --window=16"]),
    # Each corrected.
    "full_unrolled": ({"stack": "unrolled", "remat": "full"}, None),
    "unroll_1_unrolled": ({"stack": "unrolled", "unroll": 1}, None),
    "muon_rate_with_muon": ({"muon_learning_rate": 0.05, "optimizer": "muon"}, None),
    "window_fits": ({"pattern": "LG", "window": 16}, None),
}


def test_gpt_flags_that_would_do_nothing_stop_at_start_up(tmp_path):
  missing = str(tmp_path / "missing.txt")   # the check after the flags' own
  args = [gpt_driver.as_args({**gpt_driver.TINY, "data_path": missing,
                              "workdir": str(tmp_path / name), **flags})
          for name, (flags, _) in CLI_CASES.items()]
  proc, out_path = gpt_driver.start_cli_driver(str(tmp_path), "round4", args,
                                               gpt_driver.xla_env())
  try:
    wait(proc)
  finally:
    proc.log.close()
  with open(out_path, encoding="utf-8") as f:
    results = json.load(f)
  for (name, (_, fragments)), result in zip(CLI_CASES.items(), results):
    lines = [l for l in result["stderr"].strip().splitlines()
             if not l.startswith("Pass --helpshort")]
    assert result["rc"] != 0 and len(lines) == 1, (name, result)
    for fragment in fragments or [f"error: --data_path={missing!r} does not exist"]:
      assert fragment in lines[0], (name, fragment, lines[0])
    assert not (tmp_path / name).exists(), name
