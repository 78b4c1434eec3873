"""eval_losses, total_loss and their sampled forms, against the user's loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers

B, T, D, E = 4, 3, 3, 5


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _problem():
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w": jax.random.normal(ks[0], (D, E)) / np.sqrt(D),
            "v": jax.random.normal(ks[1], (D, 1)) / np.sqrt(D)}
  batch = {"x": jax.random.normal(ks[2], (B, T, D)),
           "y": jax.random.randint(ks[3], (B, T), 0, E),
           "c": jnp.arange(B, dtype=jnp.float64) % 3,
           "mask": jnp.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1.]])}
  return params, batch


def poisson(z, y):
  return jnp.exp(z) - y * z


def rounded_rate(key, z):
  del key
  return jnp.round(jnp.exp(z))


def loss_fn(params, batch, with_targets=True):
  logits = batch["x"] @ params["w"]
  rate = (batch["x"][:, 0] @ params["v"])[:, 0]
  y = batch["y"] if with_targets else None
  kl.register_categorical_predictive_distribution(logits, y,
                                                  mask=batch["mask"])
  kl.register_loss_function(rate, batch["c"], loss_fn=poisson, weight=0.5,
                            sampler=rounded_rate)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  ce = jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])
  reg = 0.01 * jnp.sum(params["w"] ** 2)
  return ce + 0.5 * jnp.mean(poisson(rate, batch["c"])) + reg, reg


def test_total_loss_is_the_users_loss_without_its_regulariser():
  params, batch = _problem()
  col = kl.scan(loss_fn, params, batch, has_aux=True)

  @jax.jit  # Eager, each primitive is a compile of its own.
  def evaluate(p, b):
    return (loss_fn(p, b), kl.eval_losses(col, p, b),
            0.5 * jnp.mean(poisson((b["x"][:, 0] @ p["v"])[:, 0], b["c"])),
            kl.total_loss(col, p, b), kl.loss_value(col, p, b))

  (loss, reg), got, poisson_term, total, value = evaluate(params, batch)
  assert len(got) == 2
  np.testing.assert_allclose(sum(got), loss - reg, rtol=1e-12)
  np.testing.assert_allclose(got[1], poisson_term, rtol=1e-12)
  np.testing.assert_allclose(total, loss - reg, rtol=1e-12)
  np.testing.assert_allclose(value, loss, rtol=0)


def test_sampled_losses_draw_from_the_model():
  """The deterministic sampler's targets give ``eval_losses`` at them; the
  categorical's expected NLL under the model is its mean entropy."""
  params, batch = _problem()
  col = kl.scan(loss_fn, params, batch, has_aux=True)
  got = jax.jit(lambda p, b, k: kl.eval_losses_on_samples(
      col, p, b, k, num_samples=4000))(params, batch, jax.random.PRNGKey(3))
  rate = (batch["x"][:, 0] @ params["v"])[:, 0]
  np.testing.assert_allclose(
      got[1], 0.5 * jnp.mean(poisson(rate, jnp.round(jnp.exp(rate)))),
      rtol=1e-12)
  logp = jax.nn.log_softmax(batch["x"] @ params["w"])
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  want = jnp.sum(entropy * batch["mask"]) / jnp.sum(batch["mask"])
  # 4000 draws of each of 9 positions: standard error below 0.3%.
  np.testing.assert_allclose(got[0], want, rtol=0.02)
  total = jax.jit(lambda p, b, k: kl.total_sampled_loss(
      col, p, b, k, num_samples=4000))(params, batch, jax.random.PRNGKey(3))
  np.testing.assert_allclose(total, sum(got), rtol=1e-12)


def test_missing_targets_or_sampler_raise():
  params, batch = _problem()
  col = kl.scan(lambda p, b: loss_fn(p, b, with_targets=False), params,
                batch, has_aux=True)
  with pytest.raises(ValueError, match="loss tag 0 .categorical. was "
                     "registered without targets"):
    kl.eval_losses(col, params, batch)

  def no_sampler(p, b):
    z = b["x"][:, 0] @ p["v"]
    return jnp.mean(kl.register_loss_function(z, None, loss_fn=lambda a, _:
                                              jnp.sum(a ** 2)))
  col = kl.scan(no_sampler, params, batch)
  with pytest.raises(ValueError, match="has no sampler"):
    kl.eval_losses_on_samples(col, params, batch, jax.random.PRNGKey(0))


def test_axis_name_averages_over_replicas():
  params, batch = _problem()
  batch = dict(batch, mask=jnp.ones((B, T)))
  col = kl.scan(loss_fn, params, batch, has_aux=True)
  shards = jax.tree.map(lambda x: x.reshape((2, B // 2) + x.shape[1:]),
                        batch)
  with helpers.on_replica_devices(2) as devices:
    got = jax.pmap(lambda b: kl.total_loss(col, params, b, axis_name="i"),
                   axis_name="i", devices=devices)(shards)
    np.testing.assert_allclose(got, kl.total_loss(col, params, batch),
                               rtol=1e-12)
