"""The mixed-layer stacks ``mixed_layers`` compares, and the loop that checks them.

* :data:`CONTENDERS`: each stack by its name in the results: ``st.Stacked``
  with the 5:1 pattern :data:`P51`, ``st.BlockSeq`` with the same pattern,
  and ``st.Stacked`` of one (global) block, for contrast;
* :func:`factories`: the blocks of the two kinds, the GPT example's
  (``examples/gpt/model.py``: pre-LayerNorm attention + MLP; a local block
  attends over the last ``--window`` positions, a global one over all), or
  two residual MLPs (``models.GeluMLPBlock``) of different hidden widths;
* :func:`stack_fn` (and :func:`transformed`), :func:`example_input`,
  :func:`grad_step` and :func:`lowered`: a contender's stack, its input,
  its gradient step, and that step lowered;
* :func:`reference`: the stack as a Python loop over sliced parameters, what
  the stacks' values and gradients are checked against.

``args`` is the script's flags: ``--block``, ``--width``, ``--heads``,
``--batch``, ``--seq_len`` and ``--window``.
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

import stacktools as st
from benchmarks.common import models
from examples.gpt import model as gpt
from examples.gpt import model_config

#: The 5:1 pattern of the compile-time and memory measurements.
P51 = "LLLLLG"
#: Each contender's label, by its name in the results.
CONTENDERS = {"pattern": "st.Stacked, pattern=LLLLLG", "blockseq": "st.BlockSeq, pattern=LLLLLG",
              "one_block": "st.Stacked, one (global) block"}


def factories(args) -> dict[str, Any]:
  """The block factory of each kind, ``"L"`` (local) and ``"G"`` (global)."""
  if args.block == "mlp":   # two kinds with different parameter shapes
    return {"L": lambda: models.GeluMLPBlock(2, name="block"),
            "G": lambda: models.GeluMLPBlock(4, name="block")}
  # The GPT example's block; Block takes the window itself, so the config
  # needs no pattern (its vocab_size is never used by a block).
  cfg = model_config.GPTConfig(vocab_size=1, seq_len=args.seq_len, num_heads=args.heads,
                               d_model=args.width)
  return {"L": lambda: gpt.Block(cfg, args.window, name="block"),
          "G": lambda: gpt.Block(cfg, None, name="block")}


def stack_fn(args, impl: str, pattern: str, n: int, remat: Any, reverse: bool = False):
  """``f(x)``: the stack applied to ``x``, to transform."""
  if impl == "one_block":
    return lambda x: st.Stacked(factories(args)["G"], n, remat=remat, name="h").fold(x)
  cls = st.BlockSeq if impl == "blockseq" else st.Stacked
  return lambda x: cls(factories(args), n, pattern=pattern, remat=remat,
                       reverse=reverse, name="h").fold(x)


def transformed(args, impl: str, pattern: str, n: int, remat: Any,
                reverse: bool = False) -> hk.Transformed:
  """:func:`stack_fn`, transformed (no RNG to apply)."""
  return hk.without_apply_rng(hk.transform(stack_fn(args, impl, pattern, n, remat, reverse)))


def example_input(args) -> jax.Array:
  """The carry every stack is given: ``[batch, seq_len, width]``, random."""
  return jax.random.normal(jax.random.PRNGKey(1), (args.batch, args.seq_len, args.width))


def grad_step(apply):
  """Loss and gradients (parameters and input) of ``mean(sin(3 apply(p, x)))``."""
  return jax.value_and_grad(lambda p, x: jnp.mean(jnp.sin(3.0 * apply(p, x))), argnums=(0, 1))


def reference(args, params, x, pattern: str, n: int, reverse: bool):
  """The stack as a Python loop: layer i applies its kind's block, alone in
  a plain ``hk.transform``, to its own slice of the kind's parameters."""
  blocks = {k: hk.without_apply_rng(hk.transform(lambda x, f=f: f()(x)))
            for k, f in factories(args).items()}
  ranks, seen = [], {}
  for i in range(n):
    kind = pattern[i % len(pattern)]
    ranks.append(seen.get(kind, 0))
    seen[kind] = ranks[-1] + 1
  for i in (reversed(range(n)) if reverse else range(n)):
    kind = pattern[i % len(pattern)]
    scope = f"h/{kind}/"
    layer = {key[len(scope):]: {name: v[ranks[i]] for name, v in bundle.items()}
             for key, bundle in params.items() if key.startswith(scope)}
    x = blocks[kind].apply(layer, x)
  return x


def lowered(args, impl: str, n: int, remat: str) -> jax.stages.Lowered:
  """The gradient step of ``impl``'s stack of :data:`P51`, ``n`` layers deep,
  lowered for abstract parameters (nothing runs)."""
  model = transformed(args, impl, P51, n, remat)
  x = example_input(args)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
  return jax.jit(grad_step(model.apply)).lower(params, x)
