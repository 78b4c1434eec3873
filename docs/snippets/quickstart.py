import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl


def loss_fn(params, batch):
  x, labels = batch
  for i, layer in enumerate(params):
    y = x @ layer["w"] + layer["b"]
    y = kl.register_dense(y, x, layer["w"], layer["b"])   # tag the layer
    x = jnp.tanh(y) if i < len(params) - 1 else y
  kl.register_categorical_predictive_distribution(x, labels)  # tag the loss
  return optax.softmax_cross_entropy_with_integer_labels(x, labels).mean()


sizes = [20, 64, 64, 5]
keys = jax.random.split(jax.random.PRNGKey(0), len(sizes))
params = [{"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]
batch = (jax.random.normal(keys[-1], (128, 20)),
         jax.random.randint(keys[-1], (128,), 0, 5))

collection = kl.scan(loss_fn, params, batch)   # trace once, find the tags
print(collection.describe())

tx = optax.chain(
    optax.clip_by_global_norm(10.0),
    kl.kfac(1e-2, collection, damping=1e-2, inverse_update_period=5),
)
opt_state = tx.init(params)
value_grad_and_stats = kl.value_grad_and_stats(loss_fn, collection)


@jax.jit
def step(params, opt_state, batch, rng):
  # One forward pass gives the loss, the gradient and the curvature stats.
  loss, grads, stats = value_grad_and_stats(params, batch, rng)
  updates, opt_state = tx.update(grads, opt_state, params, stats=stats)
  return optax.apply_updates(params, updates), opt_state, loss


key = jax.random.PRNGKey(1)
for i in range(20):
  params, opt_state, loss = step(params, opt_state, batch,
                                 jax.random.fold_in(key, i))
print(f"loss after 20 steps: {loss:.4f}")
