"""Kronecker factors and products against explicit per-example computations."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers
from tests import problems


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _mlp_problem():
  p = problems.mlp_classifier((5, 4, 3), 7, first_batch_seed=1,
                              dtype=jnp.float64)
  return p.params, p.batch


def _explicit_mlp_factors(params, batch):
  """A_l = mean ā ā^T and G_l = mean g g^T with g = ∂ℓ_b/∂s_b (per example)."""
  x, y = batch
  _, trace = jax.jit(lambda p, x: helpers.mlp_forward(p, x, tag=False))(
      params, x)

  def single(eps, xb, yb):
    h = xb
    for i in range(len(params)):
      p = params[f"layer{i}"]
      s = h @ p["w"] + p["b"] + eps[i]
      h = jnp.tanh(s) if i < len(params) - 1 else s
    return optax.softmax_cross_entropy_with_integer_labels(h, yb)

  eps0 = [jnp.zeros(p["w"].shape[1]) for p in params.values()]
  g = jax.jit(jax.vmap(lambda xb, yb: jax.grad(single)(eps0, xb, yb)))(x, y)
  out = []
  for i, (inp, _) in enumerate(trace):
    abar = helpers.with_bias_column(np.asarray(inp))
    out.append((abar.T @ abar / len(x), np.asarray(g[i]).T @ np.asarray(g[i])
                / len(x)))
  return out


def test_empirical_factors_equal_explicit():
  params, batch = _mlp_problem()
  c = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(c, estimation_mode="empirical")
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, batch)
  for s, (a, g) in zip(state.blocks, _explicit_mlp_factors(params, batch)):
    np.testing.assert_allclose(s.a, a, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(s.g, g, rtol=1e-10, atol=1e-12)


def _regression_loss(params, batch):
  x, t = batch
  out, _ = helpers.mlp_forward(params, x)
  kl.register_normal_predictive_distribution(out, t)
  return jnp.mean(jnp.sum((out - t) ** 2, axis=-1))


def test_multiply_and_inverse_equal_kronecker_products():
  # A Gaussian output keeps every G full rank (a softmax G is singular), so
  # the undamped (λ = 0) inverse exists.
  params = helpers.mlp_params(jax.random.PRNGKey(0), [5, 4, 3])
  x = jax.random.normal(jax.random.PRNGKey(1), (40, 5))
  batch = (x, jax.random.normal(jax.random.PRNGKey(2), (40, 3)))
  c = kl.scan(_regression_loss, params, batch)
  est = kl.FisherEstimator(c, estimation_mode="empirical", damping=0.0)
  state = jax.jit(lambda p, b: est.update_cache(est.update_curvature(
      est.init(p), p, b), damping=0.0))(params, batch)
  v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)
                                     ).reshape(a.shape), params)
  mv, iv = jax.jit(lambda s, v: (est.multiply(s, v), est.multiply_inverse(
      s, v)))(state, v)
  for i, s in enumerate(state.blocks):
    vm = np.concatenate([v[f"layer{i}"]["w"], v[f"layer{i}"]["b"][None]])
    want = np.asarray(s.a) @ vm @ np.asarray(s.g)
    got = np.concatenate([mv[f"layer{i}"]["w"], mv[f"layer{i}"]["b"][None]])
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    want = np.linalg.solve(s.a, vm) @ np.linalg.inv(s.g)
    got = np.concatenate([iv[f"layer{i}"]["w"], iv[f"layer{i}"]["b"][None]])
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)


def test_full_fisher_is_block_kron_in_ravel_order():
  params, batch = _mlp_problem()
  c = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(c, estimation_mode="empirical")
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, batch)
  f = np.asarray(jax.jit(est.full_fisher)(state))
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  v = jnp.sin(jnp.arange(flat.size, dtype=flat.dtype))
  # Undamped product through the blocks equals the dense matrix's product.
  mv = jax.jit(lambda s, v: jax.flatten_util.ravel_pytree(est.multiply(
      est.update_cache(s, damping=0.0), unravel(v)))[0])(state, v)
  np.testing.assert_allclose(f @ np.asarray(v), mv, rtol=1e-9, atol=1e-12)


def test_zero_debiased_ema():
  params, batch = _mlp_problem()
  c = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(c, estimation_mode="empirical", cov_ema_decay=0.5)
  stats = [est.compute_stats(params, (batch[0] * k, batch[1]), None)
           for k in (1.0, 2.0)]
  s = est.update_curvature(est.init(params), stats=stats[0])
  np.testing.assert_allclose(s.blocks[0].a, stats[0].blocks[0]["a"])
  s = est.update_curvature(s, stats=stats[1])
  # (0.5 * 1 * x1 + x2) / (0.5 + 1)
  want = (0.5 * stats[0].blocks[0]["a"] + stats[1].blocks[0]["a"]) / 1.5
  np.testing.assert_allclose(s.blocks[0].a, want, rtol=1e-12)


def test_non_finite_statistics_leave_factors_untouched():
  params, batch = _mlp_problem()
  c = kl.scan(helpers.classifier_loss, params, batch)
  est = kl.FisherEstimator(c, estimation_mode="empirical")
  s1 = est.update_curvature(est.init(params), params, batch)
  bad = (batch[0].at[0, 0].set(jnp.nan), batch[1])
  s2 = est.update_curvature(s1, params, bad)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(a, b)


def test_rnn_factors_through_scan_equal_explicit():
  params, batch = problems.rnn_setup(t=4, b=3)
  params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
  batch = (batch[0].astype(jnp.float64), batch[1])
  c = kl.scan(problems.rnn_loss, params, batch)
  est = kl.FisherEstimator(c, estimation_mode="empirical")
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, batch)   # One program, not hundreds of eager compiles.
  xs, y = batch
  t_len, b_len = xs.shape[:2]
  hdim = params["cell"]["w"].shape[1]

  def single(eps, x_seq, yb):
    h = jnp.zeros(hdim)
    zs = []
    for t in range(t_len):
      z = jnp.concatenate([h, x_seq[t]])
      zs.append(z)
      h = jnp.tanh(z @ params["cell"]["w"] + params["cell"]["b"] + eps[t])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return (optax.softmax_cross_entropy_with_integer_labels(logits, yb),
            jnp.stack(zs))

  eps0 = jnp.zeros((t_len, hdim))
  per_ex = jax.jit(jax.vmap(lambda xb, yb: jax.grad(single, has_aux=True)(
      eps0, xb, yb), in_axes=(1, 0)))
  g, zs = per_ex(xs, y)                                  # [B, T, h], [B, T, d]
  abar = helpers.with_bias_column(np.asarray(zs).reshape(-1, zs.shape[-1]))
  g = np.asarray(g).reshape(-1, hdim)
  cell = c.layers.index(c.layer("['cell']"))
  n = t_len * b_len
  np.testing.assert_allclose(state.blocks[cell].a, abar.T @ abar / n,
                             rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(state.blocks[cell].g, g.T @ g / n, rtol=1e-10,
                             atol=1e-12)
  # The block is scaled by the number of uses (kron_indep, c = T).
  blk = est.blocks[cell]
  np.testing.assert_allclose(
      jax.jit(blk.full_fisher_block)(state.blocks[cell]),
      t_len * np.kron(abar.T @ abar / n, g.T @ g / n), rtol=1e-10, atol=1e-12)


def test_rnn_tag_in_cond_and_scan_gradient_matches():
  params, batch = problems.rnn_setup(t=3, b=2)
  c = kl.scan(problems.rnn_loss, params, batch)
  fn = kl.value_grad_and_stats(problems.rnn_loss, c)
  loss, grads, _ = jax.jit(fn)(params, batch, jax.random.PRNGKey(0))
  want_loss, want = jax.value_and_grad(problems.rnn_loss)(params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_tag_inside_cond_records_the_taken_branch():
  params = {"w": jnp.eye(3) + 0.1}

  def loss_fn(params, batch):
    x, flag = batch

    def branch_a(x):
      return kl.register_dense(x @ params["w"], x, params["w"])

    out = lax.cond(flag > 0, branch_a, lambda x: x * 2.0, x)
    kl.register_normal_predictive_distribution(out, jnp.zeros_like(out))
    return 0.5 * jnp.mean(jnp.sum(out ** 2, axis=-1))

  x = jnp.arange(6.0).reshape(2, 3) / 6
  c = kl.scan(loss_fn, params, (x, 1))
  est = kl.FisherEstimator(c, estimation_mode="empirical")
  s_on = est.update_curvature(est.init(params), params, (x, 1))
  s_off = est.update_curvature(est.init(params), params, (x, 0))
  np.testing.assert_allclose(s_on.blocks[0].a, x.T @ x / 2, rtol=1e-12)
  np.testing.assert_allclose(s_off.blocks[0].a, 0.0)
