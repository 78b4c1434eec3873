"""FisherEstimator: estimation modes against explicit Fisher blocks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers

SIZES = [4, 5, 4, 3]


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _register(kind, out, t, weight=1.0):
  if kind == "categorical":
    kl.register_categorical_predictive_distribution(out, t, weight=weight)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, t))
  if kind == "normal":
    kl.register_normal_predictive_distribution(out, t, var=0.5,
                                               weight=weight)
    return jnp.mean(jnp.sum((out - t) ** 2, axis=-1))
  kl.register_multi_bernoulli_predictive_distribution(out, t, weight=weight)
  return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(out, t), -1))


def _problem(kind, n=6, seed=0):
  params = helpers.mlp_params(jax.random.PRNGKey(seed), SIZES)
  kx, kt = jax.random.split(jax.random.PRNGKey(seed + 1))
  x = jax.random.normal(kx, (n, SIZES[0]))
  if kind == "categorical":
    t = jax.random.randint(kt, (n,), 0, SIZES[-1])
  elif kind == "normal":
    t = jax.random.normal(kt, (n, SIZES[-1]))
  else:
    t = jax.random.bernoulli(kt, 0.5, (n, SIZES[-1])).astype(x.dtype)

  def loss_fn(params, batch):
    out, _ = helpers.mlp_forward(params, batch[0])
    return _register(kind, out, batch[1])

  return params, (x, t), loss_fn


def _f_r(kind, z):
  if kind == "categorical":
    p = jax.nn.softmax(z)
    return jnp.diag(p) - jnp.outer(p, p)
  if kind == "normal":
    return jnp.eye(z.shape[0]) / 0.5
  p = jax.nn.sigmoid(z)
  return jnp.diag(p * (1 - p))


def _explicit_exact(kind, params, x):
  """Per layer (A, G) with G = mean_b J_bᵀ F_R J_b, J_b = ∂z_b/∂s_b."""
  out = []
  for inp, g in zip(*_explicit_exact_parts(kind, params, x)):
    abar = helpers.with_bias_column(np.asarray(inp))
    out.append((abar.T @ abar / len(x), np.asarray(g)))
  return out


# Jitted, once per kind and shape: the three exact modes share the
# reference (eager, each of its primitives compiled apart).
@functools.partial(jax.jit, static_argnums=0)
def _explicit_exact_parts(kind, params, x):
  """Each layer's input and G = mean_b J_bᵀ F_R J_b."""
  n_layers = len(params)

  def from_layer(i, s, xb):
    h = s
    for j in range(i, n_layers):
      if j > i:
        p = params[f"layer{j}"]
        h = h @ p["w"] + p["b"]
      if j < n_layers - 1:
        h = jnp.tanh(h)
    return h

  _, trace = helpers.mlp_forward(params, x, tag=False)
  inputs, gs = [], []
  for i, (inp, s) in enumerate(trace):
    def g_b(sb, xb, i=i):
      jac = jax.jacobian(lambda v: from_layer(i, v, xb))(sb)
      z = from_layer(i, sb, xb)
      return jac.T @ _f_r(kind, z) @ jac
    inputs.append(inp)
    gs.append(jnp.mean(jax.vmap(g_b)(s, x), axis=0))
  return inputs, gs


@pytest.mark.parametrize("kind", ["categorical", "normal", "multi_bernoulli"])
@pytest.mark.parametrize("mode", ["exact", "exact_GGN", "fisher_exact"])
def test_exact_modes_equal_explicit_expectations(kind, mode):
  params, batch, loss_fn = _problem(kind)
  c = kl.scan(loss_fn, params, batch)
  est = kl.FisherEstimator(c, estimation_mode=mode)
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, batch)
  for s, (a, g) in zip(state.blocks, _explicit_exact(kind, params, batch[0])):
    np.testing.assert_allclose(s.a, a, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(s.g, g, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["categorical", "normal", "multi_bernoulli"])
def test_single_example_full_fisher_equals_jacobian_fisher(kind):
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (3, 4)),
            "b": jnp.arange(4.0) / 4}
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 3))
  t = (jnp.array([2]) if kind == "categorical" else
       jnp.ones((1, 4)) * 0.5)

  def model(params, x):
    return x @ params["w"] + params["b"]

  def loss_fn(params, batch):
    z = kl.register_dense(model(params, batch[0]), batch[0], params["w"],
                          params["b"])
    return _register(kind, z, batch[1])

  c = kl.scan(loss_fn, params, (x, t))
  est = kl.FisherEstimator(c, estimation_mode="exact")
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, (x, t))
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  jac = jax.jacobian(lambda f: model(unravel(f), x)[0])(flat)
  want = jac.T @ _f_r(kind, model(params, x)[0]) @ jac
  np.testing.assert_allclose(est.full_fisher(state), want, rtol=1e-10,
                             atol=1e-12)


# curvature_prop_GGN's mean is also checked, faster, by test_custom_losses.py's
# test_curvature_prop_ggn_averages_to_the_exact_ggn.
@pytest.mark.parametrize("mode", [
    "gradients", "curvature_prop",
    pytest.param("curvature_prop_GGN", marks=pytest.mark.slow)])
def test_sampled_modes_converge_to_exact(mode):
  params, batch, loss_fn = _problem("categorical", n=3)
  c = kl.scan(loss_fn, params, batch)
  exact = kl.FisherEstimator(c, estimation_mode="exact")
  ref = jax.jit(lambda p, b: exact.update_curvature(exact.init(p), p, b))(
      params, batch)
  errors = []
  for n in (16, 256, 4096):
    est = kl.FisherEstimator(c, estimation_mode=mode, num_samples=n)
    # Mean relative error over layers and 8 seeds: one draw is too noisy.
    update = jax.jit(lambda key, est=est: est.update_curvature(
        est.init(params), params, batch, key))
    errs = []
    for seed in range(8):
      st = update(jax.random.PRNGKey(1000 * n + seed))
      errs += [np.linalg.norm(s.g - r.g) / np.linalg.norm(r.g)
               for s, r in zip(st.blocks, ref.blocks)]
    errors.append(np.mean(errs))
  # Monte-Carlo error ~ 1/sqrt(n): each 16x step should shrink it ~4x.
  assert errors[1] < errors[0] / 2, errors
  assert errors[2] < errors[1] / 2, errors
  assert errors[2] < 0.05, errors


def test_empirical_params_stats_is_mean_gradient_and_weight_is_linear():
  params, batch, loss_fn = _problem("normal")
  c = kl.scan(loss_fn, params, batch)
  est = kl.FisherEstimator(c, estimation_mode="empirical",
                           compute_params_stats=True)
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, batch)
  # var=0.5, weight 1: the registered NLL is the loss itself.
  helpers.assert_trees_close(est.params_stats(state),
                             jax.grad(loss_fn)(params, batch), rtol=1e-10)

  def weighted(params, batch):
    out, _ = helpers.mlp_forward(params, batch[0])
    return _register("normal", out, batch[1], weight=3.0)

  cw = kl.scan(weighted, params, batch)
  for mode in ("empirical", "exact", "curvature_prop"):
    e1 = kl.FisherEstimator(c, estimation_mode=mode)
    e3 = kl.FisherEstimator(cw, estimation_mode=mode)
    key = jax.random.PRNGKey(3)
    s1, s3 = jax.jit(lambda key, e1=e1, e3=e3: (
        e1.update_curvature(e1.init(params), params, batch, key),
        e3.update_curvature(e3.init(params), params, batch, key)))(key)
    for b1, b3 in zip(s1.blocks, s3.blocks):
      helpers.assert_trees_close(b3.g, 3.0 * b1.g, rtol=1e-10)
      helpers.assert_trees_close(b3.a, b1.a, rtol=1e-12)


def test_two_loss_tags_sum_their_fishers():
  params, batch, _ = _problem("normal")
  x, t = batch

  def both(params, batch):
    out, _ = helpers.mlp_forward(params, batch[0])
    return (_register("normal", out, batch[1]) +
            _register("multi_bernoulli", out, (batch[1] > 0).astype(
                out.dtype)))

  def only(kind):
    def f(params, batch):
      out, _ = helpers.mlp_forward(params, batch[0])
      tt = batch[1] if kind == "normal" else (batch[1] > 0).astype(out.dtype)
      return _register(kind, out, tt)
    return f

  states = []
  for fn in (both, only("normal"), only("multi_bernoulli")):
    c = kl.scan(fn, params, (x, t))
    est = kl.FisherEstimator(c, estimation_mode="exact")
    states.append(jax.jit(lambda p, b, est=est: est.update_curvature(
        est.init(p), p, b))(params, (x, t)))
  for s, s1, s2 in zip(*[st.blocks for st in states]):
    np.testing.assert_allclose(s.g, s1.g + s2.g, rtol=1e-10)


def test_empirical_without_targets_raises():
  params = {"w": jnp.ones((3, 2))}

  def loss_fn(params, x):
    z = kl.register_dense(x @ params["w"], x, params["w"])
    kl.register_categorical_predictive_distribution(z)
    return jnp.mean(jax.nn.logsumexp(z, axis=-1))

  c = kl.scan(loss_fn, params, jnp.ones((2, 3)))
  est = kl.FisherEstimator(c, estimation_mode="empirical")
  with pytest.raises(ValueError, match="empirical.*needs data targets"):
    est.update_curvature(est.init(params), params, jnp.ones((2, 3)))


def test_unregistered_exponent_raises_naming_exps():
  params, batch, loss_fn = _problem("normal")
  c = kl.scan(loss_fn, params, batch)
  est = kl.FisherEstimator(c, exps=(-1, -0.5))
  state = jax.jit(lambda p, b, k: est.update_cache(est.update_curvature(
      est.init(p), p, b, k)))(params, batch, jax.random.PRNGKey(0))
  jax.jit(lambda s, v: est.multiply_matpower(s, v, -0.5))(state, params)
  with pytest.raises(ValueError, match=r"exps=\[-1, -0.5\]"):
    jax.jit(lambda s, v: est.multiply_matpower(s, v, 2))(state, params)


def test_matrix_powers_and_cholesky_compose():
  params, batch, loss_fn = _problem("normal")
  c = kl.scan(loss_fn, params, batch)
  est = kl.FisherEstimator(c, exps=(-1, 0.5, -0.5), compute_cholesky=True,
                           compute_cholesky_inverse=True, damping=1e-2,
                           estimation_mode="exact")
  state = jax.jit(lambda p, b: est.update_cache(est.update_curvature(
      est.init(p), p, b)))(params, batch)
  v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype) + 1
                                     ).reshape(a.shape), params)

  @jax.jit
  def products(state, v):
    return (est.multiply(state, v),
            est.multiply_matpower(state, est.multiply_matpower(state, v, 0.5),
                                  0.5),
            est.multiply(state, est.multiply_inverse(state, v)),
            est.multiply_cholesky(
                state, est.multiply_cholesky(state, v, transpose=True)),
            est.multiply_cholesky_inverse(
                state, est.multiply_cholesky(state, v)))
  fv, half_half, f_inv, chol_chol_t, chol_inv_chol = products(state, v)
  helpers.assert_trees_close(half_half, fv, rtol=1e-9)
  helpers.assert_trees_close(f_inv, v, rtol=1e-9)
  helpers.assert_trees_close(chol_chol_t, fv, rtol=1e-9)
  helpers.assert_trees_close(chol_inv_chol, v, rtol=1e-9)


def _count_forward_matmuls(jaxpr, lhs_shape, rhs_shape):
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and tuple(
        v.aval.shape for v in eqn.invars) == (lhs_shape, rhs_shape):
      count += 1
    for sub in helpers.sub_jaxprs(eqn):
      count += _count_forward_matmuls(sub, lhs_shape, rhs_shape)
  return count


def _dot_operand_ranks(jaxpr):
  ranks = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      ranks.update(v.aval.ndim for v in eqn.invars)
    for sub in helpers.sub_jaxprs(eqn):
      ranks |= _dot_operand_ranks(sub)
  return ranks


@pytest.mark.parametrize("num_samples", [1, 2])
def test_one_sample_backward_keeps_the_models_shapes(num_samples):
  """With one target draw the sampled backward pass is a plain VJP: a
  size-1 ``vmap`` would give every op of it a unit axis (rank-3 matmuls on
  this rank-2 MLP), which XLA's simplifier strips one layer per fixed-point
  iteration, so deep models compiled slowly. Two draws stay vmapped."""
  params, batch, loss_fn = _problem("categorical", n=7)
  c = kl.scan(loss_fn, params, batch)
  fn = kl.value_grad_and_stats(loss_fn, c, num_samples=num_samples)
  jaxpr = jax.make_jaxpr(fn)(params, batch, jax.random.PRNGKey(0)).jaxpr
  ranks = _dot_operand_ranks(jaxpr)
  if num_samples == 1:
    assert ranks == {2}
  else:
    assert 3 in ranks
  # The statistics are [S, ...]-stacked output gradients either way: one
  # draw's equal the two-draw estimator's first draw (same hashed key).
  est = kl.FisherEstimator(c, num_samples=num_samples)
  stats = jax.jit(fn)(params, batch, jax.random.PRNGKey(0))[2]
  helpers.assert_trees_close(
      stats, jax.jit(est.compute_stats)(params, batch,
                                        jax.random.PRNGKey(0)), rtol=1e-12)


@pytest.mark.perf
def test_value_grad_and_stats_runs_the_forward_pass_once():
  params, batch, loss_fn = _problem("categorical", n=7)
  c = kl.scan(loss_fn, params, batch)
  tx = kl.kfac(0.1, c)
  state = tx.init(params)
  fn = kl.value_grad_and_stats(loss_fn, c)

  def one_pass(params, state, batch, key):
    _, grads, stats = fn(params, batch, key)
    return tx.update(grads, state, params, stats=stats)

  def naive(params, state, batch, key):
    del key
    grads = jax.grad(loss_fn)(params, batch)
    return tx.update(grads, state, params, batch=batch)

  key = jax.random.PRNGKey(0)
  shapes = ((7, SIZES[0]), (SIZES[0], SIZES[1]))
  j1 = jax.make_jaxpr(one_pass)(params, state, batch, key).jaxpr
  j2 = jax.make_jaxpr(naive)(params, state, batch, key).jaxpr
  assert _count_forward_matmuls(j1, *shapes) == 1
  assert _count_forward_matmuls(j2, *shapes) == 2

  # Same gradient as jax.grad, same statistics as the separate path.
  loss, grads, stats = jax.jit(fn)(params, batch, key)
  np.testing.assert_allclose(loss, loss_fn(params, batch), rtol=1e-12)
  helpers.assert_trees_close(grads, jax.grad(loss_fn)(params, batch),
                             rtol=1e-12)
  est = kl.FisherEstimator(c)
  helpers.assert_trees_close(
      stats, jax.jit(est.compute_stats)(params, batch, key), rtol=1e-12)


def test_gradient_and_statistics_linearise_without_a_jvp(monkeypatch):
  """``value_grad_and_stats`` builds its linearisation with ``jax.vjp``:
  ``jax.linearize`` would hand back a JVP function that its transpose
  re-traces (one more pass over the model per trace). A JVP asked of such
  a linearisation is its pullback transposed, equal to the linearised
  one."""
  params, batch, loss_fn = _problem("categorical", n=7)
  c = kl.scan(loss_fn, params, batch)
  est = kl.FisherEstimator(c)
  key = jax.random.PRNGKey(0)
  want = jax.jit(kl.value_grad_and_stats(loss_fn, c))(params, batch, key)
  u = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)

  def jvp_and_gradient(p, b, u, **kw):
    lin = est.linearize(p, b, **kw)
    return lin.output_jvp(u), lin.gradient()

  # Jitted, each traced where it is called: before and after the patch.
  jv_want, grad_want = jax.jit(lambda p, b, u: jvp_and_gradient(
      p, b, u, with_jvp=True))(params, batch, u)

  def no_linearize(*args, **kwargs):
    raise AssertionError("jax.linearize called")

  monkeypatch.setattr(jax, "linearize", no_linearize)
  got = jax.jit(kl.value_grad_and_stats(loss_fn, c))(params, batch, key)
  helpers.assert_trees_close(got, want, rtol=1e-12)
  jv, grad = jax.jit(jvp_and_gradient)(params, batch, u)
  helpers.assert_trees_close(jv, jv_want, rtol=1e-12)
  helpers.assert_trees_close(grad, grad_want, rtol=1e-12)
