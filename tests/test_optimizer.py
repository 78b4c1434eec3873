"""kfac_optimizer: quadratic model, LM damping, optax and flax citizenship."""

import flax.linen as nn
from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import optimizer as opt_lib
from tests import helpers
from tests import problems


def _least_squares(n=50):
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k[0], (n, 4))
  t = x @ jax.random.normal(k[1], (4, 3)) + 0.3 * jax.random.normal(
      k[2], (n, 3)) + 1.0
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}

  def loss_fn(p, batch):
    x, t = batch
    y = kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])
    kl.register_normal_predictive_distribution(y, t)
    return jnp.mean(jnp.sum((y - t) ** 2, -1))

  return params, (x, t), loss_fn


@pytest.mark.parametrize("adapt", [True, False])
def test_one_step_solves_linear_least_squares(adapt):
  with jax.enable_x64(True):
    params, batch, loss_fn = _least_squares()
    params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    batch = jax.tree.map(lambda a: a.astype(jnp.float64), batch)
    c = kl.scan(loss_fn, params, batch)
    tx = kl.kfac_optimizer(c, initial_damping=1e-16, min_damping=0.0,
                           estimation_mode="exact",
                           adapt_learning_rate=adapt, adapt_momentum=adapt,
                           learning_rate=1.0, momentum=0.0)
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = jax.jit(lambda g, p, b: tx.update(
        g, tx.init(p), p, batch=b))(grads, params, batch)
    new = optax.apply_updates(params, updates)
    x1 = np.concatenate([batch[0], np.ones((len(batch[0]), 1))], 1)
    sol = np.linalg.lstsq(x1, batch[1], rcond=None)[0]
    np.testing.assert_allclose(
        np.concatenate([new["w"], new["b"][None]]), sol, rtol=1e-6,
        atol=1e-6)
    np.testing.assert_allclose(state.learning_rate, 1.0, rtol=1e-6)
    assert float(state.momentum) == 0.0


@pytest.mark.parametrize("rho,want", [
    (0.9, 2.0 * 0.5), (0.8, 2.0 * 0.5), (0.5, 2.0), (0.2, 2.0 / 0.5),
    (-1.0, 2.0 / 0.5), (np.nan, 2.0 / 0.5), (np.inf, 2.0 / 0.5)])
def test_lm_rule(rho, want):
  got = opt_lib.lm_damping_update(jnp.asarray(2.0), jnp.asarray(rho),
                                  decay=0.5, min_damping=1e-3)
  np.testing.assert_allclose(got, want)
  floor = opt_lib.lm_damping_update(jnp.asarray(2e-3), jnp.asarray(0.9),
                                    decay=0.5, min_damping=1.5e-3)
  np.testing.assert_allclose(floor, 1.5e-3)


def _mlp_problem():
  p = problems.mlp_classifier((4, 5, 3), 8, 12)
  return p.params, p.batches, p.scan()


def test_quadratic_model_matches_explicit_solve_with_dense_fisher():
  with jax.enable_x64(True):
    params, batches, c = _mlp_problem()
    params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    batches = [(x.astype(jnp.float64), y) for x, y in batches]
    tx = kl.kfac_optimizer(c, initial_damping=0.1, estimation_mode="exact",
                           adapt_damping=False, inverse_update_period=1)
    # Jitted programs throughout, not hundreds of eager op-by-op compiles.
    state = jax.jit(tx.init)(params)
    step = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))
    grad = jax.jit(jax.grad(helpers.classifier_loss))
    apply = jax.jit(optax.apply_updates)
    for batch in batches[:2]:
      prev = state.velocity
      grads = grad(params, batch)
      updates, state = step(grads, state, params, batch)
      params_before = params
      params = apply(params, updates)
    # Rebuild Δ from the state's (just refreshed) preconditioner.
    est = kl.FisherEstimator(c, estimation_mode="exact")
    flat = lambda t: jax.flatten_util.ravel_pytree(t)[0]  # noqa: E731
    _, unravel = jax.flatten_util.ravel_pytree(params_before)
    x, y = batch

    @jax.jit
    def reference(estimator_state, grads, params_before, prev, x):
      delta = jax.tree.map(lambda d: -d, est.multiply_inverse(
          estimator_state, grads))

      def logits(f):
        out, _ = helpers.mlp_forward(unravel(f), x, tag=False)
        return out

      jac = jax.jacobian(logits)(flat(params_before))        # [B, K, P]
      p = jax.nn.softmax(logits(flat(params_before)))
      f_r = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(p)
      fisher = jnp.einsum("bkp,bkl,blq->pq", jac, f_r, jac) / x.shape[0]
      u = jnp.stack([flat(delta), flat(prev)], 1)
      m = u.T @ (fisher + 0.1 * jnp.eye(fisher.shape[0])) @ u
      cvec = u.T @ flat(grads)
      return u, m, cvec
    u, m, cvec = reference(state.curvature.estimator, grads, params_before,
                           prev, x)
    alpha, mu = -np.linalg.solve(m, cvec)
    assert abs(float(mu)) > 1e-6  # second step: momentum is in play
    np.testing.assert_allclose(state.learning_rate, alpha, rtol=1e-8)
    np.testing.assert_allclose(state.momentum, mu, rtol=1e-8)
    np.testing.assert_allclose(flat(updates), u @ np.array([alpha, mu]),
                               rtol=1e-8, atol=1e-12)


@pytest.mark.slow
def test_damping_adapts_at_the_interval_and_one_program():
  params, batches, c = _mlp_problem()
  tx = kl.kfac_optimizer(c, initial_damping=1.0,
                         damping_adaptation_interval=3,
                         inverse_update_period=2)
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state, batch):
    traces.append(1)
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  structure = jax.tree.structure(state)
  dampings = []
  start = float(helpers.classifier_loss(params, batches[0]))
  for _ in range(9):
    params, state = step(params, state, batches[0])
    assert jax.tree.structure(state) == structure
    dampings.append(float(state.damping))
  assert len(traces) == 1 and step._cache_size() == 1
  omega = 0.95 ** 3
  for i, d in enumerate(dampings):
    before = 1.0 if i == 0 else dampings[i - 1]
    if (i + 1) % 3:
      assert d == before
    else:
      assert any(np.isclose(d, before * f) for f in (1.0, omega, 1 / omega))
  assert int(state.curvature.num_inverse_updates) == 5  # steps 0,2,4,6,8
  assert int(state.curvature.num_cov_updates) == 9
  assert np.isfinite(float(state.rho))
  assert float(helpers.classifier_loss(params, batches[0])) < 0.7 * start


@pytest.mark.slow
def test_reduction_ratio_is_the_loss_at_the_applied_update():
  """ρ = (h(θ + u) − h(θ)) / q(u) with ``u`` the update this step returns
  (θ + u is shared with the caller's apply_updates; a skipped step's
  zeroed update leaves the damping as it was)."""
  params, batches, c = _mlp_problem()
  tx = kl.kfac_optimizer(c, initial_damping=1.0,
                         damping_adaptation_interval=1)
  step = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))
  state = tx.init(params)
  for batch in batches[:3]:
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    updates, state = step(grads, state, params, batch)
    new_params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(
        state.new_loss, helpers.classifier_loss(new_params, batch),
        rtol=1e-5)
    np.testing.assert_allclose(
        state.loss, helpers.classifier_loss(params, batch), rtol=1e-5)
    np.testing.assert_allclose(
        state.rho, (state.new_loss - state.loss) / state.qmodel_change,
        rtol=1e-5)
    assert float(state.new_loss) != float(state.loss)
    params = new_params
  bad = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), grads)
  before = state
  updates, state = step(bad, state, params, batches[3])
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  assert float(state.damping) == float(before.damping)
  assert float(state.rho) == float(before.rho)


@pytest.mark.perf
def test_damping_rule_reads_the_caller_s_new_parameters():
  """θ + u is formed outside the damping rule's conditional, as the
  caller's ``apply_updates`` forms it (one sum XLA shares), so no branch
  adds parameter-shaped arrays."""
  params, batches, c = _mlp_problem()
  tx = kl.kfac_optimizer(c, damping_adaptation_interval=2)
  state = tx.init(params)

  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  shapes = {x.shape for x in jax.tree.leaves(params)}
  closed = jax.make_jaxpr(step)(params, state, batches[0])
  conds = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
  assert conds  # the damping rule's (and the refresh's) conditionals
  assert sum(helpers.count_primitive(closed.jaxpr, p, within=("cond",),
                                     shapes=shapes)
             for p in ("add", "add_any")) == 0


def test_fixed_values_without_adaptation():
  params, batches, c = _mlp_problem()
  tx = kl.kfac_optimizer(c, adapt_damping=False, adapt_learning_rate=False,
                         adapt_momentum=False, learning_rate=0.05,
                         momentum=0.5, initial_damping=0.3)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))
  for batch in batches[:3]:
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    _, state = step(grads, state, params, batch)
  assert float(state.learning_rate) == pytest.approx(0.05)
  assert float(state.momentum) == pytest.approx(0.5)
  assert float(state.damping) == pytest.approx(0.3)


def test_inject_hyperparams_changes_behaviour():
  params, batches, c = _mlp_problem()
  # Unclipped, so the update is linear in the learning rate (kfac's
  # default KL clipping would bound it).
  tx = optax.inject_hyperparams(kl.kfac, static_args=("collection",))(
      learning_rate=0.1, collection=c, damping=1e-3, norm_constraint=None)
  state = tx.init(params)
  grads = jax.grad(helpers.classifier_loss)(params, batches[0])
  step = jax.jit(lambda s: tx.update(grads, s, params, batch=batches[0]))
  u1, _ = step(state)
  hp = state.hyperparams
  hp["learning_rate"] = jnp.full_like(hp["learning_rate"], 0.2)
  u2, _ = step(state)
  helpers.assert_trees_close(u2, jax.tree.map(lambda u: 2 * u, u1), 1e-6)
  hp["damping"] = jnp.full_like(hp["damping"], 10.0)
  u3, _ = step(state)
  assert optax.tree.norm(u3) < 0.5 * optax.tree.norm(u2)
  assert step._cache_size() == 1


def test_multisteps_accumulates_then_steps():
  params, batches, c = _mlp_problem()
  tx = optax.MultiSteps(kl.kfac(0.1, c), every_k_schedule=4)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))
  for i, batch in enumerate(batches[:8]):
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    updates, state = step(grads, state, params, batch)
    norm = float(optax.tree.norm(updates))
    assert (norm > 0) == ((i + 1) % 4 == 0)
    params = optax.apply_updates(params, updates)
  # The inner K-FAC ran twice.
  assert int(state.inner_opt_state.inner[0].count) == 2


def test_unknown_extra_args_do_not_retrace():
  params, batches, c = _mlp_problem()
  tx = kl.kfac_optimizer(c)
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch, step_no):
    grads = jax.grad(helpers.classifier_loss)(params, batch)
    return tx.update(grads, state, params, batch=batch, step_no=step_no)

  for i, batch in enumerate(batches[:3]):
    _, state = step(params, state, batch, i)
  assert step._cache_size() == 1


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 6, rngs=rngs)
    self.l2 = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    h = kl.register_dense(self.l1(x), x, self.l1.kernel[...],
                          self.l1.bias[...])
    h = jnp.tanh(h)
    return kl.register_dense(self.l2(h), h, self.l2.kernel[...],
                             self.l2.bias[...])


def test_nnx_optimizer_update_with_batch():
  if not hasattr(nnx, "as_pure"):
    pytest.skip("nnx.as_pure needs flax >= 0.12.7 (which needs jax >= 0.10); "
                "this flax is older.")
  model = NnxMLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 8, 4, 3)

  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch[0])
    kl.register_categorical_predictive_distribution(logits, batch[1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]))

  c = kl.scan(loss_fn, nnx.as_pure(params), batch)
  assert [l.kind for l in c.layers] == ["fully_connected"] * 2
  optimizer = nnx.Optimizer(model, kl.kfac(0.1, c), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    grads = nnx.grad(lambda m: loss_fn(nnx.state(m, nnx.Param), batch))(
        model)
    optimizer.update(model, grads, batch=batch)

  before = float(loss_fn(nnx.state(model, nnx.Param), batch))
  for _ in range(5):
    train_step(model, optimizer, batch)
  after = float(loss_fn(nnx.state(model, nnx.Param), batch))
  assert after < before


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    d1 = nn.Dense(6)
    h = d1(x)
    p = d1.variables["params"]
    h = jnp.tanh(kl.register_dense(h, x, p["kernel"], p["bias"]))
    d2 = nn.Dense(3)
    out = d2(h)
    p = d2.variables["params"]
    return kl.register_dense(out, h, p["kernel"], p["bias"])


def test_linen_train_state_loop():
  model = LinenMLP()
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 8, 4, 3)
  params = model.init(jax.random.PRNGKey(0), batch[0])["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch[0])
    kl.register_categorical_predictive_distribution(logits, batch[1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]))

  c = kl.scan(loss_fn, params, batch)
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=kl.kfac_optimizer(c, initial_damping=1.0))

  @jax.jit
  def train_step(state, batch):
    grads = jax.grad(loss_fn)(state.params, batch)
    # apply_gradients does not forward extra args: call tx.update directly.
    updates, opt_state = state.tx.update(grads, state.opt_state,
                                         state.params, batch=batch)
    return state.replace(step=state.step + 1,
                         params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state)

  before = float(loss_fn(state.params, batch))
  for _ in range(5):
    state = train_step(state, batch)
  assert float(loss_fn(state.params, batch)) < before


def test_optimizer_requires_batch():
  params, batches, c = _mlp_problem()
  tx = kl.kfac_optimizer(c)
  with pytest.raises(ValueError, match="batch="):
    tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("kwargs,match", [
    ({"damping_adaptation_decay": 1.0}, "damping_adaptation_decay=1.0"),
    ({"damping_adaptation_interval": 0}, "damping_adaptation_interval=0"),
    ({"initial_damping": -1.0}, "initial_damping=-1.0"),
    ({"l2_reg": -0.1}, "l2_reg=-0.1"),
])
def test_bad_optimizer_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    kl.kfac_optimizer(_mlp_problem()[2], **kwargs)
