import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import kfac_jax_lite as kl  # noqa: E402


def loss_fn(params, batch):
  x, labels = batch
  logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
  kl.register_categorical_predictive_distribution(logits, labels)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


mesh = Mesh(np.array(jax.devices()), ("data",))
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w1": jax.random.normal(k1, (16, 32)) / 4,
          "w2": jax.random.normal(k2, (32, 4)) / 32 ** 0.5}
batch = (jax.random.normal(k3, (128, 16)),
         jax.random.randint(k3, (128,), 0, 4))      # the global batch
collection = kl.scan(loss_fn, params, batch)

# --8<-- [start:step]
tx = kl.kfac(1e-2, collection, damping=1e-2, axis_name="data")
value_grad_and_stats = kl.value_grad_and_stats(loss_fn, collection,
                                               axis_name="data")


def step(params, opt_state, batch, rng):
  # Loss and gradient are this replica's; the statistics are averaged.
  loss, grads, stats = value_grad_and_stats(params, batch, rng)
  loss, grads = jax.lax.pmean((loss, grads), "data")
  updates, opt_state = tx.update(grads, opt_state, params, stats=stats)
  return optax.apply_updates(params, updates), opt_state, loss


step = jax.jit(jax.shard_map(
    step, mesh=mesh, in_specs=(P(), P(), P("data"), P()),
    out_specs=(P(), P(), P())))
# --8<-- [end:step]

opt_state = tx.init(params)
first = loss_fn(params, batch)
for i in range(10):
  params, opt_state, loss = step(params, opt_state, batch,
                                 jax.random.PRNGKey(i))
print(f"loss {first:.3f} -> {loss:.3f}")
assert loss < first, (first, loss)
