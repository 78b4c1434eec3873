import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax
import kfac_jax_lite as kl

jax.config.update("jax_enable_x64", True)     # for the comparison below


def loss_fn(params, batch):
  x, labels = batch
  h = jnp.tanh(kl.register_dense(x @ params["w1"], x, params["w1"]))
  logits = kl.register_dense(h @ params["w2"], h, params["w2"])
  kl.register_categorical_predictive_distribution(logits, labels)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w1": jax.random.normal(k1, (6, 5)) / 6 ** 0.5,
          "w2": jax.random.normal(k2, (5, 3)) / 5 ** 0.5}
batch = (jax.random.normal(k3, (32, 6)), jax.random.randint(k3, (32,), 0, 3))
collection = kl.scan(loss_fn, params, batch)

# --8<-- [start:estimator]
est = kl.FisherEstimator(collection, damping=1e-2, damping_type="exact",
                         estimation_mode="exact", exps=(-1, -0.5))
state = est.init(params)
state = est.update_curvature(state, params, batch, jax.random.PRNGKey(0))
state = est.update_cache(state)                # damped powers at damping

v = jax.grad(loss_fn)(params, batch)
natural = est.multiply_inverse(state, v)       # (F̂ + λI)⁻¹ v
half = est.multiply_matpower(state, v, -0.5)   # (F̂ + λI)^(-1/2) v
fisher = est.full_fisher(state)                # [P, P], undamped
# --8<-- [end:estimator]

flat_v, unravel = ravel_pytree(v)
want = jnp.linalg.solve(fisher + 1e-2 * jnp.eye(len(flat_v)), flat_v)
np.testing.assert_allclose(ravel_pytree(natural)[0], want, rtol=1e-6)
print("multiply_inverse matches the dense solve;", fisher.shape)
