"""The functions train.py compiles: the model's loss, the train step, evaluation.

:func:`transform` is the model's loss as Haiku transforms it;
:func:`make_train_step` is one optimizer update of it. Each runs under the
run's mesh (``jax.set_mesh``): a pipelined stack reads its pipe axis from it,
and runs as a plain stack where there is none. :func:`trace_model` traces the
model once, abstractly, so that what stacktools refuses in it is said before
anything is compiled; :func:`compile_train_step` compiles the step for the
run's shardings, the parameters and optimizer state donated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.gpt import distributed
from examples.gpt import model as model_lib
from examples.gpt import model_config


def batch_seed(tokens: jax.Array) -> jax.Array:
  """The seed of a step's layer drops: a hash of its whole batch (uint32),
  position-weighted (odd multipliers mod 2^32)."""
  weights = jnp.arange(1, 2 * tokens.size, 2, dtype=jnp.uint32).reshape(tokens.shape)
  return jnp.sum(tokens.astype(jnp.uint32) * weights * jnp.uint32(2654435761))


def transform(cfg: model_config.GPTConfig) -> hk.Transformed:
  """The model's loss: ``(params, tokens, training=False, seed=None) -> (loss, stats)``.

  While ``training``, ``cfg.layer_drop`` skips blocks at random, with a key
  drawn from ``seed``, by default the batch's own (:func:`batch_seed`): a
  resumed run skips the blocks an uninterrupted one would, with no key to
  pass or checkpoint. A microbatch is given its whole batch's seed, so that
  every microbatch of a step skips the same blocks.

  Example::

    model = transform(cfg)
    params = model.init(jax.random.PRNGKey(0), tokens)
    loss, stats = model.apply(params, tokens, training=True)
  """
  def loss(tokens, training=False, seed=None):
    if not (training and cfg.layer_drop):
      return model_lib.loss_fn(cfg, tokens)
    seed = batch_seed(tokens) if seed is None else seed
    with hk.with_rng(jax.random.fold_in(jax.random.PRNGKey(0), seed)):
      return model_lib.loss_fn(cfg, tokens, training=True)

  return hk.without_apply_rng(hk.transform(loss))


def trace_model(cfg: model_config.GPTConfig, mesh: jax.sharding.Mesh, key: jax.Array,
                tokens: np.ndarray) -> Any:
  """Traces init and loss once, abstractly, under the mesh; returns the
  parameters' shapes.

  Compiles and allocates nothing; what stacktools refuses in the model's
  stack raises here (ValueError or TypeError, one line). ``remat="auto"``
  is traced as "none", the planner's business being the candidates.
  """
  if cfg.remat == "auto":
    cfg = dataclasses.replace(cfg, remat="none")
  model = transform(cfg)
  with jax.set_mesh(mesh):   # a pipelined stack checks itself against the mesh
    shapes = jax.eval_shape(model.init, key, tokens)
    jax.eval_shape(lambda p, t: model.apply(p, t, training=True), shapes, tokens)
  return shapes


def make_train_step(model: hk.Transformed, optimizer: optax.GradientTransformation,
                    grad_accum: int = 1) -> Callable[..., Any]:
  """``(params, opt_state, tokens) -> (params, opt_state, loss, stats)``.

  With ``grad_accum > 1`` the batch is cut into that many microbatches
  (sequence ``i`` in microbatch ``i % grad_accum``, so each takes its share
  of every data shard), whose gradients are computed one after another
  (``lax.scan``) and averaged before the one optimizer update: the loss and
  gradients of the whole batch, with the activations of one microbatch at a
  time, and the update's cost spread over more tokens. Layer drops are drawn
  once per step, from the whole batch (:func:`batch_seed`), and shared by its
  microbatches: the same blocks skip as in the step over the whole batch.

  Example::

    train_step = jax.jit(make_train_step(transform(cfg), optax.adamw(1e-3)))
    params, opt_state, loss, stats = train_step(params, opt_state, tokens)
  """
  loss_and_grads = jax.value_and_grad(
      lambda params, tokens, seed=None: model.apply(params, tokens, training=True, seed=seed),
      has_aux=True)

  def accumulated(params, tokens):
    micro = tokens.reshape(-1, grad_accum, *tokens.shape[1:]).swapaxes(0, 1)
    # Each microbatch drawing its own drops would make the step another
    # batch's: the drops are the whole batch's, as without accumulation.
    seed = batch_seed(tokens)

    def one(total, tokens):
      out, grads = loss_and_grads(params, tokens, seed)
      return jax.tree_util.tree_map(jnp.add, total, grads), out

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    total, outs = jax.lax.scan(one, zeros, micro)
    mean = lambda a: jnp.mean(a, axis=0)  # noqa: E731  (equal microbatches)
    return jax.tree_util.tree_map(mean, outs), jax.tree_util.tree_map(
        lambda g: g / grad_accum, total)

  def train_step(params, opt_state, tokens):
    (loss, stats), grads = (loss_and_grads if grad_accum == 1 else accumulated)(
        params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, stats

  return train_step


def check_grad_accum(grad_accum: int, batch_size: int, pipeline: str) -> None:
  """Raises ValueError unless ``grad_accum`` microbatches cut the batch evenly
  and no pipeline cuts it already."""
  if grad_accum > 1 and pipeline != "none":
    raise ValueError(f"--grad_accum={grad_accum} with --pipeline={pipeline}: a pipeline "
                     "cuts the batch into --microbatches itself; drop --grad_accum.")
  if batch_size % grad_accum:
    raise ValueError(f"--batch_size={batch_size} is not divisible by --grad_accum="
                     f"{grad_accum}: each microbatch needs the same number of sequences.")


def compile_train_step(train_step: Callable[..., Any], mesh: jax.sharding.Mesh,
                       params: Any, opt_state: Any, batch_shape: tuple[int, ...],
                       shardings: tuple[Any, Any, jax.sharding.NamedSharding]) -> Any:
  """``train_step`` compiled for the run's mesh and shardings.

  The parameters and optimizer state are donated: the update writes them in
  place (a checkpoint's save has copied them off the devices). The loss and
  the stats come back replicated.

  Args:
    train_step: from :func:`make_train_step`.
    mesh: the run's mesh, under which the step is traced.
    params: the parameters (arrays, or their shapes with shardings).
    opt_state: the optimizer state, the same.
    batch_shape: the shape of a batch of token ids.
    shardings: of the parameters, of the optimizer state and of a batch.

  Returns:
    The compiled step (``.memory_analysis()`` gives its temp memory).

  Raises:
    ValueError: one line, when XLA finds that the step does not fit the
      device's memory, naming the flags that make it smaller.
  """
  param_shardings, opt_shardings, batch_sharding = shardings
  replicated = distributed.replicated(mesh)
  with jax.set_mesh(mesh):
    lowered = jax.jit(
        train_step, in_shardings=(param_shardings, opt_shardings, batch_sharding),
        donate_argnums=(0, 1),
        out_shardings=(param_shardings, opt_shardings, replicated, replicated),
    ).lower(params, opt_state,
            jax.ShapeDtypeStruct(batch_shape, np.int32, sharding=batch_sharding))
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    # On an accelerator XLA refuses, at compile time, a program whose
    # buffers exceed the device's memory; its message says by how much.
    if not re.search(r"RESOURCE_EXHAUSTED|out of memory", str(e), re.I):
      raise
    said = str(e).splitlines()[0].split("RESOURCE_EXHAUSTED:")[-1].strip().rstrip(".")
    raise ValueError(
        f"the train step does not fit the device's memory ({said}). Make it "
        "smaller: recompute more (--remat=full, or --remat=auto with "
        "--memory_budget), split each batch (--grad_accum=K), or pass a smaller "
        "--batch_size.") from None


def make_evaluate(model: hk.Transformed, mesh: jax.sharding.Mesh,
                  batches: list[jax.Array]) -> Callable[[Any], float]:
  """``params -> float``: the mean loss over ``batches`` (no layer drop)."""
  eval_loss = jax.jit(lambda p, t: model.apply(p, t)[0])

  def evaluate(params: Any) -> float:
    with jax.set_mesh(mesh):   # traced on the first call, as the train step is
      return float(np.mean([eval_loss(params, b) for b in batches]))

  return evaluate
