"""graft and kfac_adamw: the grafting math and the recipe's composition."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers
from tests import problems


def _fixed(tree):
  """A transformation whose output is ``tree`` whatever its input; it
  needs ``batch=`` (so the extra arguments must reach it)."""
  def update_fn(updates, state, params=None, *, batch, **extra):
    del updates, params, extra
    assert batch == "b"
    return tree, state + 1
  return optax.GradientTransformationExtraArgs(
      lambda p: jnp.zeros((), jnp.int32), update_fn)


def test_graft_is_direction_rescaled_to_the_magnitude_norm_per_tensor():
  rng = np.random.default_rng(0)
  grads = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
           "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
           "z": jnp.asarray(rng.normal(size=(2,)), jnp.float32)}
  direction = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
               "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
               "z": jnp.zeros((2,), jnp.float32)}
  rms = optax.scale_by_rms(0.9, eps_in_sqrt=False, bias_correction=True)
  tx = kl.graft(_fixed(direction), rms)
  state = tx.init(grads)
  out, state = tx.update(grads, state, grads, batch="b")
  mag, _ = rms.update(grads, rms.init(grads), grads)
  for k in ("w", "b"):
    d, m = np.asarray(direction[k]), np.asarray(mag[k])
    want = d * np.linalg.norm(m) / np.linalg.norm(d)
    np.testing.assert_allclose(out[k], want, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out[k]), np.linalg.norm(m),
                               rtol=1e-6)
  # An all-zero direction takes the magnitude's step.
  np.testing.assert_array_equal(out["z"], mag["z"])
  assert isinstance(state, kl.GraftState) and int(state.direction) == 1
  # The magnitude's state advanced as RMSProp's does.
  _, want_state = rms.update(grads, rms.init(grads), grads)
  np.testing.assert_array_equal(state.magnitude.nu["w"],
                                want_state.nu["w"])


def _hand_built(collection, lr, damping, period, b1=0.9, wd=0.01):
  """The grafted recipe written out with optax and scale_by_kfac (the
  caller passes the statistics' examples as ``batch=``)."""
  rms = optax.scale_by_rms(decay=0.999, eps=1e-8, eps_in_sqrt=False,
                           bias_correction=True)
  direction = kl.scale_by_kfac(collection, damping=damping,
                               inverse_update_period=period)

  def init_fn(params):
    return direction.init(params), rms.init(params)

  def update_fn(updates, state, params=None, **extra):
    d, d_state = direction.update(updates, state[0], params, **extra)
    r, r_state = rms.update(updates, state[1], params)

    def one(di, ri):
      nd, nr = jnp.linalg.norm(di), jnp.linalg.norm(ri)
      return jnp.where(nd > 0, di * (nr / jnp.where(nd > 0, nd, 1.0)), ri)
    return jax.tree.map(one, d, r), (d_state, r_state)

  plain = optax.with_extra_args_support
  return optax.chain(
      optax.GradientTransformationExtraArgs(init_fn, update_fn),
      plain(optax.ema(b1, debias=True)),
      plain(optax.add_decayed_weights(wd)),
      plain(optax.scale_by_learning_rate(lr)))


def _run(loss_fn, tx, params, batches, head_rows=None):
  """Jitted steps; ``head_rows``: pass only that many examples as batch."""
  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    stats_batch = batch if head_rows is None else jax.tree.map(
        lambda x: x[:head_rows], batch)
    updates, state = tx.update(grads, state, params, batch=stats_batch)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for batch in batches:
    params, state = step(params, state, batch)
  return params


@pytest.mark.slow
@pytest.mark.xla_defaults
def test_kfac_adamw_is_the_hand_built_chain_bitwise():
  p = problems.mlp_classifier((6, 8, 3), 16, 4)
  collection = p.scan()
  got = _run(p.loss, kl.kfac_adamw(3e-3, collection, damping=1e-2,
                                   inverse_update_period=2,
                                   stats_fraction=0.25), p.params, p.batches)
  want = _run(p.loss, _hand_built(collection, 3e-3, 1e-2, 2), p.params,
              p.batches, head_rows=4)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), got,
                       p.params)
  assert min(jax.tree.leaves(moved)) > 0


@pytest.mark.parametrize("fraction", [0.0, 1.5, math.nan, True])
def test_kfac_adamw_rejects_a_bad_stats_fraction(fraction):
  collection = problems.tiny_classifier().scan()
  with pytest.raises(ValueError, match="stats_fraction"):
    kl.kfac_adamw(1e-3, collection, stats_fraction=fraction)


@pytest.mark.slow
def test_kfac_adamw_skips_a_nonfinite_step_and_keeps_its_moments():
  p = problems.tiny_classifier()
  tx = kl.kfac_adamw(1e-3, p.scan(), stats_fraction=1.0)
  update = jax.jit(lambda g, s: tx.update(g, s, p.params, batch=p.batch))
  grads = jax.grad(p.loss)(p.params, p.batch)
  _, state = update(grads, tx.init(p.params))
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  updates, new = update(bad, state)
  assert int(new.num_skipped) == 1 and not bool(new.last_finite)
  assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
  # RMSProp's moment, the momentum and K-FAC's counters stay (its factors
  # fold in the finite statistics, as skip_nonfinite documents).
  same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  same(new.inner[0].magnitude, state.inner[0].magnitude)
  same(new.inner[1:], state.inner[1:])
  curv, old = new.inner[0].direction, state.inner[0].direction
  same((curv.count, curv.rng), (old.count, old.rng))


@pytest.mark.slow
def test_kfac_adamw_on_a_tiny_gpt_equals_the_hand_built_recipe():
  pytest.importorskip("flax")
  from flax import nnx  # pylint: disable=import-outside-toplevel
  char_gpt = helpers.load_example("char_gpt")
  model = char_gpt.GPT(11, 8, 16, 2, 2, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.as_pure(params)
  loss_fn = char_gpt.make_loss_fn(graphdef)
  ids = np.random.default_rng(0).integers(0, 11, 200).astype(np.int32)
  batches = [char_gpt.train_batch(ids, k, 8, 8, 0) for k in range(3)]
  collection = kl.scan(loss_fn, params, batches[0])
  got = _run(loss_fn, kl.kfac_adamw(3e-3, collection), params, batches)
  want = _run(loss_fn, _hand_built(collection, 3e-3, 1e-3, 10), params,
              batches, head_rows=1)
  jax.tree.map(np.testing.assert_array_equal, got, want)
