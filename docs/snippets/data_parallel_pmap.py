import os
# Four simulated CPU devices; set before importing jax (not needed on GPUs).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import kfac_jax_lite as kl  # noqa: E402


def loss_fn(params, batch):
  x, labels = batch
  logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
  kl.register_categorical_predictive_distribution(logits, labels)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


n = jax.local_device_count()
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w1": jax.random.normal(k1, (16, 32)) / 4,
          "w2": jax.random.normal(k2, (32, 4)) / 32 ** 0.5}
x = jax.random.normal(k3, (n * 32, 16))
labels = jax.random.randint(k3, (n * 32,), 0, 4)
collection = kl.scan(loss_fn, params, (x[:32], labels[:32]))

# --8<-- [start:step]
tx = kl.kfac(1e-2, collection, damping=1e-2, axis_name="data")


def step(params, opt_state, batch):               # batch: this replica's share
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  loss, grads = jax.lax.pmean((loss, grads), "data")
  updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
  return optax.apply_updates(params, updates), opt_state, loss


step = jax.pmap(step, axis_name="data")           # params, state: [devices, ...]
# --8<-- [end:step]

replicate = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)  # noqa
params_r, state_r = replicate(params), replicate(tx.init(params))
batch = (x.reshape(n, 32, 16), labels.reshape(n, 32))
for _ in range(10):
  params_r, state_r, loss = step(params_r, state_r, batch)
print("loss per replica:", loss)
# Every replica holds the same parameters and the same K-FAC state.
for leaf in jax.tree.leaves((params_r, state_r)):
  assert (leaf == leaf[:1]).all()
