"""Hashed sampling keys and draws (kfac_jax_lite.keys): determinism,
independence, distributions, and no threefry in a K-FAC step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import keys
from tests import helpers
from tests import problems


def test_fmix32_is_a_bijection_on_a_sample():
  x = jnp.arange(1 << 16, dtype=jnp.uint32) * jnp.uint32(65537)
  assert np.unique(np.asarray(keys.fmix32(x))).size == x.size


_M32 = 0xFFFFFFFF


def _fmix32_reference(h: int) -> int:
  """MurmurHash3's finaliser on Python integers."""
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & _M32
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & _M32
  return h ^ (h >> 16)


def _absorb_reference(h: int, words) -> int:
  for w in words:
    h = (_fmix32_reference(h ^ w) + 0x9E3779B9) & _M32
  return _fmix32_reference(h)


def test_hashes_equal_a_python_reference():
  """``fmix32`` (MurmurHash3's finaliser), ``random_bits`` (the chain of
  its docstring over a counter) and ``derive`` (lanes mixed with the
  hashed index, then the same chain), word for word against Python
  integers: a change to the hash's arithmetic changes every run's draws."""
  words = [int(w) for w in np.asarray(jax.random.PRNGKey(11))]
  x = [0, 1, 2, 0xFFFFFFFF, 0x12345678]
  np.testing.assert_array_equal(
      keys.fmix32(np.array(x, np.uint32)),
      np.array([_fmix32_reference(v) for v in x], np.uint32))
  np.testing.assert_array_equal(
      keys.random_bits(jax.random.PRNGKey(11), (2, 3)),
      np.array([_absorb_reference(i, words) for i in range(6)],
               np.uint32).reshape(2, 3))
  lanes = (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)
  for index in (0, 7):
    mixed = _fmix32_reference((index * 0x9E3779B9 + 1) & _M32)
    want = [_absorb_reference(_fmix32_reference(lane ^ mixed), words)
            for lane in lanes]
    np.testing.assert_array_equal(
        keys.derive(jax.random.PRNGKey(11), index, num_words=3),
        np.array(want, np.uint32))
    np.testing.assert_array_equal(
        jax.jit(keys.derive, static_argnums=2)(
            jax.random.PRNGKey(11), jnp.int32(index), 3),
        np.array(want, np.uint32))


def test_derive_is_deterministic_and_depends_on_key_and_index():
  k = jax.random.PRNGKey(3)
  a = np.asarray(keys.derive(k, 0))
  np.testing.assert_array_equal(a, keys.derive(k, 0))
  assert a.shape == (2,) and a.dtype == np.uint32
  others = [keys.derive(k, 1), keys.derive(jax.random.PRNGKey(4), 0),
            keys.derive(k, 0, num_words=4)[:2]]
  for o in others[:2]:
    assert not np.any(np.asarray(o) == a)  # every word changes
  # Traced indices (e.g. an axis index) give the same words.
  np.testing.assert_array_equal(jax.jit(keys.derive)(k, jnp.int32(5)),
                                keys.derive(k, 5))


def test_typed_and_raw_keys_and_a_clear_error():
  typed = jax.random.key(7)
  np.testing.assert_array_equal(keys.derive(typed, 2),
                                keys.derive(jax.random.key_data(typed), 2))
  assert keys.key_words(jax.random.key(0, impl="rbg")).shape == (4,)
  with pytest.raises(TypeError, match="uint32"):
    keys.derive(jnp.zeros((2,), jnp.float32), 0)


def test_step_keys_advance_like_split():
  k = jax.random.PRNGKey(0)
  use, nxt = keys.step_keys(k)
  use2, nxt2 = keys.step_keys(nxt)
  words = {tuple(np.asarray(x)) for x in (k, use, nxt, use2, nxt2)}
  assert len(words) == 5


def test_sample_keys_give_distinct_uncorrelated_draws():
  """Draws of different samples and of different losses are uncorrelated;
  within one draw the counters never collide."""
  k = jax.random.PRNGKey(1)
  ks = keys.sample_keys(k, 0, 3)
  assert ks.shape == (3, 2) and ks.dtype == jnp.uint32
  draws = jax.vmap(lambda kk: keys.uniform(kk, (4000,)))(ks)
  other = jax.vmap(lambda kk: keys.uniform(kk, (4000,)))(
      keys.sample_keys(k, 1, 3))
  flat = np.concatenate([np.asarray(draws), np.asarray(other)])
  corr = np.corrcoef(flat)
  assert np.all(np.abs(corr[np.triu_indices(6, 1)]) < 0.06)
  bits = np.asarray(keys.random_bits(ks[0], (1 << 16,)))
  assert np.unique(bits).size == bits.size


def test_uniform_is_uniform_on_the_open_interval():
  """Mean, variance and decile counts of 200k draws; neighbours uncorrelated
  (a counter-based generator's weak spot)."""
  u = np.asarray(keys.uniform(jax.random.PRNGKey(5), (200_000,)))
  assert 0.0 < u.min() and u.max() < 1.0
  np.testing.assert_allclose(u.mean(), 0.5, atol=0.003)
  np.testing.assert_allclose(u.var(), 1 / 12, atol=0.002)
  counts = np.histogram(u, bins=10, range=(0, 1))[0]
  chi2 = np.sum((counts - 20_000) ** 2 / 20_000)
  assert chi2 < 30  # 9 degrees of freedom: p ≈ 4e-4 at 30
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
  shaped = keys.uniform(jax.random.PRNGKey(5), (400, 500))
  np.testing.assert_array_equal(np.asarray(shaped).reshape(-1), u)


@pytest.mark.parametrize("kind", ["categorical", "normal", "multi_bernoulli"])
def test_loss_samples_follow_the_model_distribution(kind):
  """LossSpec.sample draws from p(y | z): class frequencies, Normal moments,
  Bernoulli rates."""
  from kfac_jax_lite.losses import LossSpec
  spec = LossSpec(kind=kind, var=0.5)
  n = 20_000
  key = jax.random.PRNGKey(2)
  if kind == "categorical":
    probs = np.array([0.1, 0.2, 0.7])
    z = jnp.broadcast_to(jnp.log(probs), (n, 3))
    y = np.asarray(spec.sample(key, z))
    np.testing.assert_allclose(np.bincount(y, minlength=3) / n, probs,
                               atol=0.015)
  elif kind == "normal":
    z = jnp.full((n, 2), 1.5)
    y = np.asarray(spec.sample(key, z))
    np.testing.assert_allclose(y.mean(), 1.5, atol=0.02)
    np.testing.assert_allclose(y.var(), 0.5, atol=0.02)
  else:
    z = jnp.broadcast_to(jnp.array([-2.0, 0.0, 1.0]), (n, 3))
    y = np.asarray(spec.sample(key, z))
    np.testing.assert_allclose(y.mean(0), jax.nn.sigmoid(z[0]), atol=0.015)


@pytest.mark.perf
def test_a_kfac_step_runs_no_threefry():
  """The sampled Fisher's keys (step, loss, sample) and draws are hashed:
  a step of kfac() with value_grad_and_stats runs no threefry (split,
  fold_in) and no jax.random bits, and two keys draw different targets."""
  params, (batch,), collection = problems.small_classifier(1)
  tx = kl.kfac(1e-2, collection, damping=1e-2)
  vgs = kl.value_grad_and_stats(helpers.classifier_loss, collection)

  def step(p, s, rng):
    _, grads, stats = vgs(p, batch, rng)
    updates, s = tx.update(grads, s, p, stats=stats)
    return optax.apply_updates(p, updates), s, stats

  state = tx.init(params)
  jaxpr = jax.make_jaxpr(step)(params, state, jax.random.PRNGKey(0)).jaxpr
  for derivation in ("threefry2x32", "random_split", "random_fold_in",
                     "random_bits"):
    assert helpers.count_primitive(jaxpr, derivation) == 0, derivation
  _, _, s1 = jax.jit(step)(params, state, jax.random.PRNGKey(0))
  _, _, s2 = jax.jit(step)(params, state, jax.random.PRNGKey(1))
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), s1, s2)
  assert max(jax.tree.leaves(diff)) > 0
