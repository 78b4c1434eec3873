"""Kronecker-factored blocks: ``F ≈ c · A ⊗ G`` (K-FAC, KFC, kron_indep).

One final :class:`KroneckerBlock` serves every layer kind whose Fisher block
is approximated by a scaled Kronecker product; a small *layout* object says
how the layer's parameters become the ``[d_a, d_g]`` matrix ``V`` and how the
factors' minibatch statistics are formed:

* dense (Martens & Grosse 2015, eq. 1-3): :math:`A = E[\\bar a \\bar a^T]`
  over examples (and uses), :math:`G = E[g g^T]`, ``c`` = number of uses;
* multi-use dense, ``kron_indep`` (Martens, Ba & Johnson 2018, sec. 3.1):
  the same averages over the ``T`` uses, ``c = T``.

Either factor may be kept diagonal (``kron_in_diag``, ``kron_out_diag``,
``kron_both_diag``), stored as a vector.

Damping (TF K-FAC semantics): with :math:`\\lambda' = \\lambda / c`,
``damping_type="pi"`` uses :math:`c (A + \\pi\\sqrt{\\lambda'} I) \\otimes
(G + \\sqrt{\\lambda'}/\\pi I)`; ``damping_type="exact"`` uses
:math:`c A \\otimes G + \\lambda I` through eigendecompositions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.collection import Layer


class KroneckerState(NamedTuple):
  a: jnp.ndarray        # [d_a, d_a], or [d_a] for a diagonal input factor
  g: jnp.ndarray        # [d_g, d_g], or [d_g]
  weight: jnp.ndarray   # [] total EMA weight (zero-debiasing)
  damping: jnp.ndarray  # [] the damping given to the last update_cache
  cache: dict           # name -> array (powers, Cholesky, eigenbases)


@dataclasses.dataclass(frozen=True)
class DenseLayout:
  """Dense (and multi-use dense) parameters as ``V = [w; b]``."""
  d_in: int
  d_out: int
  has_bias: bool
  num_uses: int

  @property
  def a_dim(self) -> int:
    return self.d_in + int(self.has_bias)

  @property
  def g_dim(self) -> int:
    return self.d_out

  @property
  def scale(self) -> int:
    return self.num_uses

  def to_mat(self, v: tuple):
    w = v[0].astype(linalg.factor_dtype()).reshape(self.d_in, self.d_out)
    if self.has_bias:
      w = jnp.concatenate([w, v[1].astype(w.dtype).reshape(1, -1)], axis=0)
    return w

  def from_mat(self, m, like: tuple) -> tuple:
    out = (m[: self.d_in],) + ((m[self.d_in],) if self.has_bias else ())
    return base.vector_dtype_cast(out, like)

  def rows(self, data: base.LayerData):
    """Input rows ``[N, d_a]`` and gradient rows ``[S, N, d_g]``."""
    dt = linalg.factor_dtype()
    x = jnp.concatenate([inp[0].reshape(-1, self.d_in).astype(dt)
                         for inp in data.inputs], axis=0)
    if self.has_bias:
      x = jnp.concatenate([x, jnp.ones((x.shape[0], 1), dt)], axis=1)
    g = jnp.concatenate([gr.reshape(gr.shape[0], -1, self.d_out).astype(dt)
                         for gr in data.grads], axis=1)
    return x, g


def _second_moment(rows, diagonal):
  """``rowsᵀ rows / N`` (or its diagonal); ``rows`` is ``[N, d]``."""
  n = rows.shape[0]
  if diagonal:
    return jnp.sum(jnp.square(rows), axis=0) / n
  return linalg.symmetrize(rows.T @ rows) / n


def _source_moment(rows, diagonal):
  """``Σ_s rows_sᵀ rows_s / N`` for ``rows`` of shape ``[S, N, d]``."""
  n = rows.shape[1]
  if diagonal:
    return jnp.sum(jnp.square(rows), axis=(0, 1)) / n
  return linalg.symmetrize(jnp.einsum("snd,sne->de", rows, rows)) / n


@dataclasses.dataclass(frozen=True)
class KroneckerBlock(base.Block):
  """``c · A ⊗ G`` with optional diagonal factors. See the module docstring."""
  layer: Layer
  config: base.BlockConfig
  layout: Any
  a_diagonal: bool = False
  g_diagonal: bool = False
  needs_param_grads = False

  # ---- state -----------------------------------------------------------
  def _factor_zeros(self, dim, diagonal):
    dt = linalg.factor_dtype()
    return jnp.zeros((dim,) if diagonal else (dim, dim), dt)

  def init(self) -> KroneckerState:
    dt = linalg.factor_dtype()
    a = self._factor_zeros(self.layout.a_dim, self.a_diagonal)
    g = self._factor_zeros(self.layout.g_dim, self.g_diagonal)
    cache = {}
    if self.config.damping_type == "exact":
      for name, f in (("a", a), ("g", g)):
        cache[f"{name}_eigval"] = jnp.zeros(f.shape[:1], dt)
        if f.ndim == 2:
          cache[f"{name}_eigvec"] = jnp.zeros_like(f)
    else:
      names = [f"^{e:g}" for e in self.config.cached_exps]
      if self.config.compute_cholesky:
        names.append("_chol")
      if self.config.compute_cholesky_inverse:
        names.append("_chol_inv")
      for n in names:
        cache["a" + n] = jnp.zeros_like(a)
        cache["g" + n] = jnp.zeros_like(g)
    return KroneckerState(a=a, g=g, weight=jnp.zeros((), dt),
                          damping=jnp.zeros((), dt), cache=cache)

  def compute_stats(self, data: base.LayerData) -> dict:
    x, g = self.layout.rows(data)
    return {"a": _second_moment(x, self.a_diagonal),
            "g": _source_moment(g, self.g_diagonal)}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, ("a", "g"), stats, ema_decay)

  def _split_damping(self, state, damping):
    d = damping / self.layout.scale
    return linalg.pi_adjusted_damping(state.a, state.g, d)

  def update_cache(self, state, damping):
    damping = jnp.asarray(damping, linalg.factor_dtype())
    cache = {}
    if self.config.damping_type == "exact":
      for name in ("a", "g"):
        f = getattr(state, name)
        if f.ndim == 1:
          cache[f"{name}_eigval"] = jnp.maximum(f, 0.0)
        else:
          s, u = linalg.safe_eigh(f)
          cache[f"{name}_eigval"], cache[f"{name}_eigvec"] = s, u
      return state._replace(cache=cache, damping=damping)
    da, dg = self._split_damping(state, damping)
    exps = self.config.cached_exps
    for name, f, d in (("a", state.a, da), ("g", state.g, dg)):
      if f.ndim == 2 and (len(exps) > 1 or any(e != -1 for e in exps)):
        # One eigendecomposition serves every registered power.
        s, u = linalg.safe_eigh(f)
        for e in exps:
          cache[f"{name}^{e:g}"] = (u * jnp.power(s + d, e)) @ u.T
      else:
        for e in exps:
          cache[f"{name}^{e:g}"] = linalg.damped_power(f, d, e)
      if self.config.compute_cholesky or self.config.compute_cholesky_inverse:
        chol = linalg.damped_cholesky(f, d)
        if self.config.compute_cholesky:
          cache[f"{name}_chol"] = chol
        if self.config.compute_cholesky_inverse:
          cache[f"{name}_chol_inv"] = linalg.lower_triangular_inverse(chol)
    return state._replace(cache=cache, damping=damping)

  # ---- products --------------------------------------------------------
  def _eig(self, state, name):
    vals = state.cache[f"{name}_eigval"]
    return vals, state.cache.get(f"{name}_eigvec")

  def _rotate(self, v, ua, ug, transpose):
    """``Uaᵀ V Ug`` (transpose=True) or ``Ua V Ugᵀ``; None means identity."""
    if ua is not None:
      v = (ua.T @ v) if transpose else (ua @ v)
    if ug is not None:
      v = (v @ ug) if transpose else (v @ ug.T)
    return v

  def _exact_spectrum(self, state):
    sa, ua = self._eig(state, "a")
    sg, ug = self._eig(state, "g")
    spec = self.layout.scale * sa[:, None] * sg[None, :] + state.damping
    return spec, ua, ug

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    m = self.layout.to_mat(v)
    c = self.layout.scale
    if exp == 1.0:
      if self.config.damping_type == "exact":
        out = c * linalg.matmul_right(linalg.matmul_left(state.a, m), state.g)
        out = out + state.damping * m
      else:
        da, dg = self._split_damping(state, state.damping)
        a = state.a + (da if state.a.ndim == 1 else da * jnp.eye(
            state.a.shape[0], dtype=state.a.dtype))
        g = state.g + (dg if state.g.ndim == 1 else dg * jnp.eye(
            state.g.shape[0], dtype=state.g.dtype))
        out = c * linalg.matmul_right(linalg.matmul_left(a, m), g)
    elif self.config.damping_type == "exact":
      spec, ua, ug = self._exact_spectrum(state)
      out = self._rotate(self._rotate(m, ua, ug, True) * jnp.power(spec, exp),
                         ua, ug, False)
    else:
      out = math.pow(c, exp) * linalg.matmul_right(
          linalg.matmul_left(state.cache[f"a^{exp:g}"], m),
          state.cache[f"g^{exp:g}"])
    return self.layout.from_mat(out, v)

  def _cholesky_product(self, state, v, transpose, inverse):
    m = self.layout.to_mat(v)
    if self.config.damping_type == "exact":
      spec, ua, ug = self._exact_spectrum(state)
      r = jnp.sqrt(spec)
      r = 1.0 / r if inverse else r
      # C = (Ua ⊗ Ug) diag(r): C v = U (r ⊙ V), Cᵀ v = r ⊙ (Uᵀ V).
      # C⁻¹ v = r⁻¹ ⊙ (Uᵀ V), C⁻ᵀ v = U (r⁻¹ ⊙ V).
      if transpose != inverse:
        out = r * self._rotate(m, ua, ug, True)
      else:
        out = self._rotate(r * m, ua, ug, False)
      return self.layout.from_mat(out, v)
    suffix = "_chol_inv" if inverse else "_chol"
    la, lg = state.cache["a" + suffix], state.cache["g" + suffix]
    if transpose:
      la = la if la.ndim == 1 else la.T
    else:
      lg = lg if lg.ndim == 1 else lg.T
    scale = math.pow(self.layout.scale, -0.5 if inverse else 0.5)
    out = scale * linalg.matmul_right(linalg.matmul_left(la, m), lg)
    return self.layout.from_mat(out, v)

  def multiply_cholesky(self, state, v, transpose=False):
    """``C v`` (or ``Cᵀ v``) with ``C Cᵀ`` the damped block."""
    if self.config.damping_type == "pi":
      base.check_cached(self, "compute_cholesky", "multiply_cholesky")
    return self._cholesky_product(state, v, transpose, inverse=False)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    """``C⁻¹ v`` (or ``C⁻ᵀ v``)."""
    if self.config.damping_type == "pi":
      base.check_cached(self, "compute_cholesky_inverse",
                        "multiply_cholesky_inverse")
    return self._cholesky_product(state, v, transpose, inverse=True)

  def full_fisher_block(self, state):
    """``c · kron(A, G)``, undamped, in ravel order of ``(w, b)``."""
    return self.layout.scale * jnp.kron(linalg.as_matrix(state.a),
                                        linalg.as_matrix(state.g))


def dense_block(layer: Layer, config: base.BlockConfig) -> KroneckerBlock:
  """The Kronecker block of a (possibly multi-use) dense layer."""
  w_shape = layer.param_shapes[0]
  # Recognised DenseGeneral kernels [*in_axes, *out_axes] say how many
  # leading axes are inputs; the matrix is the row-major reshape.
  k = layer.meta_dict.get("kernel_in_axes")
  if k is None and len(w_shape) != 2:
    raise ValueError(
        f"Layer {layer.name!r} has kernel shape {w_shape}; a Kronecker block "
        "needs a rank-2 [d_in, d_out] kernel. Register it with "
        "register_generic(...) or pass approx='diagonal'.")
  k = 1 if k is None else k
  layout = DenseLayout(d_in=math.prod(w_shape[:k]),
                       d_out=math.prod(w_shape[k:]),
                       has_bias=layer.has_bias, num_uses=layer.num_uses)
  approx = layer.approx
  return KroneckerBlock(
      layer=layer, config=config, layout=layout,
      a_diagonal=approx in ("kron_in_diag", "kron_both_diag"),
      g_diagonal=approx in ("kron_out_diag", "kron_both_diag"))
