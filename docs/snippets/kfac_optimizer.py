import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl


def loss_fn(params, batch):               # an autoencoder, summed BCE
  x = batch
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    h = jnp.tanh(h) if i < len(params) - 1 else h
  kl.register_multi_bernoulli_predictive_distribution(h, x)
  return optax.sigmoid_binary_cross_entropy(h, x).sum(-1).mean()


sizes = [32, 16, 4, 16, 32]
keys = jax.random.split(jax.random.PRNGKey(0), len(sizes))
params = [{"w": jax.random.normal(k, (m, n)) / m ** 0.5, "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]
batch = (jax.random.uniform(keys[-1], (256, 32)) > 0.5).astype(jnp.float32)
collection = kl.scan(loss_fn, params, batch)

# --8<-- [start:optimizer]
tx = kl.kfac_optimizer(collection, initial_damping=1.0)
opt_state = tx.init(params)


@jax.jit
def step(params, opt_state, batch):
  # grads=None: loss, gradient, statistics and the quadratic model's
  # Fisher products all come from one forward pass over the batch.
  updates, opt_state = tx.update(None, opt_state, params, batch=batch)
  return optax.apply_updates(params, updates), opt_state
# --8<-- [end:optimizer]


for i in range(30):
  params, opt_state = step(params, opt_state, batch)
  if i % 10 == 9:
    print(f"step {i + 1}: loss {opt_state.loss:.3f} damping "
          f"{opt_state.damping:.3g} lr {opt_state.learning_rate:.3f} "
          f"momentum {opt_state.momentum:.3f}")
assert loss_fn(params, batch) < 0.9 * 32 * jnp.log(2.0)
