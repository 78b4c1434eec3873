"""Algebraic identities every block must satisfy, against its dense block.

Each case runs its update and all its products in one ``jax.jit`` (fast
compiles, and the jitted path is the one users run).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax_lite.blocks import kronecker
from tests import block_cases as cases
from tests import blocks_helpers as h
from tests.blocks_helpers import x64  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("x64")  # float64 factors

# One case per code path (the per-family tests check the statistics of the
# others); "exact" damping only where it differs from "pi".
NAMES = ["conv_diagonal", "conv_kron_oihw", "conv_sua", "conv_sua_nobias_oihw",
         "dense_diagonal", "dense_full", "dense_kron_both_diag",
         "dense_kron_uses", "depthwise_diagonal", "depthwise_kron",
         "depthwise_lax_diagonal", "depthwise_lax_kron", "embedding_kron",
         "generic_full", "scale_and_shift_full", "separable_kron", "series_1",
         "series_2", "tied_kron_sum"]
KRONECKER_LIKE = ["conv_kron_oihw", "conv_sua", "conv_sua_nobias_oihw",
                  "dense_kron_both_diag", "dense_kron_uses", "depthwise_kron",
                  "embedding_kron", "separable_kron"]
DAMPING = 0.1


def _close(a, b, rtol=1e-9):
  a, b = h.ravel(a), h.ravel(b)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(
      jnp.max(jnp.abs(b))))


def _split_like(flat, like):
  out, i = [], 0
  for x in like:
    out.append(flat[i:i + x.size].reshape(x.shape))
    i += x.size
  return tuple(out)


def _products(block, data, supports, v, tiny):
  """Everything the identities need, from one fitted state."""
  state = h.fit(block, data, DAMPING)
  bad = data._replace(grads=tuple(g * jnp.nan for g in data.grads),
                      param_grads=tuple(g * jnp.nan for g in data.param_grads))
  out = {"state": state, "full": block.full_fisher_block(state),
         "after_nan": block.update_curvature(state, block.compute_stats(bad),
                                             0.9)}
  if "inverse" in supports:
    mi = block.multiply_inverse(state, v)
    out.update(mi=mi, m=block.multiply(state, v),
               m_mi=block.multiply(state, mi),
               raw_mi=block.finish_product(
                   block.multiply_matpower_raw(state, v, -1), v))
  if "power" in supports:
    half = block.multiply_matpower(state, v, 0.5)
    out.update(half_half=block.multiply_matpower(state, half, 0.5),
               ihalf_ihalf=block.multiply_matpower(
                   state, block.multiply_matpower(state, v, -0.5), -0.5))
  if "cholesky" in supports:
    c = lambda x, t=False: block.multiply_cholesky(state, x, t)  # noqa
    ci = lambda x, t=False: block.multiply_cholesky_inverse(state, x, t)  # noqa
    out.update(c_ct=c(c(v, True)), ci_c=ci(c(v)), cti_ct=ci(c(v, True), True),
               cti_ci=ci(ci(v), True))
  if tiny:
    tiny_state = block.update_cache(state, 1e-20)
    out.update(tiny_mi=block.multiply_inverse(tiny_state, v))
  return out


# Every block with π damping; exact damping on a dense and a conv
# Kronecker block, the other Kronecker-like blocks' exact damping slow.
EXACT_DEFAULT = ("dense_kron_uses", "conv_kron_oihw")


@pytest.mark.parametrize("name,damping_type", [
    (n, "pi") for n in NAMES] + [
        (n, "exact") if n in EXACT_DEFAULT
        else pytest.param(n, "exact", marks=pytest.mark.slow)
        for n in KRONECKER_LIKE])
def test_block_identities(name, damping_type):
  """Products are mutually consistent and match the dense block.

  ``multiply ∘ multiply_inverse = id``; two half powers make one;
  ``C Cᵀ`` is the damped block and ``C⁻¹`` inverts ``C``; exact damping
  equals ``solve(F + λI, v)``; pi damping is the factored Tikhonov
  ``c (A + π√λ' I) ⊗ (G + √λ'/π I)`` and tends to ``F⁻¹`` as λ → 0 (λ
  enters through √λ, so λ = 1e-20 perturbs by ~1e-10).
  """
  layer, data, params, _, supports = cases.build(name)
  tiny = damping_type == "pi" and name in KRONECKER_LIKE
  block = h.make_block(layer, exps=(-1, 0.5, -0.5), compute_cholesky=True,
                       compute_cholesky_inverse=True,
                       damping_type=damping_type)
  v = h.random_like(1, params)
  out = jax.jit(lambda v: _products(block, data, supports, v, tiny))(v)

  # Non-finite statistics leave the state untouched; init matches in shape.
  for x, y in zip(jax.tree.leaves(out["state"]),
                  jax.tree.leaves(out["after_nan"])):
    np.testing.assert_array_equal(x, y)
  init = jax.eval_shape(block.init)
  assert jax.tree.structure(init) == jax.tree.structure(out["state"])
  for x, y in zip(jax.tree.leaves(init), jax.tree.leaves(out["state"])):
    assert (x.shape, x.dtype) == (y.shape, y.dtype)
  f = out["full"]
  np.testing.assert_allclose(f, f.T, atol=1e-12 * float(jnp.max(jnp.abs(f))))

  if "inverse" in supports:
    _close(out["m_mi"], v)
    # The product in two parts (the estimator cuts [W; b] per parameter
    # where it is consumed) is the product.
    for x, y in zip(jax.tree.leaves(out["raw_mi"]), jax.tree.leaves(out["mi"])):
      np.testing.assert_array_equal(x, y)
  if "power" in supports:
    _close(out["half_half"], out["m"])
    _close(out["ihalf_ihalf"], out["mi"])
  if "cholesky" in supports:
    _close(out["c_ct"], out["m"])        # C Cᵀ is the damped block.
    _close(out["cti_ci"], out["mi"])     # C⁻ᵀ C⁻¹ is its inverse.
    for k in ("ci_c", "cti_ct"):             # C⁻¹ C = I, C⁻ᵀ Cᵀ = I.
      _close(out[k], v)
  if damping_type == "exact":
    damped = f + DAMPING * jnp.eye(f.shape[0])
    _close(out["m"], _split_like(damped @ h.ravel(v), v))
    _close(out["mi"], _split_like(jnp.linalg.solve(damped, h.ravel(v)), v),
           rtol=1e-8)
  elif isinstance(block, kronecker.KroneckerBlock):
    _check_factored_tikhonov(block, out["state"], v, out["m"], out["mi"])
  if tiny:
    _close(out["tiny_mi"], _split_like(jnp.linalg.solve(f, h.ravel(v)), v),
           rtol=1e-7)


def _check_factored_tikhonov(block, state, v, m, mi):
  """``c (A + π√λ' I) ⊗ (G + √λ'/π I)``, ``λ' = λ / c`` (Martens & Grosse)."""
  a, g = h.np_matrix(state.a), h.np_matrix(state.g)
  c = float(state.scale)
  lam = DAMPING / c
  pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
  dense = c * np.kron(a + pi * np.sqrt(lam) * np.eye(a.shape[0]),
                      g + np.sqrt(lam) / pi * np.eye(g.shape[0]))
  index = block.layout.ravel_index()
  if index is not None:
    dense = h.to_ravel(dense, index)
  _close(m, _split_like(dense @ h.ravel(v), v))
  _close(mi, _split_like(np.linalg.solve(dense, h.ravel(v)), v), rtol=1e-8)


def test_blocks_group_without_their_layer():
  """The estimator stacks blocks equal up to ``layer``: none hides state."""
  for name in sorted(cases.CASES):
    layer, *_ = cases.build(name)
    a = h.make_block(layer)
    b = h.make_block(dataclasses.replace(layer, name="other",
                                         param_indices=(7, 8, 9)[
                                             :len(layer.param_indices)]))
    assert dataclasses.replace(a, layer=None) == dataclasses.replace(
        b, layer=None), name
  # ... and blocks acting on differently shaped params never compare equal.
  for approx in ("diagonal", "full"):
    a = h.make_block(h.make_layer("generic", approx, [(3, 4)]))
    b = h.make_block(h.make_layer("generic", approx, [(12,)]))
    assert dataclasses.replace(a, layer=None) != dataclasses.replace(
        b, layer=None)
