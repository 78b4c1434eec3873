"""register_loss_function: a user's per-position loss and its GGN.

Every curvature is checked against an explicit ``Jᵀ H J`` of the user's
scalar mean loss (``H`` from ``jax.hessian`` through the model outputs),
for a Poisson, a Huber and a label-smoothed cross-entropy loss, with and
without a padding mask.
"""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from tests import problems
from kfac_jax_lite import custom_losses
from kfac_jax_lite import linearization

B, T, D, H, E = problems.SEQUENCE_SHAPE
LOSSES = ("poisson", "huber", "smoothed_ce")


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def poisson(z, y):
  """Poisson NLL with log-rates ``z`` (up to ``log y!``)."""
  return jnp.sum(jnp.exp(z) - y * z)


def huber(z, y):
  return jnp.sum(optax.huber_loss(z, y, delta=0.5))


def smoothed_ce(z, y):
  """Cross-entropy against one-hot ``y`` smoothed by 0.1."""
  target = optax.smooth_labels(jax.nn.one_hot(y, z.shape[-1]), 0.1)
  return -jnp.sum(target * jax.nn.log_softmax(z))


FNS = {"poisson": poisson, "huber": huber, "smoothed_ce": smoothed_ce}


_params = problems.sequence_params
_model = problems.sequence_model


def _batch(name, seed=1):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (B, T, D))
  if name == "smoothed_ce":
    y = jax.random.randint(ky, (B, T), 0, E)
  elif name == "poisson":
    y = jax.random.poisson(ky, 1.5, (B, T, E)).astype(x.dtype)
  else:
    y = jax.random.normal(ky, (B, T, E))
  lengths = jnp.array([T, 2, 3])
  mask = (jnp.arange(T)[None, :] < lengths[:, None]).astype(x.dtype)
  return {"x": x, "y": y, "mask": mask}


def _user_loss(name, z, batch, masked):
  """What a user writes: the mean over (unmasked) positions."""
  per = jax.vmap(jax.vmap(FNS[name]))(z, batch["y"])
  if not masked:
    return jnp.mean(per)
  return jnp.sum(per * batch["mask"]) / jnp.sum(batch["mask"])


def _loss_fn(name, masked, sampler=None, flat=False):
  """The user's loss with the tag on ``[B, T, E]`` or, with ``flat``, on
  its ``[B·T, E]`` flattening (targets and mask flattened alike)."""
  def loss_fn(params, batch):
    z = _model(params, batch["x"])
    y, mask = batch["y"], batch["mask"] if masked else None
    if flat:
      kl.register_loss_function(
          z.reshape(B * T, E), y.reshape((B * T,) + y.shape[2:]),
          loss_fn=FNS[name], sampler=sampler,
          mask=None if mask is None else mask.reshape(-1))
    else:
      z = kl.register_loss_function(z, y, loss_fn=FNS[name],
                                    sampler=sampler, mask=mask)
    return _user_loss(name, z, batch, masked)
  return loss_fn


def _explicit_ggn(loss_of_z, params, batch):
  """``Jᵀ H J`` in ``ravel_pytree(params)`` order, ``H = ∇²_z loss``."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  z_of = lambda p: _model(unravel(p), batch["x"]).reshape(-1)  # noqa: E731
  jac = jax.jit(jax.jacobian(z_of))(flat)
  hess = jax.jit(jax.hessian(lambda zz: loss_of_z(zz.reshape(B, T, E))))(
      z_of(flat))
  return jac.T @ hess @ jac


def _block_diagonal(m, params):
  sizes = [sum(x.size for x in jax.tree.leaves(params[k]))
           for k in sorted(params)]
  owner = np.repeat(np.arange(len(sizes)), sizes)
  return np.where(owner[:, None] == owner[None, :], m, 0.0)


def _full_fisher(loss_fn, params, batch, mode="exact_GGN", **kw):
  collection = kl.scan(loss_fn, params, batch, approximations={
      "fully_connected_multi": "full"})
  est = kl.FisherEstimator(collection, estimation_mode=mode, **kw)
  return np.asarray(jax.jit(lambda p, b: est.full_fisher(est.update_curvature(
      est.init(p), p, b, jax.random.PRNGKey(5))))(params, batch))


@pytest.mark.parametrize(
    "masked", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", LOSSES)
def test_exact_ggn_is_that_of_the_users_mean_loss(name, masked):
  params, batch = _params(), _batch(name)
  want = _block_diagonal(_explicit_ggn(
      lambda z: _user_loss(name, z, batch, masked), params, batch), params)
  got = _full_fisher(_loss_fn(name, masked), params, batch)
  np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
  assert np.abs(want).max() > 1e-2
  flat = _full_fisher(_loss_fn(name, masked, flat=True), params, batch)
  np.testing.assert_allclose(flat, want, rtol=1e-9, atol=1e-12)


# Every loss's factor also enters test_exact_ggn_is_that_of_the_users_mean_loss
# (default tier); the squares of the other two are checked in the slow tier.
@pytest.mark.parametrize("name", [
    n if n == "smoothed_ce" else pytest.param(n, marks=pytest.mark.slow)
    for n in LOSSES])
def test_ggn_factor_squares_to_the_per_position_hessian(name):
  """``B Bᵀ = H_n`` per position: the factor of ``curvature_prop_GGN``."""
  batch = _batch(name)
  z = _model(_params(), batch["x"])
  spec = custom_losses.CustomLossSpec(loss_fn=FNS[name], has_targets=True,
                                      shape=z.shape)

  @jax.jit
  def factor_hessian_and_hv(z, y):
    cols = jax.vmap(lambda e: spec.ggn_factor(
        z, jnp.broadcast_to(e, z.shape), y))(jnp.eye(E))   # [E, B, T, E]
    hess = jax.vmap(jax.vmap(jax.hessian(FNS[name])))(z, y)
    return cols, hess, spec.multiply_ggn(z, jnp.cos(z), y)

  cols, hess, hv = factor_hessian_and_hv(z, batch["y"])
  np.testing.assert_allclose(jnp.einsum("kbti,kbtj->btij", cols, cols),
                             hess, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(
      hv, jnp.einsum("btij,btj->bti", hess, jnp.cos(z)), rtol=1e-12)


def test_curvature_prop_ggn_averages_to_the_exact_ggn():
  name, params, batch = "poisson", _params(), _batch("poisson")
  want = _full_fisher(_loss_fn(name, True), params, batch)
  got = _full_fisher(_loss_fn(name, True), params, batch,
                     mode="curvature_prop_GGN", num_samples=3000)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < 0.05, err


@pytest.mark.parametrize("masked", [False, True])
def test_quadratic_model_gram_is_the_users_ggn(masked):
  name, params, batch = "smoothed_ce", _params(), _batch("smoothed_ce")
  want = _explicit_ggn(lambda z: _user_loss(name, z, batch, masked), params,
                       batch)
  est = kl.FisherEstimator(kl.scan(_loss_fn(name, masked), params, batch))
  vs = [jax.tree.map(lambda x, i=i: jnp.sin((i + 1.0) * x + i), params)
        for i in range(2)]

  def gram(p, b):
    lin = est.linearize(p, b, with_jvp=True)
    jvs = jax.tree.map(lambda *x: jnp.stack(x),
                       *[lin.output_jvp(v) for v in vs])
    return linearization.output_fisher_gram(lin, jvs)
  flat_vs = jnp.stack([jax.flatten_util.ravel_pytree(v)[0] for v in vs])
  np.testing.assert_allclose(jax.jit(gram)(params, batch),
                             flat_vs @ want @ flat_vs.T, rtol=1e-9)


def test_empirical_uses_each_examples_summed_position_gradients():
  name, params, batch = "huber", _params(), _batch("huber")
  got = _full_fisher(_loss_fn(name, True), params, batch, mode="empirical")

  def example_sum(p, xb, yb, mb):
    z = _model(p, xb[None])[0]
    return jnp.sum(jax.vmap(huber)(z, yb) * mb)
  per_example = jax.vmap(jax.grad(example_sum), (None, 0, 0, 0))(
      params, batch["x"], batch["y"], batch["mask"])
  flat = jax.vmap(lambda g: jax.flatten_util.ravel_pytree(g)[0])(
      per_example)
  want = flat.T @ flat / jnp.sum(batch["mask"])
  np.testing.assert_allclose(got, _block_diagonal(want, params), rtol=1e-9,
                             atol=1e-12)


def _rounded_rate(key, z):
  del key
  return jnp.round(jnp.exp(z))


def test_gradients_mode_draws_targets_with_the_sampler():
  """With a sampler, ``gradients`` is the empirical Fisher at the drawn
  targets (here a deterministic sampler, so the two are equal)."""
  params, batch = _params(), _batch("poisson")
  drawn = dict(batch, y=jnp.round(jnp.exp(_model(params, batch["x"]))))
  got = _full_fisher(_loss_fn("poisson", True, _rounded_rate), params,
                     batch, mode="gradients")
  want = _full_fisher(_loss_fn("poisson", True), params, drawn,
                      mode="empirical")
  np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def _poisson_draw(key, z):
  return jax.random.poisson(key, jnp.exp(z)).astype(z.dtype)


@pytest.mark.slow
def test_sampled_poisson_fisher_converges_to_the_ggn():
  """Poisson in its natural parameter: Fisher = GGN = ``diag(exp z)``."""
  params, batch = _params(), _batch("poisson")
  want = _full_fisher(_loss_fn("poisson", False), params, batch)
  got = _full_fisher(_loss_fn("poisson", False, _poisson_draw), params,
                     batch, mode="gradients", num_samples=3000)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < 0.05, err


@pytest.mark.parametrize("mode", ["gradients", "exact", "curvature_prop"])
def test_fisher_modes_without_a_distribution_raise(mode):
  params, batch = _params(), _batch("huber")
  with pytest.raises(ValueError, match=f"estimation_mode='{mode}'.*"
                     "register_loss_function"):
    _full_fisher(_loss_fn("huber", False), params, batch, mode=mode)


def test_one_dimensional_z_is_positions_of_one_output():
  """``z: [N]``: ``loss_fn`` gets scalars; exact GGN as explicit."""
  params, batch = _params(), _batch("poisson")
  y = batch["y"][..., 0].reshape(-1)

  def loss_fn(p, b):
    z = _model(p, b["x"])[..., 0].reshape(-1)
    z = kl.register_loss_function(z, y, loss_fn=poisson)
    return jnp.mean(jnp.exp(z) - y * z)
  want = _block_diagonal(_explicit_ggn(
      lambda z: jnp.mean(jnp.exp(z[..., 0].reshape(-1)) - y * z[..., 0]
                         .reshape(-1)), params, batch), params)
  np.testing.assert_allclose(_full_fisher(loss_fn, params, batch), want,
                             rtol=1e-9, atol=1e-12)


def test_tag_checks_name_the_argument():
  z, y = jnp.zeros((4, 3)), jnp.zeros((4, 3))
  with pytest.raises(ValueError, match="must return a scalar"):
    kl.register_loss_function(z, y, loss_fn=lambda a, b: a - b)
  with pytest.raises(ValueError, match="targets have shape"):
    kl.register_loss_function(z, jnp.zeros((5,)), loss_fn=huber)
  with pytest.raises(TypeError, match="loss_fn=3 must be a function"):
    kl.register_loss_function(z, y, loss_fn=3)

  def leaky(p, x):
    scale = p["s"]
    return kl.register_loss_function(
        x, None, loss_fn=lambda a, b: jnp.sum(scale * a ** 2))
  with pytest.raises(TypeError, match="closes over a traced array"):
    kl.scan(lambda p, x: jnp.sum(leaky(p, x)), {"s": jnp.ones(())}, z)
  assert kl.register_loss_function(z, y, loss_fn=huber) is z
