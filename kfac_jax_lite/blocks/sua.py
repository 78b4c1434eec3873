"""KFC with spatially uncorrelated activations: conv ``kron_sua``.

Grosse & Martens (2016), sec. 3.2 and Theorem 4. Under SUA the input
activations at different positions are uncorrelated with a common mean
:math:`\\mu` and channel covariance :math:`\\Sigma`, so the patch moment of
KFC (:mod:`.conv`) becomes, with :math:`\\bar m = [1_K \\otimes \\mu; 1]`
(the 1 for the bias) and ``K`` the kernel's spatial size,

.. math::
  \\Omega = (I_K \\otimes \\Sigma) \\oplus 0 + \\bar m \\bar m^T, \\qquad
  F \\approx c\\, \\Omega \\otimes \\Gamma,

in the kernel's ``[*spatial, c_in]`` flatten order. (TF K-FAC builds
:math:`\\Sigma \\otimes I_K`, which mismatches that order whenever ``C > 1``
and ``K > 1``.) :math:`\\mu` and :math:`E[x x^T]` are averaged over examples
and all input positions; :math:`\\Sigma = E[x x^T] - \\mu\\mu^T`.

Products never form ``Ω``. In the rotated basis
:math:`\\tilde R = ((I_K \\otimes U_\\Sigma) \\oplus 1) \\otimes U_G` the
damped block is, for each eigen-column ``o`` of ``G``, the matrix
:math:`M_o = p_o(\\mathrm{diag}(d) + u u^T) + q I` with
:math:`u = [1_K \\otimes U_\\Sigma^T \\mu; 1]`:

* ``damping_type="pi"``: :math:`c(\\Omega + \\gamma_A I) \\otimes (G +
  \\gamma_G I)`, so :math:`d = [1_K \\otimes (\\sigma + \\gamma_A);
  \\gamma_A]`, :math:`p = c(\\sigma_G + \\gamma_G)`, ``q = 0``;
* ``damping_type="exact"``: :math:`c\\,\\Omega \\otimes G + \\lambda I`, so
  :math:`d = [1_K \\otimes \\sigma; 0]`, :math:`p = c\\sigma_G`,
  :math:`q = \\lambda`.

The bias coordinate is eliminated first (its Schur complement
:math:`S_o = D_o + \\kappa_o u u^T`, :math:`\\kappa_o = p_o D_{o,b} / s_o`,
:math:`s_o = D_{o,b} + p_o`, stays well conditioned as the damping
vanishes), then Sherman-Morrison inverts :math:`S_o`. The square-root
factor is :math:`C_o = L_o\\, \\mathrm{blockdiag}(C_{S,o}, \\sqrt{s_o})` with
:math:`L_o = [[I, (p_o/s_o) u], [0, 1]]` and
:math:`C_{S,o} = D_o^{1/2}(I + \\alpha_o w_o w_o^T)`,
:math:`w_o = \\sqrt{\\kappa_o} D_o^{-1/2} u`,
:math:`\\alpha_o = 1/(1 + \\sqrt{1 + |w_o|^2})`; ``C`` is not triangular.
Cost :math:`O(C^3 + O^3 + KCO)` instead of :math:`O((KC)^3)`. Only exps -1
and 1 (matrix powers of a rank-one update have no closed form).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.layer import Layer


class SUAState(NamedTuple):
  s: jnp.ndarray        # [C, C] E[x xᵀ] over examples and input positions
  mu: jnp.ndarray       # [C] E[x]
  g: jnp.ndarray        # [O, O] Γ
  weight: jnp.ndarray   # [] total EMA weight
  scale: jnp.ndarray    # [] c = output locations x uses
  damping: jnp.ndarray  # [] damping at the last update_cache
  cache: dict           # us, ug [eigenbases], d, u [K·C], d_bias, p [O], q


def _sm_solve(dmat, u, kappa, x):
  """``(D + κ u uᵀ)⁻¹ x`` per column; ``D, x: [R, O]``, ``u: [R]``."""
  y = x / dmat
  w = u[:, None] / dmat
  return y - w * (kappa * (u @ y) / (1.0 + kappa * (u @ w)))[None, :]


@dataclasses.dataclass(frozen=True)
class _Root:
  """``C_S = D^½ (I + α w wᵀ)`` per column and its transpose / inverse."""
  root: jnp.ndarray    # [R, O] D^½
  w: jnp.ndarray       # [R, O]
  alpha: jnp.ndarray   # [O]
  beta: jnp.ndarray    # [O] (I + α w wᵀ)⁻¹ = I - β w wᵀ

  @classmethod
  def make(cls, dmat, u, kappa):
    w = u[:, None] * jnp.sqrt(kappa[None, :] / dmat)
    t = jnp.sum(jnp.square(w), axis=0)
    alpha = 1.0 / (1.0 + jnp.sqrt(1.0 + t))
    return cls(jnp.sqrt(dmat), w, alpha, alpha / (1.0 + alpha * t))

  def _rank1(self, x, coef):
    return x + self.w * (coef * jnp.sum(self.w * x, axis=0))[None, :]

  def apply(self, x, transpose, inverse):
    if not inverse:
      return (self._rank1(self.root * x, self.alpha) if transpose
              else self.root * self._rank1(x, self.alpha))
    if transpose:
      return self._rank1(x, -self.beta) / self.root
    return self._rank1(x / self.root, -self.beta)


@dataclasses.dataclass(frozen=True)
class SUAConvBlock(base.Shorthands, base.UnfusedProducts, base.FieldFactors):
  """Conv ``kron_sua`` block; see the module docstring."""
  layer: Layer
  config: base.BlockConfig
  layout: conv.ConvLayout
  needs_param_grads = False
  factor_fields = ("s", "mu", "g", "scale")

  @property
  def _dims(self):
    geo = self.layout.geometry
    return geo.c_in, geo.c_out, geo.window

  @property
  def _bias(self) -> bool:
    return self.layout.has_bias

  def init(self) -> SUAState:
    dt = linalg.factor_dtype()
    c, o, k = self._dims
    z = lambda *s: jnp.zeros(s, dt)  # noqa: E731
    cache = {"us": z(c, c), "ug": z(o, o), "d": z(k * c), "u": z(k * c),
             "d_bias": z(), "p": z(o), "q": z()}
    return SUAState(s=z(c, c), mu=z(c), g=z(o, o), weight=z(),
                    scale=jnp.asarray(self.layout.init_scale, dt),
                    damping=z(), cache=cache)

  def compute_stats(self, data: base.LayerData) -> dict:
    dt = linalg.factor_dtype()
    geo = self.layout.geometry
    spec = geo.dimension_numbers.lhs_spec
    xs = []
    for inp in data.inputs:
      x = inp[0].reshape((-1,) + inp[0].shape[2:]).astype(dt)
      x = x.transpose((spec[0], *spec[2:], spec[1]))
      xs.append(x.reshape(-1, geo.c_in))
    x = jnp.concatenate(xs, axis=0)
    g = geo.site_grads(data)
    g = g.reshape(g.shape[0], -1, g.shape[-1])
    c = base.rows_per_example(g.shape[1], data.batch_size, "conv layer")
    return {"s": layouts.second_moment(x, False), "mu": jnp.mean(x, 0),
            "g": layouts.source_moment(g, False),
            "scale": jnp.asarray(c, dt)}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, self.factor_fields, stats, ema_decay)

  # ---- Ω -----------------------------------------------------------------
  def _sigma(self, state):
    return linalg.symmetrize(state.s - jnp.outer(state.mu, state.mu))

  def _mean_vector(self, mu):
    m = jnp.tile(mu, self._dims[2])
    return jnp.concatenate([m, jnp.ones((1,), m.dtype)]) if self._bias else m

  def _omega_times(self, state, m, shift):
    """``(Ω + shift I) V`` for ``V: [K·C(+1), O]``, without forming Ω."""
    c, o, k = self._dims
    sig = self._sigma(state) + shift * jnp.eye(c, dtype=state.s.dtype)
    out = jnp.einsum("cd,kdo->kco", sig, m[:k * c].reshape(k, c, o))
    out = jnp.concatenate([out.reshape(k * c, o), shift * m[k * c:]], axis=0)
    mbar = self._mean_vector(state.mu)
    return out + jnp.outer(mbar, mbar @ m)

  def _pi_split(self, state, damping):
    """``(γ_A, γ_G)`` from the traces of Ω and Γ, with λ' = λ / c."""
    c, _, k = self._dims
    bias = int(self._bias)
    ta = (k * jnp.trace(state.s) + bias) / (k * c + bias)
    return linalg.pi_split(ta, linalg.trace_norm(state.g),
                           damping / state.scale)

  # ---- cache ---------------------------------------------------------------
  def update_cache(self, state, damping):
    damping = jnp.asarray(damping, linalg.factor_dtype())
    sig, us = linalg.safe_eigh(self._sigma(state))
    sg, ug = linalg.safe_eigh(state.g)
    if self.config.damping_type == "exact":
      gam_a, p, q = jnp.zeros_like(damping), state.scale * sg, damping
    else:
      gam_a, gam_g = self._pi_split(state, damping)
      p, q = state.scale * (sg + gam_g), jnp.zeros_like(damping)
    k = self._dims[2]
    cache = {"us": us, "ug": ug, "d": jnp.tile(sig + gam_a, k),
             "u": jnp.tile(us.T @ state.mu, k), "d_bias": gam_a, "p": p,
             "q": q}
    return state._replace(cache=cache, damping=damping)

  def _rotate(self, state, m, transpose):
    """``R̃ᵀ V`` (transpose) or ``R̃ V``, split as (top ``[K·C, O]``, bias)."""
    c, o, k = self._dims
    us, ug = state.cache["us"], state.cache["ug"]
    if transpose:
      top = jnp.einsum("dc,kdo->kco", us, m[:k * c].reshape(k, c, o))
      return top.reshape(k * c, o) @ ug, m[k * c:] @ ug
    top, bias = m
    top = jnp.einsum("cd,kdo->kco", us, top.reshape(k, c, o))
    return jnp.concatenate([top.reshape(k * c, o), bias], axis=0) @ ug.T

  def _pieces(self, state):
    """``D`` (top), ``u``, ``p``, ``s``, ``κ`` of the module docstring."""
    ch = state.cache
    p = ch["p"]
    dmat = ch["d"][:, None] * p[None, :] + ch["q"]
    if not self._bias:
      return dmat, ch["u"], p, None, p
    s = (ch["d_bias"] + 1.0) * p + ch["q"]
    return dmat, ch["u"], p, s, p * (s - p) / s

  # ---- products ------------------------------------------------------------
  def _unsupported(self, what):
    base.unsupported(self, what, "kron_sua", "exps -1 and 1",
                     "its inverse is a Sherman-Morrison update",
                     "Use approx='kron' for other powers.")

  def multiply_matpower(self, state, v, exp):
    """``F̂^exp v`` for exp 1 (live factors) and -1 (cache)."""
    exp = base.check_exp(self, exp)
    m = self.layout.to_mat(v)
    if exp == 1.0:
      if self.config.damping_type == "exact":
        out = state.scale * self._omega_times(state, m, 0.0) @ state.g
        out = out + state.damping * m
      else:
        gam_a, gam_g = self._pi_split(state, state.damping)
        g = state.g + gam_g * jnp.eye(state.g.shape[0], dtype=state.g.dtype)
        out = state.scale * self._omega_times(state, m, gam_a) @ g
      return self.layout.from_mat(out, v)
    if exp != -1.0:
      self._unsupported(f"multiply_matpower(exp={exp:g})")
    dmat, u, p, s, kappa = self._pieces(state)
    xt, xb = self._rotate(state, m, True)
    if self._bias:   # xb: [1, O]
      assert s is not None  # _pieces gives s with a bias
      shifted = xt - u[:, None] * ((p / s)[None, :] * xb)
      yt = _sm_solve(dmat, u, kappa, shifted)
      yb = (xb - (p * (u @ yt))[None, :]) / s[None, :]
    else:
      yt, yb = _sm_solve(dmat, u, kappa, xt), xb
    return self.layout.from_mat(self._rotate(state, (yt, yb), False), v)

  def _factor_product(self, state, v, transpose, inverse):
    dmat, u, p, s, kappa = self._pieces(state)
    root = _Root.make(dmat, u, kappa)
    m = self.layout.to_mat(v)
    first_rotate = transpose != inverse   # Cᵀ and C⁻¹ start with R̃ᵀ.
    if first_rotate:
      xt, xb = self._rotate(state, m, True)
    else:
      c, _, k = self._dims
      xt, xb = m[:k * c], m[k * c:]
    if not self._bias:
      yt, yb = root.apply(xt, transpose, inverse), xb
    else:                                 # xb: [1, O]
      assert s is not None  # _pieces gives s with a bias
      rs, ps = jnp.sqrt(s)[None, :], (p / s)[None, :]
      if not inverse and not transpose:   # L blockdiag(C_S, √s) x
        yt = root.apply(xt, False, False) + u[:, None] * (ps * rs * xb)
        yb = rs * xb
      elif not inverse:                   # blockdiag(C_Sᵀ, √s) Lᵀ x
        yt = root.apply(xt, True, False)
        yb = ps * rs * (u @ xt)[None, :] + rs * xb
      elif not transpose:                 # blockdiag(C_S⁻¹, 1/√s) L⁻¹ x
        yt = root.apply(xt - u[:, None] * (ps * xb), False, True)
        yb = xb / rs
      else:                               # L⁻ᵀ blockdiag(C_S⁻ᵀ, 1/√s) x
        yt = root.apply(xt, True, True)
        yb = xb / rs - ps * (u @ yt)[None, :]
    if first_rotate:
      out = jnp.concatenate([yt, yb], axis=0)
    else:
      out = self._rotate(state, (yt, yb), False)
    return self.layout.from_mat(out, v)

  def multiply_cholesky(self, state, v, transpose=False):
    """``C v`` (``Cᵀ v``) with ``C Cᵀ`` the damped block (not triangular)."""
    return self._factor_product(state, v, transpose, inverse=False)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    """``C⁻¹ v`` (``C⁻ᵀ v``) for the factor of :meth:`multiply_cholesky`."""
    return self._factor_product(state, v, transpose, inverse=True)

  def full_fisher_block(self, state):
    """``c · kron(Ω, Γ)``, undamped, in ravel order of ``(w, b)``."""
    c, _, k = self._dims
    om = jnp.kron(jnp.eye(k, dtype=state.s.dtype), self._sigma(state))
    if self._bias:
      om = jnp.pad(om, ((0, 1), (0, 1)))
    mbar = self._mean_vector(state.mu)
    f = state.scale * jnp.kron(om + jnp.outer(mbar, mbar), state.g)
    return layouts.to_ravel_order(f, self.layout.ravel_index())


def conv_sua_block(layer: Layer, config: base.BlockConfig) -> SUAConvBlock:
  """The ``kron_sua`` block of a conv layer."""
  layout = conv.ConvLayout(conv.conv_geometry(layer),
                           layer.has_bias, layer.num_uses)
  return SUAConvBlock(layer=layer, config=config, layout=layout)
