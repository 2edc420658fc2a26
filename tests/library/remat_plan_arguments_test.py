"""Tests of what st.plan_remat and st.remat_report take: ``only=`` and ``measure=``.

* ``only=`` labels that name no candidate of any loop are an error listing
  the known labels (per-depth ones too); a label that is a candidate of
  another loop of the step is kept, and the plan it leads to computes the
  gradient of a Python loop over the same weights;
* ``measure=True`` times the candidates, so it needs arrays: given
  ``jax.ShapeDtypeStruct`` arguments it says so before compiling anything,
  and ``measure=False`` plans from the shapes alone.

(The planner's choices, its cache and its report are in remat_plan_test.py
and remat_model_test.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stacktools as st

D = 3
WS = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (4, D, D))
C = jnp.ones((2, D))


def _step(carry, w):
  return carry + 0.5 * jnp.tanh(carry @ w)


def _tagged_step(name):
  def step(carry, w):
    return carry + 0.5 * st.checkpoint_name(jnp.tanh(carry @ w), name)
  return step


def _python_loop(step, carry, ws):
  for i in range(ws.shape[0]):
    carry = step(carry, ws[i])
  return carry


def _auto_grad(*steps):
  """``grad`` of a chain of ``remat="auto"`` folds, one per step function."""
  def loss(c):
    for step in steps:
      c = st.fold(step, remat="auto")(c, WS)
    return jnp.sum(c ** 2)
  return jax.grad(loss)


# ---------------------------------------------------------------------------
# only=


@pytest.mark.parametrize("plan", [
    lambda only: st.plan_remat(_auto_grad(_step), C, budget="1GiB", measure=False,
                               only=only),
    lambda only: st.remat_report(_auto_grad(_step), C, only=only),
], ids=["plan_remat", "remat_report"])
@pytest.mark.parametrize("only", [["full", "bogus"], ["bogus"]])
def test_unknown_only_label_is_an_error(plan, only):
  # Once dropped when another label was known: the planner planned among
  # fewer candidates than asked.
  with pytest.raises(ValueError) as info:
    plan(only)
  message = str(info.value)
  assert "'bogus'" in message and "'full'" in message and "'nested'" in message, message
  assert "none:1,full:3" in message, message   # the known labels, per-depth ones too


def test_only_label_of_another_stack_is_kept():
  # save:a is a candidate of the first loop only; it is not unknown.
  step = _auto_grad(_tagged_step("a"), _tagged_step("b"))
  plan = st.plan_remat(step, C, budget="1GiB", measure=False, only=["full", "save:a"])
  assert sorted(tuple(r.plan.values()) for r in plan.report.rows) == [
      ("full", "full"), ("save:a", "full")]
  with plan:
    got = jax.jit(step)(C)
  want = jax.grad(lambda c: jnp.sum(_python_loop(
      _tagged_step("b"), _python_loop(_tagged_step("a"), c, WS), WS) ** 2))(C)
  np.testing.assert_allclose(got, want, rtol=1e-5)


# ---------------------------------------------------------------------------
# measure=


@pytest.mark.parametrize("call,subject", [
    (lambda args: st.plan_remat(_auto_grad(_step), *args, budget="1GiB"), "st.plan_remat"),
    (lambda args: st.remat_report(_auto_grad(_step), *args, measure=True),
     "st.remat_report"),
], ids=["plan_remat", "remat_report"])
def test_measure_needs_arrays(call, subject):
  # Once it failed inside JAX, after compiling a candidate.
  shapes = (jax.ShapeDtypeStruct(C.shape, C.dtype),)
  with pytest.raises(ValueError, match=rf"^{subject}: measure=True runs the "
                     r"candidates it times, but args\[0\] is a jax.ShapeDtypeStruct.*"
                     r"pass arrays, or measure=False"):
    call(shapes)


def test_shapes_without_measure_still_plan():
  shapes = (jax.ShapeDtypeStruct(C.shape, C.dtype),)
  plan = st.plan_remat(_auto_grad(_step), *shapes, budget="1GiB", measure=False,
                       only=["full"])
  assert plan.labels == {"loop_0": "full"}
