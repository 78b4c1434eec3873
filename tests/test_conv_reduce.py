"""KFC-reduce (``kron_reduce`` for convolutions).

The patch sums against the materialised patches of
``lax.conv_general_dilated_patches``; the factors against their explicit
formula; and, for a conv layer whose outputs are summed over locations
before a squared error (the reduce setting of Eschenhagen et al. 2023),
``A ⊗ G`` against the explicit GGN block ``Jᵀ H J`` and the preconditioned
gradient against a dense solve; with a squared error at every location
(the expand setting) KFC is the exact one instead (x64).
"""

import jax
import jax.flatten_util
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite.blocks import conv
from tests import blocks_helpers as h

B = 3

# name -> (input shape, kernel shape, conv keyword arguments).
GEOMETRIES = {
    "same_strided": ((B, 5, 6, 2), (3, 3, 2, 3), dict(
        window_strides=(2, 1), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "valid_dilated": ((B, 7, 6, 2), (2, 3, 2, 2), dict(
        window_strides=(1, 2), padding="VALID", rhs_dilation=(2, 1),
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "explicit_lhs_dilated_nchw": ((B, 2, 4, 5), (3, 2, 2, 3), dict(
        window_strides=(1, 1), padding=((1, 2), (0, 1)),
        lhs_dilation=(2, 1), dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "strided_1d": ((B, 9, 2), (3, 2, 2), dict(
        window_strides=(3,), padding="VALID",
        dimension_numbers=("NWC", "WIO", "NWC"))),
}


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _problem(name, seed=0):
  x_shape, w_shape, kw = GEOMETRIES[name]
  kx, kw_, kb, ky = jax.random.split(jax.random.PRNGKey(seed), 4)
  out_ch = w_shape[kw["dimension_numbers"][1].index("O")]
  params = {"w": jax.random.normal(kw_, w_shape) / 2,
            "b": 0.3 * jax.random.normal(kb, (out_ch,))}
  x = jax.random.normal(kx, x_shape)
  size = jax.eval_shape(lambda: _conv(params, x, kw)).size // B
  ky, ka = jax.random.split(ky)
  batch = {"x": x, "y": jax.random.normal(ky, (B, out_ch)),
           "y_all": jax.random.normal(ka, (B, size))}
  return params, batch, kw


def _conv(params, x, kw):
  y = lax.conv_general_dilated(x, params["w"], **kw)
  feature = kw["dimension_numbers"][2].index("C")
  return y + params["b"].reshape([-1 if a == feature else 1
                                  for a in range(y.ndim)])


def _materialised_patches(x, w_shape, kw):
  """``[B, L, K·c_in]`` in the kernel flatten order ``[*spatial, c_in]``,
  from ``lax.conv_general_dilated_patches`` (channel-major there)."""
  dn = lax.conv_dimension_numbers(x.shape, w_shape, kw["dimension_numbers"])
  spatial = tuple(w_shape[a] for a in dn.rhs_spec[2:])
  c_in = w_shape[dn.rhs_spec[1]]
  p = lax.conv_general_dilated_patches(
      x, spatial, kw["window_strides"], kw["padding"],
      lhs_dilation=kw.get("lhs_dilation"),
      rhs_dilation=kw.get("rhs_dilation"), dimension_numbers=dn,
      precision=lax.Precision.HIGHEST)
  window = int(np.prod(spatial))
  p = jnp.moveaxis(p, dn.out_spec[1], -1).reshape(x.shape[0], -1, c_in,
                                                    window)
  return np.asarray(jnp.swapaxes(p, -1, -2).reshape(x.shape[0], -1,
                                                      window * c_in))


def _geometry(w_shape, kw):
  dn = lax.conv_dimension_numbers((1,) * len(w_shape), w_shape,
                                  kw["dimension_numbers"])
  return conv.ConvGeometry(
      kernel_shape=w_shape, window_strides=kw["window_strides"],
      padding=kw["padding"], lhs_dilation=kw.get("lhs_dilation"),
      rhs_dilation=kw.get("rhs_dilation"), dimension_numbers=dn)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_patch_sums_are_the_materialised_patches_summed(name):
  params, batch, kw = _problem(name)
  geo = _geometry(params["w"].shape, kw)
  want = _materialised_patches(batch["x"], params["w"].shape, kw)
  got, locations = geo.patch_sums(batch["x"])
  assert locations == want.shape[1]
  np.testing.assert_allclose(np.asarray(got), want.sum(axis=1), rtol=1e-12,
                             atol=1e-12)


def _outputs(setting, params, batch, kw):
  """``[B, d]``: summed over locations (reduce) or every location's own
  output (expand), with the target of the setting."""
  y = _conv(params, batch["x"], kw)
  if setting == "expand":
    return y.reshape(B, -1), batch["y_all"]
  feature = kw["dimension_numbers"][2].index("C")
  return jnp.sum(y, axis=tuple(a for a in range(1, y.ndim)
                               if a != feature)), batch["y"]


def _loss(setting, kw):
  """A squared error of :func:`_outputs`."""
  def loss_fn(params, batch):
    z, y = _outputs(setting, params, batch, kw)
    kl.register_squared_error_loss(z, y)
    return jnp.mean(jnp.sum((z - y) ** 2, axis=-1))
  return loss_fn


def _estimator(name, approx, setting="reduce", **kwargs):
  params, batch, kw = _problem(name)
  collection = kl.scan(_loss(setting, kw), params, batch,
                       approximations={"conv": approx})
  assert [l.approx for l in collection.layers] == [approx]
  est = kl.FisherEstimator(collection, estimation_mode="exact_GGN", **kwargs)
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, batch)
  return est, state, params, batch, kw


def _explicit_ggn(setting, params, batch, kw):
  """``Jᵀ H J`` of the mean loss, in ravel order of ``params``."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  z_of = lambda p: _outputs(setting, unravel(p), batch, kw)[0]  # noqa
  z = z_of(flat)
  target = _outputs(setting, params, batch, kw)[1]
  jac = jax.jacobian(lambda p: z_of(p).reshape(-1))(flat)
  hess = jax.hessian(lambda zz: jnp.mean(jnp.sum(
      (zz.reshape(z.shape) - target) ** 2, axis=-1)))(z.reshape(-1))
  return np.asarray(jac.T @ hess @ jac)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_input_factor_is_the_explicit_formula(name):
  """``A = (1/B) Σ_b p̄_b p̄_bᵀ``, ``p̄_b`` the mean of ``[p_{b,t}; 1]``."""
  _, state, params, batch, kw = _estimator(name, "kron_reduce")
  (block,) = _blocks(state)
  p = _materialised_patches(batch["x"], params["w"].shape, kw)
  p = np.concatenate([p, np.ones(p.shape[:-1] + (1,))], axis=-1)
  mean = p.mean(axis=1)
  np.testing.assert_allclose(np.asarray(block.a), mean.T @ mean / B,
                             rtol=1e-10, atol=1e-12)
  assert float(block.scale) == 1.0


def _blocks(state):
  return [s for s in jax.tree.leaves(
      state, is_leaf=lambda s: hasattr(s, "a") and hasattr(s, "scale"))
          if hasattr(s, "a")]


@pytest.mark.parametrize("name", [
    n if n == "same_strided" else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(GEOMETRIES)])
def test_exact_in_the_reduce_setting_and_kron_is_not(name):
  est, state, params, batch, kw = _estimator(name, "kron_reduce")
  want = _explicit_ggn("reduce", params, batch, kw)
  np.testing.assert_allclose(np.asarray(est.full_fisher(state)), want,
                             rtol=1e-9, atol=1e-10)
  est_k, state_k, *_ = _estimator(name, "kron")
  other = np.asarray(est_k.full_fisher(state_k))
  assert np.abs(other - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["same_strided", "strided_1d"])
def test_kron_is_exact_in_the_expand_setting_and_reduce_is_not(name):
  """Every location its own squared error: KFC is the GGN block, and
  KFC-reduce is not."""
  est, state, params, batch, kw = _estimator(name, "kron", "expand")
  want = _explicit_ggn("expand", params, batch, kw)
  np.testing.assert_allclose(np.asarray(est.full_fisher(state)), want,
                             rtol=1e-9, atol=1e-10)
  est_r, state_r, *_ = _estimator(name, "kron_reduce", "expand")
  other = np.asarray(est_r.full_fisher(state_r))
  assert np.abs(other - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.slow
def test_preconditioned_gradient_is_a_dense_solve():
  damping = 0.1
  est, state, params, batch, kw = _estimator(
      "same_strided", "kron_reduce", damping_type="exact")
  state = est.update_cache(state, damping)
  grads = jax.grad(_loss("reduce", kw))(params, batch)
  flat, _ = jax.flatten_util.ravel_pytree(grads)
  f = _explicit_ggn("reduce", params, batch, kw)
  want = np.linalg.solve(f + damping * np.eye(f.shape[0]), np.asarray(flat))
  got, _ = jax.flatten_util.ravel_pytree(est.multiply_inverse(state, grads))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("meta,match", [
    (dict(feature_group_count=2), "feature_group_count=2"),
    (dict(window_strides=(1,)), r"window_strides=\(1,\) has 1"),
])
def test_bad_geometry_is_named(meta, match):
  layer = h.make_layer("conv", "kron_reduce", [(3, 3, 2, 4), (4,)],
                       **{"window_strides": (1, 1), **meta})
  with pytest.raises(ValueError, match=match):
    h.make_block(layer)


def test_a_multi_use_conv_sums_over_its_uses_too():
  """Two sites of one conv: ``p̄_b`` averages over both sites' locations
  (``R = 2|T|``) and ``ḡ`` sums over both."""
  params, batch, kw = _problem("same_strided")
  geo = _geometry(params["w"].shape, kw)
  x2 = batch["x"][::-1]
  g = jax.random.normal(jax.random.PRNGKey(5), (2, B, 1, 3, 6, 3))
  data = h.layer_data([(batch["x"][:, None],), (x2[:, None],)],
                      [g, 2 * g], (params["w"], params["b"]))
  p = np.concatenate([_materialised_patches(x, params["w"].shape, kw)
                      for x in (batch["x"], x2)], axis=1)
  mean = np.concatenate([p.mean(axis=1), np.ones((B, 1))], axis=-1)
  gsum = 3 * np.asarray(g).sum(axis=(2, 3, 4))             # [S, B, c_out]
  got = conv.ConvReduceLayout(geo, True, 2).factor_stats(data, False, False)
  np.testing.assert_allclose(np.asarray(got["a"]), mean.T @ mean / B,
                             rtol=1e-10)
  want_g = np.einsum("sbi,sbj->ij", gsum, gsum) / B
  np.testing.assert_allclose(np.asarray(got["g"]), want_g, rtol=1e-10)
