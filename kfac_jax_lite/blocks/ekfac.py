"""EK-FAC: K-FAC's eigenbasis with exact second moments as eigenvalues.

George, Laurent, Bouthillier, Ballas & Vincent (NeurIPS 2018), "Fast
Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis".
With the K-FAC factors :math:`A = U_A \\Lambda_A U_A^T` and
:math:`G = U_G \\Lambda_G U_G^T` (as in :mod:`.kronecker`: ``W`` stored
``[d_a, d_g]`` = ``[in (+1 for a bias), out]``), K-FAC's block is
:math:`c\\,A \\otimes G = U (c\\,\\Lambda_A \\otimes \\Lambda_G) U^T` with
:math:`U = U_A \\otimes U_G`. EK-FAC keeps ``U`` and replaces the eigenvalues
by the second moments of the per-example gradients in that basis,

.. math::
  \\hat F = U \\mathrm{diag}(\\mathrm{vec}\\, s) U^T, \\qquad
  s = \\frac{1}{B} \\sum_{b, s'} (U_A^T \\nabla W_{s', b} U_G)^{\\odot 2},

which is :math:`\\mathrm{diag}(U^T F U)` for the empirical block
:math:`F = \\frac1B \\sum \\mathrm{vec}\\nabla W \\mathrm{vec}\\nabla W^T`
(the sum runs over examples ``b`` and sources ``s'``: sampled targets,
exact-mode columns; see :mod:`kfac_jax_lite.linearization`). Among all
matrices diagonal in the basis ``U`` it is the one closest to ``F`` in
Frobenius norm, so it is no further from ``F`` than K-FAC's (paper,
Theorem 1; checked in tests/test_ekfac.py).

**Per example.** ``∇W_b`` is the gradient of example ``b``'s loss: for a
layer used ``R`` times per example (a dense layer on ``[B, T, d]`` inputs,
several tag sites, scan steps; or the ``L`` output locations of a
convolution, times its uses) it is *summed over the uses*,

.. math::
  U_A^T \\nabla W_{s', b} U_G = \\sum_{r=1}^{R} (U_A^T a_{b,r})
  (U_G^T g_{s',b,r})^T,

so that ``s`` is ``diag(UᵀFU)`` of the exact per-example Fisher of the
layer, cross-position terms included (not the per-position moments, which
would assume the uses independent as ``kron_indep`` and KFC do). With one
use per example each projected gradient is the outer product of two
projected vectors and :math:`s = \\frac1B (P_A^{\\odot 2})^T
(\\textstyle\\sum_{s'} Q_{s'}^{\\odot 2})`, ``P_A = X U_A``,
``Q = G U_G``: no ``[B, d_a, d_g]`` array is formed. With ``R > 1`` the
projected per-example gradients ``[S, B, d_a, d_g]`` are formed (one batched
matmul of ``B·R·d_a·d_g`` flops; the unprojected ones never are).

**Amortised refresh.** ``update_cache`` (which the estimator runs every
``inverse_update_period`` steps, under ``lax.cond``) takes the
eigendecompositions of the EMA'd ``A`` and ``G``. ``update_curvature``
projects each minibatch onto the basis of the *last* refresh (the paper's
amortised algorithm: the scalings are updated at every step, the basis at
refreshes), so the scalings are always in the basis the products use.
Before the first refresh the basis is the identity (``s`` is then the EMA of
the exact diagonal of the per-example Fisher). At a refresh the EMA'd
scalings are carried into the new basis as the diagonal, in that basis, of
the current EK-FAC matrix,

.. math::
  s \\leftarrow (R_A^{\\odot 2})^T s\\, R_G^{\\odot 2}, \\qquad
  R_A = U_A^{\\mathrm{old}\\,T} U_A^{\\mathrm{new}}, \\;
  R_G = U_G^{\\mathrm{old}\\,T} U_G^{\\mathrm{new}},

(the closest matrix diagonal in the new basis to the old estimate, which
keeps its trace), and the EMA continues: one zero-debiased EMA weight serves
``A``, ``G``, ``c`` and ``s``. After one update with ``ema_decay=0`` that
follows a refresh, ``s`` is exactly ``diag(UᵀFU)`` of that batch.

**Damping.** Products use :math:`U \\mathrm{diag}(s + \\lambda)^{e} U^T`
(``λ`` from the last ``update_cache``), so any power is one rotation in and
out; nothing but the basis is cached. The ``damping_type`` option does not
apply (a factored ``"pi"`` damping has no meaning for a non-Kronecker
diagonal): both values give ``s + λ``.

**Cost** (multiply-adds; ``N = B·R`` rows, ``S`` sources; docs/ekfac.md):
per update, K-FAC's ``N d_a² + S N d_g²`` for the factors plus as much
again for the projections, and ``B d_a d_g`` (``R = 1``) or ``S N d_a d_g``
(``R > 1``, with a ``[S, B, d_a, d_g]`` temporary) for the moments; state
``d_a d_g`` more than K-FAC's (the scalings); per refresh two ``eigh`` (as
K-FAC with ``damping_type="exact"``) plus ``d_a³ + d_g³`` for the carry-over;
per product ``2 (d_a² d_g + d_a d_g²)``, twice a ``"pi"`` K-FAC product (as
K-FAC's with ``damping_type="exact"``). Under data parallelism the rows are
gathered over the replicas (:mod:`kfac_jax_lite.linearization`), not averaged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.layer import Layer


class EKFACState(NamedTuple):
  a: jnp.ndarray        # [d_a, d_a] K-FAC input factor (EMA)
  g: jnp.ndarray        # [d_g, d_g] K-FAC output-gradient factor (EMA)
  s: jnp.ndarray        # [d_a, d_g] scalings in the cached basis (EMA)
  weight: jnp.ndarray   # [] total EMA weight (zero-debiasing)
  scale: jnp.ndarray    # [] c = rows per example (uses x locations), EMA
  damping: jnp.ndarray  # [] the damping given to the last update_cache
  cache: dict           # a_eigvec, g_eigvec, a_eigval, g_eigval


def projected_moments(x, g, ua, ug):
  """``s = (1/B) Σ_{s', b} (U_Aᵀ (Σ_r a_{b,r} g_{s',b,r}ᵀ) U_G)^{⊙2}``.

  Args:
    x: input rows ``[B, R, d_a]`` (a trailing 1 for a bias).
    g: output-gradient rows ``[S, B, R, d_g]``.
    ua, ug: the bases ``[d_a, d_a]``, ``[d_g, d_g]`` (columns).

  Returns:
    ``[d_a, d_g]``.
  """
  b, r = x.shape[0], x.shape[1]
  p = x @ ua                      # [B, R, d_a]
  q = g @ ug                      # [S, B, R, d_g]
  if r == 1:
    # (p qᵀ)^{⊙2} = p^{⊙2} (q^{⊙2})ᵀ: no [B, d_a, d_g] array.
    q2 = jnp.sum(jnp.square(q[:, :, 0]), axis=0)        # [B, d_g]
    return jnp.square(p[:, 0]).T @ q2 / b
  m = jnp.einsum("bri,sbrj->sbij", p, q)
  return jnp.sum(jnp.square(m), axis=(0, 1)) / b


@dataclasses.dataclass(frozen=True)
class DenseRows:
  """Per-example rows of a (possibly multi-use) dense layer."""
  layout: layouts.DenseLayout

  def rows(self, data: base.LayerData):
    """``[B, R, d_a]`` inputs (with the bias 1) and ``[S, B, R, d_g]``."""
    lay = self.layout
    x, g = per_example.DenseGrads(lay.d_in, lay.d_out, lay.has_bias)._rows(
        data)
    return (layouts.append_ones(x) if lay.has_bias else x), g


@dataclasses.dataclass(frozen=True)
class ConvRows:
  """Per-example rows of a convolution: patches at every location."""
  layout: conv.ConvLayout

  def rows(self, data: base.LayerData):
    geo = self.layout.geometry
    return (geo.site_patches(data, self.layout.has_bias),
            geo.site_grads(data))


@dataclasses.dataclass(frozen=True)
class EKFACBlock(base.Shorthands, base.FieldFactors):
  """EK-FAC block (see the module docstring).

  Statistics: ``{"a", "g", "scale"}`` as K-FAC's and the per-example rows
  ``"x"`` ``[B, R, d_a]`` and ``"dy"`` ``[S, B, R, d_g]``, which
  ``update_curvature`` projects onto the cached basis. The statistics are
  therefore *not* shaped like :meth:`factors` (``{"a", "g", "scale",
  "s"}``): the scalings of a minibatch depend on the state's basis.

  Besides :class:`~.base.Block`: :class:`~.base.CholeskyProducts` and
  :class:`~.base.FusedProduct`.
  """
  layer: Layer
  config: base.BlockConfig
  layout: Any
  rows: Any
  needs_param_grads = False
  factor_fields = ("a", "g", "scale", "s")
  row_stats = ("x", "dy")

  def init(self) -> EKFACState:
    dt = linalg.factor_dtype()
    da, dg = self.layout.a_dim, self.layout.g_dim
    cache = {"a_eigvec": jnp.eye(da, dtype=dt),
             "g_eigvec": jnp.eye(dg, dtype=dt),
             "a_eigval": jnp.zeros((da,), dt),
             "g_eigval": jnp.zeros((dg,), dt)}
    return EKFACState(
        a=jnp.zeros((da, da), dt), g=jnp.zeros((dg, dg), dt),
        s=jnp.zeros((da, dg), dt), weight=jnp.zeros((), dt),
        scale=jnp.asarray(self.layout.init_scale, dt),
        damping=jnp.zeros((), dt), cache=cache)

  def compute_stats(self, data: base.LayerData) -> dict:
    x, g = self.rows.rows(data)
    b, r = x.shape[0], x.shape[1]
    if b != data.batch_size:
      raise ValueError(
          f"EK-FAC layer {base.layer_name(self)!r}: inputs have {b} examples "
          f"but batch_size={data.batch_size}. Every recorded input must "
          "have the batch as its leading axis.")
    stats = layouts.kron_stats(
        x.reshape(b * r, -1), g.reshape(g.shape[0], b * r, -1), b,
        False, False, "EK-FAC layer")
    return dict(stats, x=x, dy=g)

  def update_curvature(self, state, stats, ema_decay):
    """EMA of ``A``, ``G``, ``c`` and of the scalings of this minibatch in
    the basis of the last refresh (:func:`projected_moments`)."""
    s = projected_moments(stats["x"], stats["dy"], state.cache["a_eigvec"],
                          state.cache["g_eigvec"])
    new = {k: stats[k] for k in ("a", "g", "scale")}
    new["s"] = s
    # Non-finite rows make s non-finite: the state is then left as is.
    return base.ema_update(state, self.factor_fields, new, ema_decay)

  def update_cache(self, state, damping):
    """Eigenbases of ``A`` and ``G``; the scalings carried into them."""
    dt = linalg.factor_dtype()
    sa, ua = linalg.safe_eigh(state.a)
    sg, ug = linalg.safe_eigh(state.g)
    ra = jnp.square(state.cache["a_eigvec"].T @ ua)
    rg = jnp.square(state.cache["g_eigvec"].T @ ug)
    s = (ra.T @ state.s @ rg).astype(dt)
    cache = {"a_eigvec": ua, "g_eigvec": ug, "a_eigval": sa, "g_eigval": sg}
    return state._replace(s=s, cache=cache,
                          damping=jnp.asarray(damping, dt))

  # ---- products --------------------------------------------------------
  def _spectrum(self, state):
    return jnp.maximum(state.s, 0.0) + state.damping

  def product_input(self, v):
    return self.layout.to_mat(v)

  def finish_product(self, raw, like):
    return self.layout.from_mat(raw, like)

  def multiply_matpower_raw(self, state, v, exp):
    """``(U diag(s + λ) Uᵀ)^exp v`` as the ``[d_a, d_g]`` matrix."""
    exp = base.check_exp(self, exp)
    m = self.product_input(v) if isinstance(v, tuple) else v
    ua, ug = state.cache["a_eigvec"], state.cache["g_eigvec"]
    spec = jnp.power(self._spectrum(state), exp)
    rotated = linalg.rotate(m, ua, ug, True)
    return linalg.rotate(rotated * spec, ua, ug, False)

  def multiply_matpower(self, state, v, exp):
    return self.finish_product(self.multiply_matpower_raw(state, v, exp), v)

  def _cholesky_product(self, state, v, transpose, inverse):
    # C = U diag(√(s + λ)).
    ua, ug = state.cache["a_eigvec"], state.cache["g_eigvec"]
    return self.layout.from_mat(linalg.eigenbasis_cholesky(
        self.layout.to_mat(v), self._spectrum(state), ua, ug, transpose,
        inverse), v)

  def multiply_cholesky(self, state, v, transpose=False):
    """``C v`` (or ``Cᵀ v``), ``C = U diag(√(s + λ))``."""
    return self._cholesky_product(state, v, transpose, inverse=False)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    """``C⁻¹ v`` (or ``C⁻ᵀ v``)."""
    return self._cholesky_product(state, v, transpose, inverse=True)

  def full_fisher_block(self, state):
    """``U diag(vec s) Uᵀ``, undamped, in ravel order of the params."""
    u = jnp.kron(state.cache["a_eigvec"], state.cache["g_eigvec"])
    f = (u * state.s.reshape(-1)[None, :]) @ u.T
    return layouts.to_ravel_order(f, self.layout.ravel_index())


def dense_ekfac_block(layer: Layer, config: base.BlockConfig) -> EKFACBlock:
  """The EK-FAC block of a (possibly multi-use) dense layer."""
  layout = kronecker.dense_block(layer, config).layout
  return EKFACBlock(layer=layer, config=config, layout=layout,
                    rows=DenseRows(layout))


def conv_ekfac_block(layer: Layer, config: base.BlockConfig) -> EKFACBlock:
  """The EK-FAC block of a convolution (per example: summed over
  locations)."""
  layout = conv.ConvLayout(conv.conv_geometry(layer), layer.has_bias,
                           layer.num_uses)
  return EKFACBlock(layer=layer, config=config, layout=layout,
                    rows=ConvRows(layout))


def kfac_eigenvalues(state):
  """K-FAC's spectrum ``c λ_A λ_Gᵀ`` in the cached basis (for comparisons):
  K-FAC's block is ``U diag(vec(that)) Uᵀ`` when the factors have not moved
  since the refresh."""
  return state.scale * jnp.outer(state.cache["a_eigval"],
                                 state.cache["g_eigval"])

