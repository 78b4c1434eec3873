"""Multi-use dense layers with temporal structure: ``kron_series_1/2``.

Martens, Ba & Johnson (2018), "Kronecker-factored curvature approximations
for recurrent neural networks", sec. 3.4-3.5. A dense layer used ``T``
times per example (RNN steps in time order) has the per-example gradient
:math:`\\sum_t a_t g_t^T`. Modelling the inputs and output gradients as
independent stationary processes with lag-``k`` moments
:math:`E[a_{t+k} a_t^T]` and :math:`E[g_{t+k} g_t^T]`, the block is

.. math::
  F = \\sum_{i,j=1}^{T} E[a_i a_j^T] \\otimes E[g_i g_j^T].

Each factor ``C`` (``A`` or ``G``) keeps its moments over the ``T·B`` rows:
:math:`C_0 = \\frac{1}{TB}\\sum_{t,b} c_t c_t^T`, damped as
:math:`C_0 + \\gamma I` with the pi-split of :math:`\\lambda / T`, and the
undamped :math:`C_1 = \\frac{1}{TB}\\sum_{t<T,b} c_{t+1} c_t^T` (dividing by
``T·B`` keeps :math:`-C_0 \\preceq \\mathrm{sym}(C_1) \\preceq C_0`).
:math:`\\Psi = C_0^{-1/2} C_1 C_0^{-1/2}`.

* ``kron_series_1`` (their Option 1, :math:`C_1` symmetrised): with
  :math:`\\Psi = U \\mathrm{diag}(\\psi) U^T`, :math:`M = C_0^{1/2} U`,
  :math:`L = C_0^{-1/2} U = M^{-T}`,

  .. math::
    \\hat F = \\sum_{i,j} (A_0^{1/2}\\Psi_A^{|i-j|}A_0^{1/2}) \\otimes
    (G_0^{1/2}\\Psi_G^{|i-j|}G_0^{1/2})
    = (M_A \\otimes M_G)\\, \\mathrm{diag}(f(\\psi_A \\psi_G^T))\\,
    (M_A \\otimes M_G)^T,

  :math:`f(x) = \\sum_{i,j=1}^T x^{|i-j|}`, so
  :math:`\\hat F^{-1} V = L_A ((L_A^T V L_G) \\oslash f) L_G^T`. ``f`` is
  evaluated by Horner's rule (stable for ``|x| <= 1``, no cancellation
  near ``x = 1``). ``multiply`` (exp 1) is the same with ``M`` and
  :math:`\\odot f`, from the same cache (so it is the exact inverse of
  ``multiply_inverse``, with the factors of the last ``update_cache``).
* ``kron_series_2`` (their Option 2, :math:`T \\to \\infty`): with the
  transition :math:`\\Phi = C_1 C_0^{-1}` and
  :math:`\\Psi\\Psi^T = W \\mathrm{diag}(m) W^T`, :math:`K = C_0^{-1/2} W`,

  .. math::
    \\hat F = T\\,(I - \\Phi)^{-1}(V_0 - \\Phi V_0 \\Phi^T)(I - \\Phi^T)^{-1},
    \\quad \\Phi = \\Phi_A \\otimes \\Phi_G,\\ V_0 = A_0 \\otimes G_0,

  :math:`\\hat F^{-1} = \\frac{1}{T}(I - \\Phi^T)(K_A \\otimes K_G)
  \\mathrm{diag}(1 / (1 - m_A m_G^T))(K_A \\otimes K_G)^T (I - \\Phi)`.
  This is TF K-FAC's recursion read forwards in time (TF regresses
  :math:`c_t` on :math:`c_{t+1}`; both give the same :math:`\\hat F` for a
  stationary AR(1) process). Only the inverse is available.

With :math:`C_1 = 0` both reduce to ``kron_indep``, :math:`(T A_0 \\otimes
G_0)^{-1}`. Only ``damping_type="pi"``; only exp -1 (and exp 1 for
``kron_series_1``); no Cholesky factors.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.layer import Layer


class SeriesState(NamedTuple):
  a0: jnp.ndarray       # [d_a, d_a] E[a_t a_tᵀ] over T·B rows
  a1: jnp.ndarray       # [d_a, d_a] Σ_t a_{t+1} a_tᵀ / (T·B)
  g0: jnp.ndarray       # [d_g, d_g]
  g1: jnp.ndarray       # [d_g, d_g]
  weight: jnp.ndarray   # [] total EMA weight
  damping: jnp.ndarray  # [] damping at the last update_cache
  cache: dict           # option 1: a_l, a_m, g_l, g_m, f; option 2: see below


def series_sum(x, t: int):
  """:math:`f(x) = \\sum_{i,j=1}^t x^{|i-j|} = t + 2\\sum_{k=1}^{t-1}(t-k)x^k`.

  Horner's rule on :math:`h(x) = \\sum_{k=1}^{t-1} (t-k) x^{k-1}`,
  :math:`f = t + 2 x h`; a ``fori_loop`` of ``t - 2`` steps.
  """
  if t == 1:
    return jnp.ones_like(x)
  h = jax.lax.fori_loop(2, t, lambda j, h: j + x * h, jnp.ones_like(x))
  return t + 2.0 * x * h


def _inv_sqrt_and_sqrt(c0, damping):
  s, u = linalg.safe_eigh(c0)
  s = s + damping
  return (u * jax.lax.rsqrt(s)[None, :]) @ u.T, (u * jnp.sqrt(s)[None, :]) @ u.T


def _pinv_sqrt_and_sqrt(c0):
  """Pseudo-inverse square root and square root (undamped factors)."""
  s, u = linalg.safe_eigh(c0)
  tol = jnp.finfo(s.dtype).eps * c0.shape[0] * jnp.max(s)
  inv = jnp.where(s > tol, jax.lax.rsqrt(jnp.where(s > tol, s, 1.0)), 0.0)
  return (u * inv[None, :]) @ u.T, (u * jnp.sqrt(s)[None, :]) @ u.T


def _option1_factor(c0, c1, damping, undamped=False):
  """``(L, M, ψ)`` for one factor (Option 1)."""
  if undamped:
    isq, sq = _pinv_sqrt_and_sqrt(c0)
  else:
    isq, sq = _inv_sqrt_and_sqrt(c0, damping)
  psi, u = linalg.eigh(linalg.symmetrize(isq @ linalg.symmetrize(c1) @ isq))
  return isq @ u, sq @ u, jnp.clip(psi, -1.0, 1.0)


def _option2_factor(c0, c1, damping):
  """``(K, Φ, m)`` for one factor (Option 2)."""
  isq, _ = _inv_sqrt_and_sqrt(c0, damping)
  psi = isq @ c1 @ isq
  m, w = linalg.eigh(linalg.symmetrize(psi @ psi.T))
  return isq @ w, c1 @ (isq @ isq), jnp.clip(m, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class SeriesBlock(base.Shorthands, base.UnfusedProducts, base.FieldFactors):
  """``kron_series_1`` (option=1) or ``kron_series_2`` (option=2)."""
  layer: Layer
  config: base.BlockConfig
  layout: layouts.DenseLayout
  option: int
  needs_param_grads = False
  factor_fields = ("a0", "a1", "g0", "g1")

  @property
  def _t(self) -> int:
    return self.layout.num_uses

  @property
  def _approx(self) -> str:
    return f"kron_series_{self.option}"

  def init(self) -> SeriesState:
    dt = linalg.factor_dtype()
    da, dg = self.layout.a_dim, self.layout.g_dim
    z = lambda *s: jnp.zeros(s, dt)  # noqa: E731
    if self.option == 1:
      cache = {"a_l": z(da, da), "a_m": z(da, da), "g_l": z(dg, dg),
               "g_m": z(dg, dg), "f": z(da, dg)}
    else:
      cache = {"a_k": z(da, da), "a_phi": z(da, da), "a_m": z(da),
               "g_k": z(dg, dg), "g_phi": z(dg, dg), "g_m": z(dg)}
    return SeriesState(a0=z(da, da), a1=z(da, da), g0=z(dg, dg),
                       g1=z(dg, dg), weight=z(), damping=z(), cache=cache)

  def _sequences(self, data):
    """Inputs ``[B, T, d_a]`` and grads ``[S, B, T, d_g]`` in time order."""
    dt = linalg.factor_dtype()
    lay = self.layout
    x = jnp.concatenate([inp[0].reshape(inp[0].shape[0], -1, lay.d_in)
                         for inp in data.inputs], axis=1).astype(dt)
    if lay.has_bias:
      x = layouts.append_ones(x)
    g = jnp.concatenate([gr.reshape(gr.shape[:2] + (-1, lay.d_out))
                         for gr in data.grads], axis=2).astype(dt)
    if x.shape[1] != self._t:
      raise ValueError(
          f"Layer {base.layer_name(self)!r} ({self._approx}) was scanned with "
          f"{self._t} uses per example, but the data has {x.shape[1]}. The "
          "number of time steps must be static; scan() again for this "
          "sequence length.")
    return x, g

  def compute_stats(self, data: base.LayerData) -> dict:
    x, g = self._sequences(data)
    n = x.shape[0] * x.shape[1]
    lag = lambda z, e: jnp.einsum(e, z[..., 1:, :], z[..., :-1, :]) / n  # noqa
    return {
        "a0": linalg.symmetrize(jnp.einsum("btd,bte->de", x, x)) / n,
        "a1": lag(x, "btd,bte->de"),
        "g0": linalg.symmetrize(jnp.einsum("sbtd,sbte->de", g, g)) / n,
        "g1": lag(g, "sbtd,sbte->de")}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, self.factor_fields, stats, ema_decay)

  def update_cache(self, state, damping):
    damping = jnp.asarray(damping, linalg.factor_dtype())
    da, dg = linalg.pi_adjusted_damping(state.a0, state.g0, damping / self._t)
    if self.option == 1:
      la, ma, pa = _option1_factor(state.a0, state.a1, da)
      lg, mg, pg = _option1_factor(state.g0, state.g1, dg)
      cache = {"a_l": la, "a_m": ma, "g_l": lg, "g_m": mg,
               "f": series_sum(pa[:, None] * pg[None, :], self._t)}
    else:
      ka, phia, mua = _option2_factor(state.a0, state.a1, da)
      kg, phig, mug = _option2_factor(state.g0, state.g1, dg)
      cache = {"a_k": ka, "a_phi": phia, "a_m": mua, "g_k": kg,
               "g_phi": phig, "g_m": mug}
    return state._replace(cache=cache, damping=damping)

  def _unsupported(self, what):
    base.unsupported(
        self, what, self._approx,
        "exp -1 and 1" if self.option == 1 else "exp -1",
        "Martens, Ba & Johnson 2018 give a closed form for the inverse",
        "Use approx='kron_indep' for other powers or Cholesky factors.")

  def multiply_matpower(self, state, v, exp):
    """``F̂^{-1} v`` (and ``F̂ v`` for option 1), from the cache."""
    exp = base.check_exp(self, exp)
    m = self.layout.to_mat(v)
    ch = state.cache
    if self.option == 1 and exp in (1.0, -1.0):
      left, right = (ch["a_l"], ch["g_l"]) if exp < 0 else (ch["a_m"],
                                                             ch["g_m"])
      z = (left.T @ m @ right) * jnp.power(ch["f"], exp)
      return self.layout.from_mat(left @ z @ right.T, v)
    if self.option == 2 and exp == -1.0:
      pa, pg = ch["a_phi"], ch["g_phi"]
      ka, kg = ch["a_k"], ch["g_k"]
      z = m - pa @ m @ pg.T
      z = (ka.T @ z @ kg) / (1.0 - ch["a_m"][:, None] * ch["g_m"][None, :])
      z = ka @ z @ kg.T
      z = z - pa.T @ z @ pg
      return self.layout.from_mat(z / self._t, v)
    self._unsupported(f"multiply_matpower(exp={exp:g})")

  def multiply_cholesky(self, state, v, transpose=False):
    self._unsupported("multiply_cholesky")

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    self._unsupported("multiply_cholesky_inverse")

  def full_fisher_block(self, state):
    """The undamped :math:`\\hat F` (pseudo-inverses where singular)."""
    if self.option == 1:
      _, ma, pa = _option1_factor(state.a0, state.a1, None, undamped=True)
      _, mg, pg = _option1_factor(state.g0, state.g1, None, undamped=True)
      m = jnp.kron(ma, mg)
      f = series_sum(pa[:, None] * pg[None, :], self._t).reshape(-1)
      return (m * f[None, :]) @ m.T
    isa, _ = _pinv_sqrt_and_sqrt(state.a0)
    isg, _ = _pinv_sqrt_and_sqrt(state.g0)
    phi = jnp.kron(state.a1 @ isa @ isa, state.g1 @ isg @ isg)
    v0 = jnp.kron(state.a0, state.g0)
    eye = jnp.eye(v0.shape[0], dtype=v0.dtype)
    inner = v0 - phi @ v0 @ phi.T
    left = linalg.solve(eye - phi, inner)
    return self._t * linalg.solve(eye - phi, left.T).T


def series_block(layer: Layer, config: base.BlockConfig) -> SeriesBlock:
  """``kron_series_1`` / ``kron_series_2`` block of a multi-use dense layer.

  Raises:
    ValueError: for ``damping_type="exact"`` or a kernel that is not 2-D.
  """
  block = kronecker.dense_block(layer, config)
  if config.damping_type != "pi":
    raise ValueError(
        f"Layer {layer.name!r}: approximation {layer.approx!r} supports "
        f"damping_type='pi' only, got {config.damping_type!r}. Use "
        "approx='kron_indep' for this layer, or damping_type='pi'.")
  return SeriesBlock(layer=layer, config=config, layout=block.layout,
                     option=int(layer.approx[-1]))
