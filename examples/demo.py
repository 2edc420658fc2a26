"""A one-minute tour: a 24-layer MLP stack under every checkpoint policy.

For each policy it prints the loss and gradient norm (they agree: remat only
changes what is kept, not what is computed) and the compiled temp memory of
one gradient step (it does not agree: that is the point).

  python examples/demo.py
"""

import haiku as hk
import jax
import jax.numpy as jnp

import stacktools as st

NUM_LAYERS, WIDTH, BATCH = 32, 128, 2048


class Block(hk.Module):
  """A residual MLP block that names its hidden activation."""

  def __call__(self, x):
    h = jax.nn.gelu(hk.Linear(2 * WIDTH)(hk.LayerNorm(-1, True, True)(x)))
    h = st.checkpoint_name(h, "mlp_hidden")
    return x + hk.Linear(WIDTH)(h)


def main():
  x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, WIDTH))
  policies = {
      "none": False, "full": "full", "nested": "nested", "offload": "offload",
      "save_all": "save_all",
      "save mlp_hidden": st.CheckpointPolicy(save_block_internals=["mlp_hidden"]),
  }
  params = None
  print(f"{NUM_LAYERS} layers, width {WIDTH}, batch {BATCH}")
  print(f"{'policy':>16}  {'loss':>10}  {'|grad|':>10}  {'temp MiB':>9}")
  for label, remat in policies.items():
    model = hk.transform(
        lambda x, remat=remat: jnp.mean(st.Stacked(
            Block, NUM_LAYERS, remat=remat, name="h").fold(x) ** 2))
    if params is None:
      params = model.init(jax.random.PRNGKey(0), x)
    step = jax.jit(jax.value_and_grad(lambda p, x: model.apply(p, None, x)))
    memory = step.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    loss, grads = step(params, x)
    norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree_util.tree_leaves(grads)))
    print(f"{label:>16}  {float(loss):10.6f}  {float(norm):10.6f}  {memory / 2**20:9.1f}")


if __name__ == "__main__":
  main()
