"""Low-rank adapters on a block's linear layers, added at trace time.

A *target* names ``hk.Linear`` modules by their module path: ``"attn"``
matches every Linear with a path segment ``attn`` (``block/attn/qkv``,
``block/attn/proj``), ``"attn/qkv"`` only that one, ``"fc*"`` both ``fc``
and ``fc_out`` (segments match as ``fnmatch`` patterns). An *adapter* of a
Linear ``y = x @ w + b`` (``w`` is ``[d_in, d_out]``) is two parameters
beside ``w`` in the Linear's own module::

  lora_a: [d_in, rank]     random: a fresh adapter is not stuck at zero
  lora_b: [rank, d_out]    zero: a fresh adapter changes nothing
  y = x @ w + b + (alpha / rank) * (x @ lora_a) @ lora_b

Nothing of the stacks is special-cased: :func:`lora` is an
``hk.intercept_methods`` interceptor, so the adapters are created wherever
the Linear's ``w`` is, by the same init. Inside ``Stacked`` that is the
vmapped init (each adapter gets the Layers axis, each layer its own key), and
the loop slices layer ``i``'s adapter with layer ``i``'s ``w``; under
``BlockSeq`` each layer's module holds its own. The delta ``lora_a @ lora_b``
is never formed: the adapter is applied to the activations.

*Many adapters*: with ``count=n`` each adapter parameter gets an adapter axis
just before its two matrix axes (``[n, d_in, rank]``; ``[L, n, d_in, rank]``
in a stack) and ``index`` (int ``[batch]``) picks each batch row's adapter,
so one program serves ``n`` adapters over one copy of the base.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp

from stacktools.core import _context

#: The names of an adapter's parameters in its Linear's module.
LORA_A, LORA_B = "lora_a", "lora_b"
#: The axes after the adapter axis: the two matrix axes.
MATRIX_AXES = 2

#: The Linear modules whose call an interceptor is adapting, outermost first:
#: a second :func:`lora` context around the same call would add the same
#: adapter (the same parameters) again.
_ADAPTING = _context.ContextStack[hk.Module]()


def check_targets(targets: Union[str, Sequence[str]]) -> tuple[str, ...]:
  """``targets`` as a tuple of non-empty patterns, or a one-line error."""
  if isinstance(targets, str):
    targets = tuple(t.strip() for t in targets.split(","))
  targets = tuple(targets)
  if not targets or not all(isinstance(t, str) and t.strip("/") for t in targets):
    raise ValueError(
        f"st.adapters.lora: targets={targets!r} names no module; give module-path "
        "patterns such as ['attn'] or 'attn,mlp' (a segment of a Linear's path).")
  return tuple(t.strip("/") for t in targets)


def check_rank(rank: Any) -> int:
  """``rank`` as a positive int, or a one-line error."""
  if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
    raise ValueError(f"st.adapters.lora: rank={rank!r}; the rank of an adapter is a "
                     "positive int (8 or 16 are usual), at most the layer's width.")
  return rank


def matches(target: str, module_name: str) -> bool:
  """Whether ``target``'s segments match consecutive segments of the path.

  Example::

    assert matches("attn", "h/block/attn/qkv")
    assert matches("attn/q*", "block/attn/qkv")
    assert not matches("fc", "block/fc_out")
  """
  want, path = target.split("/"), module_name.split("/")
  return any(all(fnmatch.fnmatchcase(p, w) for p, w in zip(path[i:], want))
             for i in range(len(path) - len(want) + 1))


class _Interceptor:
  """The method interceptor of one :func:`lora` context."""

  def __init__(self, targets, rank, alpha, count, index):
    self.targets, self.rank, self.count, self.index = targets, rank, count, index
    self.scale = (rank if alpha is None else alpha) / rank
    self.linears: list[str] = []     # every Linear called, matched or not
    self.matched: set[str] = set()   # the targets that matched one

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if not (isinstance(module, hk.Linear) and context.method_name == "__call__"):
      return next_fun(*args, **kwargs)
    name = module.module_name
    self.linears.append(name)
    hits = [t for t in self.targets if matches(t, name)]
    if not hits:
      return next_fun(*args, **kwargs)
    self.matched.update(hits)
    if any(m is module for m in _ADAPTING.values()):
      raise ValueError(
          f"st.adapters.lora: {name} is matched by two st.adapters.lora contexts, one "
          "inside the other, which would add its adapter twice; enter "
          "st.adapters.lora once around the model (or give the inner one other targets).")
    with _ADAPTING.push(module):
      out = next_fun(*args, **kwargs)
    x = args[0] if args else kwargs["inputs"]
    delta = self._delta(module, x, out.shape[-1], kwargs.get("precision"))
    return out + self.scale * delta.astype(out.dtype)

  def _delta(self, module: hk.Linear, x: jax.Array, d_out: int,
             precision: Any) -> jax.Array:
    """``(x @ lora_a) @ lora_b``, each row on its own adapter if indexed."""
    d_in = x.shape[-1]
    if self.rank > min(d_in, d_out):
      raise ValueError(
          f"st.adapters.lora: rank={self.rank} is over the width of "
          f"{module.module_name} ([{d_in}, {d_out}]); give a rank of at most "
          f"{min(d_in, d_out)}, or leave that layer out of the targets.")
    lead = () if self.count is None else (self.count,)
    # The fan-in scale of hk.Linear's default init, so x @ lora_a is O(x).
    a_init = hk.initializers.TruncatedNormal(1.0 / d_in ** 0.5)
    a = hk.get_parameter(LORA_A, [*lead, d_in, self.rank], x.dtype, init=a_init)
    b = hk.get_parameter(LORA_B, [*lead, self.rank, d_out], x.dtype, init=jnp.zeros)
    if self.count is None:
      if jax.default_backend() != "cpu":
        return jnp.dot(jnp.dot(x, a, precision=precision), b, precision=precision)
      # On XLA:CPU, on the rows ([tokens, d_in]), not on [batch, seq, d_in]:
      # the gradients of lora_a and lora_b then contract one token axis, and
      # XLA transposes the narrow [tokens, rank] operand for them. Contracting
      # batch and seq together, XLA:CPU copied the wide cotangent
      # [tokens, d_out] transposed instead: a [B, T, 4d] buffer in each MLP
      # layer's backward pass (benchmarks/lora: the LoRA step's temp 1.61x
      # the frozen base's, 1.34x on rows). On a TPU v5e the rows cost memory
      # instead (1.02x on [batch, seq], 1.21x on rows, at GPT-2-small's shape).
      flat = x.reshape(-1, d_in)
      delta = jnp.dot(jnp.dot(flat, a, precision=precision), b, precision=precision)
      return delta.reshape(*x.shape[:-1], d_out)
    rows = _check_index(self.index, x, module.module_name)
    if math.prod(x.shape[1:-1]) == 1 and jax.default_backend() != "cpu":
      return one_token_a_row(x, a, b, rows, precision)
    xa = jnp.einsum("b...i,bir->b...r", x, a[rows], precision=precision)
    return jnp.einsum("b...r,bro->b...o", xa, b[rows], precision=precision)


def one_token_a_row(x: jax.Array, a: jax.Array, b: jax.Array, rows: jax.Array,
                    precision: Any = None) -> jax.Array:
  """A decode step's ``(x @ lora_a) @ lora_b``, each row on adapter ``rows[i]``.

  Without gathering each row's ``lora_a`` and ``lora_b`` (two gathers per
  adapted layer and token): every adapter's ``x @ lora_a`` is computed for
  every row (one token against ``count * rank`` columns: a matmul as cheap
  as the one adapter's at that size) and the row's own is selected; its
  ``lora_b`` is selected elementwise among the ``count``. Both are selects,
  not products with a mask, so another adapter's values (even non-finite
  ones) never reach a row. On a TPU v5e at GPT-2-small's shape a decode
  step on 8 adapters took 1.14x the step on one, against 1.19x with gathers;
  on XLA:CPU it took 2.12x, against 1.24x with gathers, so the CPU gathers.

  Args:
    x: ``[batch, ..., d_in]``, one token a row (the middle axes of size 1).
    a: ``[count, d_in, rank]``, every adapter's ``lora_a``.
    b: ``[count, rank, d_out]``, every adapter's ``lora_b``.
    rows: int ``[batch]``, each row's adapter.
    precision: the matmuls' precision.

  Returns:
    ``[batch, ..., d_out]``: row ``i``'s ``(x[i] @ a[rows[i]]) @ b[rows[i]]``.
  """
  count = a.shape[0]
  xa_all = jnp.einsum("b...i,nir->b...nr", x, a, precision=precision)
  mine = rows.reshape((-1,) + (1,) * (x.ndim - 2) + (1, 1)) == jnp.arange(count)[:, None]
  xa = jnp.sum(jnp.where(mine, xa_all, 0), axis=-2)
  which = jnp.broadcast_to(rows.astype(jnp.int32).reshape(-1, 1, 1),
                           (rows.shape[0],) + b.shape[1:])
  b_rows = jax.lax.select_n(which, *[jnp.broadcast_to(b[n], which.shape)
                                     for n in range(count)])
  return jnp.einsum("b...r,bro->b...o", xa, b_rows, precision=precision)


def _check_index(index: Any, x: jax.Array, name: str) -> jax.Array:
  """``index`` as int ``[batch]`` matching ``x``'s rows, or a one-line error."""
  if index is None or jnp.ndim(index) != 1 or not jnp.issubdtype(
      jnp.result_type(index), jnp.integer) or x.ndim < 2:
    raise ValueError(
        f"st.adapters.lora: count is given, so index must be an int array "
        f"[batch] (each row's adapter), got {getattr(index, 'shape', index)!r} "
        f"for {name}'s input of shape {x.shape}; pass index=ids.")
  if index.shape[0] != x.shape[0]:
    raise ValueError(
        f"st.adapters.lora: index has {index.shape[0]} rows but {name}'s input "
        f"{x.shape} has {x.shape[0]}; x's leading axis must be the batch, one "
        "adapter a row (a pipeline's microbatches take one adapter: count=None).")
  return index


@contextlib.contextmanager
def lora(targets: Union[str, Sequence[str]], *, rank: int,
         alpha: Optional[float] = None, count: Optional[int] = None,
         index: Optional[jax.Array] = None) -> Iterator[None]:
  """Adds low-rank adapters to the ``hk.Linear`` layers that ``targets`` name.

  Enter it inside the function you ``hk.transform``: every matching Linear
  called in the block gets ``lora_a`` (``[d_in, rank]``, random) and
  ``lora_b`` (``[rank, d_out]``, zero) beside its ``w``, and returns
  ``x @ w + b + (alpha / rank) * (x @ lora_a) @ lora_b``. In a ``Stacked``
  stack they carry its Layers axis and come from its vmapped init. Split
  them from the base with :func:`split`, fold them in with :func:`merge`.

  Example::

    def forward(x):
      with st.adapters.lora(["hidden"], rank=2, alpha=4.0):
        return st.Stacked(lambda: hk.Linear(8, name="hidden"), 3, name="h").fold(x)

    f = hk.without_apply_rng(hk.transform(forward))
    x = jnp.ones([2, 8])
    params = f.init(jax.random.PRNGKey(0), x)
    assert params["h/hidden"]["lora_a"].shape == (3, 8, 2)
    base, adapters = st.adapters.split(params)
    assert set(base["h/hidden"]) == {"w", "b"}

  Args:
    targets: module-path patterns (a list, or one string split at commas):
      a Linear is adapted when the segments of a pattern match consecutive
      segments of its module path (``fnmatch`` per segment).
    rank: the adapters' rank, at most each adapted layer's smaller width.
    alpha: the scale's numerator (``alpha / rank``); ``None`` for ``rank``,
      a scale of 1.
    count: ``None`` for one adapter, or the number of adapters on an adapter
      axis (``[count, d_in, rank]`` a layer); then ``index`` is needed.
    index: int ``[batch]``: each batch row's adapter (with ``count``).

  Raises:
    ValueError: a bad ``targets``, ``rank`` or ``index``, a rank over a
      layer's width, a Linear matched by this context and by one around it
      (its adapter would be added twice), or (as the context closes) a
      target that matched no Linear called inside it.

  See also: :func:`split`, :func:`join`, :func:`merge`, :func:`stack`.
  """
  targets = check_targets(targets)
  rank = check_rank(rank)
  if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                            or count <= 0):
    raise ValueError(f"st.adapters.lora: count={count!r}; give the number of adapters "
                     "(a positive int), or None for one adapter.")
  interceptor = _Interceptor(targets, rank, alpha, count, index)
  with hk.intercept_methods(interceptor):
    yield
  # Only a traced call tells: a jitted function called again runs no Linear.
  unmatched = [t for t in targets if t not in interceptor.matched]
  if interceptor.linears and unmatched:
    seen = ", ".join(sorted(set(interceptor.linears)))
    raise ValueError(
        f"st.adapters.lora: the target {unmatched[0]!r} matches no hk.Linear; the "
        f"Linear layers called were: {seen}. Name one of them (or a segment of "
        "its path).")
