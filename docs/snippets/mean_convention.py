import jax
import jax.numpy as jnp
import numpy as np
import optax
import kfac_jax_lite as kl

B, T, D, V = 4, 6, 5, 7


def loss_fn(params, batch, flatten=False):
  x, targets = batch                                 # x [B, T, D]
  logits = x @ params["w"]                           # [B, T, V]
  if flatten:                                        # the same loss on
    logits, targets = logits.reshape(-1, V), targets.reshape(-1)  # [B·T, V]
  kl.register_categorical_predictive_distribution(logits, targets)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()                        # mean over B and T


key = jax.random.PRNGKey(0)
params = {"w": jax.random.normal(key, (D, V)) / D ** 0.5}
batch = (jax.random.normal(key, (B, T, D)),
         jax.random.randint(key, (B, T), 0, V))


def fisher(fn):
  collection = kl.scan(fn, params, batch)
  est = kl.FisherEstimator(collection, estimation_mode="exact")
  state = est.update_curvature(est.init(params), params, batch)
  return est.full_fisher(state)


# [B, T, V] and [B·T, V] describe the same mean loss: the same curvature.
np.testing.assert_allclose(
    fisher(loss_fn), fisher(lambda p, b: loss_fn(p, b, flatten=True)),
    rtol=1e-5, atol=1e-7)
print("same Fisher for [B, T, V] and [B*T, V]")


# --8<-- [start:mask]
def masked_loss_fn(params, batch):
  x, targets, mask = batch
  logits = x @ params["w"]
  logits = kl.register_categorical_predictive_distribution(
      logits, targets, mask=mask)          # logits [B, T, V], mask [B, T]
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
      logits, targets) * mask) / jnp.sum(mask)
# --8<-- [end:mask]


def exact_fisher(fn, batch):
  collection = kl.scan(fn, params, batch,
                       approximations={"fully_connected": "full"})
  est = kl.FisherEstimator(collection, estimation_mode="exact")
  state = est.update_curvature(est.init(params), params, batch)
  return est.full_fisher(state)


# Masking the last two positions is the mean over the others.
x, targets = batch
mask = jnp.ones((B, T)).at[:, T - 2:].set(0.0)
np.testing.assert_allclose(
    exact_fisher(masked_loss_fn, (x, targets, mask)),
    exact_fisher(loss_fn, (x[:, :T - 2], targets[:, :T - 2])),
    rtol=1e-5, atol=1e-7)
print("a masked position drops out of the mean")
