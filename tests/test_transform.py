"""scale_by_kfac / kfac as optax transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers
from tests import problems


@pytest.fixture(name="problem", scope="module")
def _problem():
  return problems.small_classifier(7)


def _structure(state):
  return (jax.tree.structure(state),
          [(x.shape, x.dtype) for x in jax.tree.leaves(state)])


def test_chain_jit_no_retrace_and_inverse_period(problem):
  params, batches, c = problem
  period = 3
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   kl.scale_by_kfac(c, inverse_update_period=period),
                   optax.sgd(0.1))
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state, batch):
    traces.append(1)
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  before = _structure(state)
  caches = []
  for i, batch in enumerate(batches):
    params, state = step(params, state, batch)
    assert _structure(state) == before
    kfac_state = state[1]
    assert int(kfac_state.count) == i + 1
    assert int(kfac_state.num_inverse_updates) == i // period + 1
    assert int(kfac_state.num_cov_updates) == i + 1
    caches.append(kfac_state.estimator.blocks[0].cache["a^-1"])
  assert len(traces) == 1
  # The cached inverse changes exactly at steps 0, 3, 6.
  changed = [not np.array_equal(a, b) for a, b in zip(caches, caches[1:])]
  assert changed == [False, False, True, False, False, True]
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


@pytest.mark.slow
def test_cov_update_period(problem):
  params, batches, c = problem
  tx = kl.scale_by_kfac(c, cov_update_period=2, inverse_update_period=2)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])
  factors = []
  for b in batches[:4]:
    _, state = step(grads, state, params, b)
    factors.append(state.estimator.blocks[0].a)
  assert int(state.num_cov_updates) == 2
  assert np.array_equal(factors[0], factors[1])
  assert not np.array_equal(factors[1], factors[2])


def test_first_step_direction_is_damped_inverse(problem):
  params, batches, c = problem
  tx = kl.scale_by_kfac(c, damping=1e-2, estimation_mode="empirical")
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])
  direction, _ = jax.jit(lambda s: tx.update(grads, s, params,
                                              batch=batches[0]))(
                                                  tx.init(params))
  est = kl.FisherEstimator(c, estimation_mode="empirical", damping=1e-2)

  @jax.jit
  def reference(params, batch, grads):
    s = est.update_cache(est.update_curvature(est.init(params), params,
                                              batch))
    return est.multiply_inverse(s, grads)
  want = reference(params, batches[0], grads)
  helpers.assert_trees_close(direction, want, rtol=1e-5)


@pytest.mark.slow
def test_stats_path_equals_batch_path(problem):
  params, batches, c = problem
  tx = kl.kfac(0.1, c, estimation_mode="empirical")
  fn = kl.value_grad_and_stats(helpers.classifier_loss, c,
                               estimation_mode="empirical")
  loss, grads, stats = fn(params, batches[0], jax.random.PRNGKey(0))
  u1, _ = tx.update(grads, tx.init(params), params, stats=stats)
  u2, _ = tx.update(grads, tx.init(params), params, batch=batches[0])
  np.testing.assert_allclose(loss, helpers.classifier_loss(params,
                                                           batches[0]))
  helpers.assert_trees_close(u1, u2, rtol=1e-5)


@pytest.mark.slow
def test_linearized_path_equals_batch_path(problem):
  """``linearized=`` (the gradient's own forward pass) gives ``kfac`` the
  statistics ``batch=`` computes (the same sampling key)."""
  params, batches, c = problem
  tx = kl.kfac(0.1, c)

  @jax.jit
  def one_pass(params, batch):
    lin = kl.FisherEstimator(c).linearize(params, batch)
    return lin.gradient(), tx.update(lin.gradient(), tx.init(params),
                                     params, linearized=lin)

  @jax.jit
  def two_passes(params, batch):
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    return grads, tx.update(grads, tx.init(params), params, batch=batch)

  helpers.assert_trees_close(one_pass(params, batches[0]),
                             two_passes(params, batches[0]), rtol=1e-5)
  lin = kl.FisherEstimator(c).linearize(params, batches[0])
  with pytest.raises(ValueError, match="linearized=.*stats_fraction"):
    kl.kfac(0.1, c, stats_fraction=0.5).update(
        lin.gradient(), tx.init(params), params, linearized=lin)


def test_batch_and_stats_both_or_neither(problem):
  params, batches, c = problem
  tx = kl.kfac(0.1, c)
  state = tx.init(params)
  with pytest.raises(ValueError, match="batch=.*stats=.*neither"):
    tx.update(params, state, params)
  with pytest.raises(ValueError, match="both batch and stats"):
    tx.update(params, state, params, batch=batches[0], stats={})


def test_unknown_extra_args_are_ignored(problem):
  params, batches, c = problem
  tx = kl.kfac(0.1, c)
  state = tx.init(params)
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])
  u1, _ = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))(
      grads, state, params, batches[0])
  u2, _ = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b, epoch=3))(
      grads, state, params, batches[0])
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs,match", [
    ({"inverse_update_period": 0}, "inverse_update_period=0"),
    ({"cov_update_period": 1.5}, "cov_update_period=1.5"),
    ({"damping": -1.0}, "damping=-1.0"),
    ({"cov_ema_decay": 1.0}, "cov_ema_decay=1.0"),
    ({"estimation_mode": "fisher"}, "estimation_mode='fisher'"),
    ({"power": 0.5}, "power=0.5"),
    ({"power": jnp.asarray(-1)}, "static_args=\\('power',\\)"),
    ({"estimation_mode": "exact", "estimator": "est"},
     "estimation_mode='exact' given with estimator="),
    ({"power": -0.5, "estimator": "est"},
     r"power=-0.5 is not in .*exps=\[-1\]"),
])
def test_bad_hyperparameters(problem, kwargs, match):
  if kwargs.get("estimator") == "est":
    kwargs = dict(kwargs, estimator=kl.FisherEstimator(problem[2]))
  with pytest.raises(ValueError, match=match):
    kl.scale_by_kfac(problem[2], **kwargs)


def test_kfac_trains_faster_than_sgd_on_a_few_steps(problem):
  params, batches, c = problem
  batch = batches[0]

  def run(tx, kfac_step):
    @jax.jit
    def step(p, s):
      g = jax.grad(helpers.classifier_loss)(p, batch)
      u, s = (tx.update(g, s, p, batch=batch) if kfac_step
              else tx.update(g, s, p))
      return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for _ in range(10):
      p, s = step(p, s)
    return helpers.classifier_loss(p, batch)

  start = helpers.classifier_loss(params, batch)
  # The preconditioner's own speed: no KL clipping (kfac's default bound
  # is for robustness at any learning rate, not speed at a tuned one).
  kfac_loss = run(kl.kfac(0.3, c, damping=1e-2, momentum=0.0,
                          norm_constraint=None), True)
  sgd_loss = run(optax.sgd(0.3), False)
  assert kfac_loss < 0.5 * start
  assert kfac_loss < sgd_loss


@pytest.mark.parametrize("make", [
    lambda c: kl.kfac(0.1, c), lambda c: kl.kfac_optimizer(c)])
def test_state_buffers_can_be_donated(problem, make):
  params, batches, c = problem
  tx = make(c)

  def step(params, state, batch):
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    return tx.update(grads, state, params, batch=batch)

  state = tx.init(params)
  step = jax.jit(step, donate_argnums=(1,))
  for batch in batches[:2]:
    _, state = step(params, state, batch)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))


def test_staggered_inverse_updates_refresh_one_slice_per_step(problem):
  params, batches, c = problem
  assert len(c.layers) == 2
  tx = kl.scale_by_kfac(c, inverse_update_period=2,
                        stagger_inverse_updates=True)
  state = tx.init(params)
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])
  step = jax.jit(lambda s, b: tx.update(grads, s, params, batch=b))
  refreshed = []
  for b in batches[:5]:
    before = [blk.cache["a^-1"] for blk in state.estimator.blocks]
    _, state = step(state, b)
    after = [blk.cache["a^-1"] for blk in state.estimator.blocks]
    refreshed.append([not np.array_equal(x, y)
                      for x, y in zip(before, after)])
  # Step 0 refreshes every block; then layer (count % 2) each step.
  assert refreshed == [[True, True], [False, True], [True, False],
                       [False, True], [True, False]]


def test_norm_constraint_clips_to_the_kl_bound(problem):
  params, batches, c = problem
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])
  lr = 0.5

  def direction(**kw):
    tx = kl.scale_by_kfac(c, damping=1e-2, estimation_mode="empirical", **kw)
    return jax.jit(lambda s: tx.update(grads, s, params, batch=batches[0]))(
        tx.init(params))[0]

  d0 = direction()
  sq = float(optax.tree.vdot(d0, grads))          # gᵀF̂⁻¹g
  for bound in (1e-3 * lr ** 2 * sq, 1e3 * lr ** 2 * sq):
    d1 = direction(norm_constraint=bound, learning_rate=lr)
    nu = float(optax.tree.norm(d1) / optax.tree.norm(d0))
    helpers.assert_trees_close(d1, jax.tree.map(lambda x: nu * x, d0), 1e-5)
    if bound < lr ** 2 * sq:
      np.testing.assert_allclose(lr ** 2 * nu ** 2 * sq, bound, rtol=1e-4)
    else:
      assert nu == pytest.approx(1.0)


@pytest.mark.parametrize("lr", [1e-3, 0.5])
def test_kfac_clips_at_its_default_kl_bound(problem, lr):
  """``kfac``'s default: the unclipped update times ``ν = min(1,
  sqrt(1e-3 / (α² gᵀF̂⁻¹g)))``, ``gᵀF̂⁻¹g`` from the unclipped update
  ``-α F̂⁻¹g`` (momentum 0)."""
  params, batches, c = problem
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])

  def update(**kw):
    tx = kl.kfac(lr, c, momentum=0.0, damping=1e-2,
                 estimation_mode="empirical", **kw)
    return jax.jit(lambda s: tx.update(grads, s, params, batch=batches[0]))(
        tx.init(params))[0]

  free = update(norm_constraint=None)
  sq = -float(optax.tree.vdot(free, grads)) / lr   # gᵀF̂⁻¹g
  nu = min(1.0, np.sqrt(1e-3 / (lr ** 2 * sq)))
  assert (nu < 1.0) == (lr == 0.5)  # one case clipped, one not.
  helpers.assert_trees_close(
      update(), jax.tree.map(lambda u: nu * u, free), 1e-5)
  helpers.assert_trees_close(update(norm_constraint=1e-3), update(), 0.0)


@pytest.mark.slow
def test_norm_constraint_schedule_is_read_at_the_step_count(problem):
  params, batches, c = problem
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])
  schedule = lambda count: 1e-4 * (count + 1.0)  # noqa: E731

  def updates(bound):
    tx = kl.kfac(0.5, c, momentum=0.0, damping=1e-2, norm_constraint=bound)
    step = jax.jit(lambda s: tx.update(grads, s, params, batch=batches[0]))
    state, out = tx.init(params), []
    for _ in range(2):
      u, state = step(state)
      out.append(u)
    return out

  got = updates(schedule)
  for count, u in enumerate(got):
    want = updates(schedule(count))[count]
    helpers.assert_trees_close(u, want, 1e-6)


@pytest.mark.parametrize("bound,error,match", [
    (-1.0, ValueError, r"norm_constraint=-1\.0 must be a number >= 0"),
    ("1e-3", TypeError, r"norm_constraint='1e-3' is a str"),
])
def test_kfac_rejects_a_bad_norm_constraint(problem, bound, error, match):
  with pytest.raises(error, match=match):
    kl.kfac(1e-2, problem[2], norm_constraint=bound)


def test_damping_schedule_and_weight_decay(problem):
  params, batches, c = problem
  schedule = lambda count: 1e-2 * (count + 1.0)  # noqa: E731
  tx = kl.scale_by_kfac(c, damping=schedule, inverse_update_period=1)
  state = jax.jit(tx.init)(params)
  grads = jax.jit(jax.grad(helpers.classifier_loss))(params, batches[0])
  step = jax.jit(lambda s: tx.update(grads, s, params, batch=batches[0]))
  for count in range(3):
    _, state = step(state)
    np.testing.assert_allclose(state.estimator.blocks[0].damping,
                               schedule(count), rtol=1e-6)

  wd, lr = 0.1, 0.3
  plain = kl.kfac(lr, c, momentum=0.0, estimation_mode="empirical")
  decayed = kl.kfac(lr, c, momentum=0.0, weight_decay=wd,
                    estimation_mode="empirical")
  u0, u1 = jax.jit(lambda g, p, b: [
      tx.update(g, tx.init(p), p, batch=b)[0] for tx in (plain, decayed)])(
          grads, params, batches[0])
  helpers.assert_trees_close(
      u1, jax.tree.map(lambda a, p: a - lr * wd * p, u0, params), 1e-5)


def _steps(tx, params, batches, poison=()):
  """Updates and states of jitted steps from ``value_grad_and_stats``;
  the gradients of the steps in ``poison`` are NaN."""
  vgs = kl.value_grad_and_stats(helpers.classifier_loss, tx[1])
  tx = tx[0]

  def step(p, s, b, bad):
    _, grads, stats = vgs(p, b, jax.random.PRNGKey(0))
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.nan, g), grads)
    batch = b if isinstance(s, kl.KFACOptimizerState) else None
    return tx.update(grads, s, p, stats=stats, batch=batch)

  # Jitted init and apply too: not one eager compile per op and shape.
  step, apply = jax.jit(step), jax.jit(optax.apply_updates)
  state, out = jax.jit(tx.init)(params), []
  for i, b in enumerate(batches):
    updates, state = step(params, state, b, i in poison)
    params = apply(params, updates)
    out.append((updates, state))
  return out


@pytest.mark.slow
@pytest.mark.xla_defaults
def test_kfac_is_the_chain_it_is_built_from(problem):
  """``kfac`` = ``skip_nonfinite(chain(scale_by_kfac, add_decayed_weights,
  trace, scale_by_learning_rate))``: bitwise the same updates and states,
  a skipped step included."""
  params, batches, c = problem
  lr = optax.linear_schedule(0.1, 0.05, 4)
  kw = dict(damping=1e-2, inverse_update_period=2, norm_constraint=1e-2,
            inverse_update_warmup=3)
  fused = kl.kfac(lr, c, momentum=0.8, weight_decay=1e-3, **kw)
  chain = kl.skip_nonfinite(optax.chain(
      kl.scale_by_kfac(c, learning_rate=lr, **kw),
      optax.add_decayed_weights(1e-3), optax.trace(decay=0.8),
      optax.scale_by_learning_rate(lr)))
  got = _steps((fused, c), params, batches * 2, poison=(2,))
  want = _steps((chain, c), params, batches * 2, poison=(2,))
  assert int(got[-1][1].num_skipped) == 1
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_last_finite_survives_chain_and_inject_hyperparams(problem):
  """The step's finiteness is state (``last_finite``), so a
  ``skip_nonfinite`` outside a chain, or an ``inject_hyperparams`` around
  ``scale_by_kfac`` or ``kfac``, still sees it."""
  params, batches, c = problem
  inner = optax.inject_hyperparams(
      kl.scale_by_kfac, static_args=("collection", "power"))(c, damping=1e-2)
  wrapped = kl.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0),
                                          inner, optax.sgd(0.1)))
  injected = optax.inject_hyperparams(kl.kfac, static_args=("collection",))(
      learning_rate=0.1, collection=c, damping=1e-2)
  for tx, outer in ((wrapped, lambda s: s),
                    (injected, lambda s: s.inner_state)):
    out = _steps((tx, c), params, batches[:3], poison=(1,))
    flags = [bool(outer(s).last_finite) for _, s in out]
    assert flags == [True, False, True]
    assert [int(outer(s).num_skipped) for _, s in out] == [0, 1, 1]
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(out[1][0]))
    curvature = [x for x in jax.tree.leaves(
        out[1][1], is_leaf=lambda x: isinstance(x, kl.CurvatureState))
                 if isinstance(x, kl.CurvatureState)]
    assert len(curvature) == 1 and not bool(curvature[0].last_finite)
    assert int(curvature[0].count) == 1


@pytest.mark.slow
def test_estimator_escape_hatch(problem):
  """Options left out of the factories' arguments are set on the estimator
  (``estimator=``): the same results as through the arguments that remain,
  and options only the estimator has (``exps`` for ``power=-0.5``)."""
  params, batches, c = problem
  for a, b in ((kl.kfac(0.1, c, estimation_mode="empirical"),
                kl.kfac(0.1, c, estimator=kl.FisherEstimator(
                    c, estimation_mode="empirical"))),
               (kl.kfac_optimizer(c, estimation_mode="empirical"),
                kl.kfac_optimizer(c, estimator=kl.FisherEstimator(
                    c, estimation_mode="empirical", stats_fraction=0.25)))):
    got = _steps((a, c), params, batches[:2])
    want = _steps((b, c), params, batches[:2])
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(x, y)
  est = kl.FisherEstimator(c, exps=(-1, -0.5))
  half = _steps((kl.scale_by_kfac(c, power=-0.5, estimator=est), c),
                params, batches[:1])[0]
  direct = jax.jit(lambda s, p, b: est.multiply_matpower(s, jax.grad(
      helpers.classifier_loss)(p, b), -0.5))(half[1].estimator, params,
                                            batches[0])
  helpers.assert_trees_close(half[0], direct, rtol=1e-6)
