"""The refresh warm-up (``inverse_update_warmup``) and kfac's defaults."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import step_rules
from tests import helpers
from tests import problems


@pytest.fixture(name="problem", scope="module")
def _problem():
  return problems.small_classifier(9)


def _cache(state):
  if isinstance(state, kl.SkipNonFiniteState):
    state = state.inner[0]
  return [np.asarray(b.cache["a^-1"]) for b in state.estimator.blocks]


def _run(update, init, problem, steps, poison=()):
  """Per step, whether each block's cached inverse changed; the state.
  ``update(grads, state, batch)`` is jitted; the gradients of the steps in
  ``poison`` are NaN (skipped)."""
  params, batches, _ = problem
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])

  @jax.jit
  def step(s, b, bad, *args):
    g = jax.tree.map(lambda x: jnp.where(bad, jnp.nan, x), grads)
    return update(g, s, b, *args)

  state, out = init(params), []
  for i in range(steps):
    before = _cache(state)
    state = step(state, batches[i % len(batches)], i in poison)
    out.append([not np.array_equal(x, y)
                for x, y in zip(before, _cache(state))])
  return out, state


def _refreshed(tx, problem, steps, poison=()):
  params = problem[0]
  return _run(lambda g, s, b: tx.update(g, s, params, batch=b)[1],
              tx.init, problem, steps, poison)


@pytest.fixture(name="scheduled", scope="module")
def _scheduled(problem):
  """One compiled step of ``scale_by_kfac`` whose period and warm-up are
  traced (int32 arrays, as under ``inject_hyperparams``)."""
  params, batches, c = problem
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])

  @jax.jit
  def step(s, b, bad, period, warmup):
    tx = kl.scale_by_kfac(c, inverse_update_period=period,
                          inverse_update_warmup=warmup)
    g = jax.tree.map(lambda x: jnp.where(bad, jnp.nan, x), grads)
    return tx.update(g, s, params, batch=b)[1]

  def run(period, warmup, steps, poison=()):
    args = (jnp.asarray(period, jnp.int32), jnp.asarray(warmup, jnp.int32))
    state, out = kl.scale_by_kfac(c).init(params), []
    for i in range(steps):
      before = _cache(state)
      state = step(state, batches[i % len(batches)], i in poison, *args)
      out.append([not np.array_equal(x, y)
                  for x, y in zip(before, _cache(state))])
    return out, state

  return run


@pytest.mark.parametrize("period,warmup", [(3, 0), (3, 4), (2, 5), (4, 1)])
def test_warmup_refreshes_every_step_then_every_period(scheduled, period,
                                                       warmup):
  """Step ``t`` refreshes iff ``t < w`` or ``t % p == 0``."""
  steps = 10
  got, state = scheduled(period, warmup, steps)
  want = [t < warmup or t % period == 0 for t in range(steps)]
  assert [all(r) for r in got] == want
  assert [any(r) for r in got] == want
  assert int(state.num_inverse_updates) == sum(want)
  np.testing.assert_array_equal(
      [bool(step_rules.refresh_due(t, period, warmup)) for t in range(steps)],
      want)


def test_warmup_counts_applied_steps_only(scheduled):
  """A skipped step (NaN gradients) neither refreshes nor advances the
  count: the warm-up covers the first ``w`` applied steps."""
  got, state = scheduled(4, 3, 7, poison=(1,))
  # Applied steps 0, 1, 2 (calls 0, 2, 3) and 4 (call 5) refresh.
  assert [all(r) for r in got] == [True, False, True, True, False, True,
                                   False]
  assert int(state.count) == 6 and int(state.num_inverse_updates) == 4


def test_static_warmup_matches_the_traced_one(problem, scheduled):
  """A Python int warm-up and period (the usual build) refresh as the
  traced ones do."""
  tx = kl.scale_by_kfac(problem[2], inverse_update_period=3,
                        inverse_update_warmup=2)
  got, _ = _refreshed(tx, problem, 5)
  assert got == scheduled(3, 2, 5)[0]
  assert [all(r) for r in got] == [True, True, False, True, False]


@pytest.mark.slow
def test_warmup_with_staggered_refreshes(problem):
  """Every block through the warm-up, then one block per step (round
  robin on ``count % period``)."""
  tx = kl.scale_by_kfac(problem[2], inverse_update_period=2,
                        inverse_update_warmup=3,
                        stagger_inverse_updates=True)
  got, _ = _refreshed(tx, problem, 6)
  assert got == [[True, True]] * 3 + [[False, True], [True, False],
                                      [False, True]]


@pytest.mark.slow
def test_kfac_default_warmup_and_chain(problem):
  """``kfac`` refreshes at every one of its first
  ``DEFAULT_INVERSE_UPDATE_WARMUP`` steps, then every
  ``inverse_update_period``; it is the chain its docstring gives, with
  the same warm-up passed to ``scale_by_kfac``."""
  params, batches, c = problem
  warmup = step_rules.DEFAULT_INVERSE_UPDATE_WARMUP
  assert warmup == 20
  steps = warmup + 6
  _, state = _refreshed(kl.kfac(1e-2, c), problem, steps)
  want = sum(t < warmup or t % 5 == 0 for t in range(steps))
  assert int(state.inner[0].num_inverse_updates) == want
  _, state = _refreshed(kl.kfac(1e-2, c, inverse_update_warmup=0),
                        problem, steps)
  assert int(state.inner[0].num_inverse_updates) == (steps + 4) // 5

  lr = 1e-2
  chain = kl.skip_nonfinite(optax.chain(
      kl.scale_by_kfac(c, learning_rate=lr, norm_constraint=1e-3,
                       inverse_update_warmup=warmup),
      optax.trace(decay=0.9), optax.scale_by_learning_rate(lr)))
  fused = kl.kfac(lr, c)
  for tx in (chain, fused):
    state = tx.init(params)
    step = jax.jit(lambda s, b, tx=tx: tx.update(
        jax.grad(helpers.classifier_loss)(params, b), s, params, batch=b))
    ups = []
    for b in batches[:3]:
      u, state = step(state, b)
      ups.append(u)
    if tx is chain:
      want_ups = ups
  for a, b in zip(jax.tree.leaves(ups), jax.tree.leaves(want_ups)):
    np.testing.assert_array_equal(a, b)


def test_kfac_defaults_are_the_step_rules():
  """``kfac`` builds with the warm-up and the KL bound of ``step_rules``
  (their behaviour: the tests above and tests/test_transform.py)."""
  params = inspect.signature(kl.kfac).parameters
  assert params["inverse_update_warmup"].default == 20
  assert step_rules.DEFAULT_INVERSE_UPDATE_WARMUP == 20
  assert params["norm_constraint"].default == 1e-3
  assert params["stats_fraction"].default is None  # Every example.
  params = inspect.signature(kl.scale_by_kfac).parameters
  assert params["inverse_update_warmup"].default == 0


@pytest.mark.parametrize("value", [-1, 2.5, True, "3", None])
@pytest.mark.parametrize("factory", ["kfac", "scale_by_kfac",
                                     "update_curvature"])
def test_bad_warmup_is_rejected(problem, value, factory):
  c = problem[2]
  build = {
      "kfac": lambda w: kl.kfac(1e-2, c, inverse_update_warmup=w),
      "scale_by_kfac": lambda w: kl.scale_by_kfac(
          c, inverse_update_warmup=w),
      "update_curvature": lambda w: kl.update_curvature(
          kl.FisherEstimator(c), inverse_update_warmup=w),
  }[factory]
  with pytest.raises(ValueError, match=(
      rf"inverse_update_warmup={value!r} must be an int >= 0.*"
      r"inverse_update_warmup=20")):
    build(value)
