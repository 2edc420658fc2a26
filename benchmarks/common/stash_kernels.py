"""Matmuls that read and write one row of a stacked ``[L, ...]`` buffer in place.

The experiment behind ``benchmarks/stash_mlp.py``: a loop over layers keeps
values for its backward pass in stacked buffers, and XLA copies each value
into its row (``dynamic-update-slice``) and back out (``dynamic-slice``),
often in another layout, as ops of their own. :func:`matmul` is a Pallas
TPU kernel that takes the layer index as a scalar prefetch, so that its
``BlockSpec`` s address row ``index`` of a stacked operand (weights or kept
values) and of a stacked output directly: the output buffer is aliased in
and out (``input_output_aliases``), and only row ``index`` is written.

``C[m, n] = epilogue(sum_k prologue(A)[m, k] B[k, n], *extras)``, with ``A``
given as ``[m, k]`` or, ``transpose_a``, as ``[k, m]`` (the weight gradient's
``x^T g``), and ``B`` as ``[k, n]`` or, ``transpose_b``, ``[n, k]`` (the input
gradient's ``g W^T``). Off a TPU the kernel runs in Pallas's interpret mode
(its grid as a loop of XLA ops), which the tests use.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

#: Block sizes (rows of C, columns of C, the contraction), shrunk to fit a dim.
BLOCKS = (512, 512, 512)


def _block(size: int, want: int) -> int:
  """The largest of ``want``, ``want/2``, ... that divides ``size`` (or ``size``)."""
  block = want
  while block > 8 and size % block:
    block //= 2
  return block if size % block == 0 else size


def _spec(block: tuple[int, int], index: Callable[..., tuple[Any, Any]],
          stacked: bool) -> pl.BlockSpec:
  """A 2-D block of an operand; of row ``index`` when the operand is stacked."""
  if stacked:
    return pl.BlockSpec((None, *block), lambda i, j, k, row: (row[0], *index(i, j, k)))
  return pl.BlockSpec(block, lambda i, j, k, row: index(i, j, k))


def _kernel(row_ref, a_ref, b_ref, *refs, num_extras: int, aliased: bool,
            transpose_a: bool, transpose_b: bool, prologue, epilogue):
  del row_ref   # only the BlockSpecs read it
  extras = refs[:num_extras]
  o_ref, acc_ref = refs[num_extras + int(aliased):]
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  a = a_ref[...]
  if prologue is not None or transpose_a:
    # In float32: Mosaic transposes 32-bit tiles; a transposed left operand
    # of the matmul itself it may not take.
    a = a.astype(jnp.float32)
    a = a if prologue is None else prologue(a)
    a = (a.T if transpose_a else a).astype(b_ref.dtype)
  dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
  acc_ref[...] += lax.dot_general(a, b_ref[...], dims, preferred_element_type=jnp.float32)

  @pl.when(k == pl.num_programs(2) - 1)
  def _():
    out = acc_ref[...]
    if epilogue is not None:
      out = epilogue(out, *(e[...].astype(jnp.float32) for e in extras))
    o_ref[...] = out.astype(o_ref.dtype)


def matmul(a: jax.Array, b: jax.Array, row: jax.Array, *, a_stacked: bool = False,
           b_stacked: bool = False, transpose_a: bool = False, transpose_b: bool = False,
           prologue: Optional[Callable[[jax.Array], jax.Array]] = None,
           epilogue: Optional[Callable[..., jax.Array]] = None,
           extras: Sequence[jax.Array] = (), extras_stacked: Sequence[bool] = (),
           into: Optional[jax.Array] = None, out_dtype: Any = None,
           blocks: tuple[int, int, int] = BLOCKS, interpret: Optional[bool] = None
           ) -> jax.Array:
  """``C = epilogue(prologue(A) @ B, *extras)``; stacked operands read at ``row``.

  Args:
    a, b: the operands (see the module's docstring for their layouts); a
      stacked one has a leading Layers axis and is read at ``row`` only.
    row: int32 scalar, the layer.
    prologue: elementwise, applied to ``A``'s blocks in float32.
    epilogue: ``epilogue(acc, *extra_blocks)``, in float32, on ``C``'s block.
    extras: ``[m, n]`` arrays (``[L, m, n]`` where ``extras_stacked``) whose
      blocks the epilogue reads.
    into: a stacked ``[L, m, n]`` buffer: ``C`` is written into its row
      ``row`` in place and the whole buffer returned; else ``C`` is returned.
    interpret: run in Pallas's interpret mode (default: off a TPU).

  Example::

    h_stash = matmul(x, w1, i, b_stacked=True, into=h_stash)   # h_stash[i] = x @ w1[i]
  """
  a2 = a.shape[1:] if a_stacked else a.shape
  b2 = b.shape[1:] if b_stacked else b.shape
  m, k = (a2[1], a2[0]) if transpose_a else a2
  n = b2[0] if transpose_b else b2[1]
  bm, bn, bk = (_block(m, blocks[0]), _block(n, blocks[1]), _block(k, blocks[2]))
  a_spec = _spec((bk, bm) if transpose_a else (bm, bk),
                 (lambda i, j, kk: (kk, i)) if transpose_a else (lambda i, j, kk: (i, kk)),
                 a_stacked)
  b_spec = _spec((bn, bk) if transpose_b else (bk, bn),
                 (lambda i, j, kk: (j, kk)) if transpose_b else (lambda i, j, kk: (kk, j)),
                 b_stacked)
  extras_stacked = tuple(extras_stacked) or (False,) * len(extras)
  in_specs = [a_spec, b_spec] + [_spec((bm, bn), lambda i, j, kk: (i, j), s)
                                 for s in extras_stacked]
  operands = [a, b, *extras]
  aliases = {}
  if into is not None:
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    aliases = {1 + len(operands): 0}   # operand 0 is the prefetched row
    operands.append(into)
    out_shape = jax.ShapeDtypeStruct(into.shape, into.dtype)
  else:
    out_shape = jax.ShapeDtypeStruct((m, n), out_dtype or a.dtype)
  kernel = functools.partial(_kernel, num_extras=len(extras), aliased=into is not None,
                             transpose_a=transpose_a, transpose_b=transpose_b,
                             prologue=prologue, epilogue=epilogue)
  if interpret is None:
    interpret = jax.default_backend() != "tpu"
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(m // bm, n // bn, k // bk), in_specs=in_specs,
          out_specs=_spec((bm, bn), lambda i, j, kk: (i, j), into is not None),
          scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
      out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
  )(jnp.reshape(row, (1,)).astype(jnp.int32), *operands)
