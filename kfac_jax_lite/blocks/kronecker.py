"""Kronecker-factored blocks: ``F ≈ c · A ⊗ G`` (K-FAC, KFC, kron_indep).

One final :class:`KroneckerBlock` serves every layer kind whose Fisher block
is approximated by a scaled Kronecker product; a small *layout* object says
how the layer's parameters become the ``[d_a, d_g]`` matrix ``V`` and how the
factors' minibatch statistics are formed:

* dense (Martens & Grosse 2015, eq. 1-3): :math:`A = E[\\bar a \\bar a^T]`
  over examples (and uses), :math:`G = E[g g^T]`, ``c`` = number of uses;
* multi-use dense, ``kron_indep`` (Martens, Ba & Johnson 2018, sec. 3.1;
  K-FAC-expand of Eschenhagen et al. 2023): the same averages over the
  ``T`` uses, ``c = T``;
* multi-use dense, ``kron_reduce`` (K-FAC-reduce, Eschenhagen et al. 2023):
  per example the mean input and the summed output gradient over the
  uses, ``c = 1`` (:class:`.layouts.ReduceDenseLayout`);
* convolutions (KFC, Grosse & Martens 2016, eq. 23): patches over examples
  and locations, ``c`` = locations x uses (:mod:`.conv`);
* embeddings: a diagonal input factor of lookup frequencies
  (:mod:`.embedding`).

The layouts, and the row statistics they share, are in :mod:`.layouts`;
this module is the block: its state, the damped refresh of its factors'
caches and the products with ``c · A ⊗ G``.

Either factor may be kept diagonal (``kron_in_diag``, ``kron_out_diag``,
``kron_both_diag``), stored as a vector.

A dense layout's factors may average every ``k``-th of their rows only,
from an offset drawn at each statistics pass
(``BlockConfig.stats_position_stride``, :func:`.layouts.strided_rows`): an
unbiased estimate of ``A`` and ``G`` whose products cost ``k`` times fewer
flops.

Damping (TF K-FAC semantics): with :math:`\\lambda' = \\lambda / c`,
``damping_type="pi"`` uses :math:`c (A + \\pi\\sqrt{\\lambda'} I) \\otimes
(G + \\sqrt{\\lambda'}/\\pi I)`; ``damping_type="exact"`` uses
:math:`c A \\otimes G + \\lambda I` through eigendecompositions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

from jax import lax
import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.layer import Layer


# The stride of dense factors' rows when ``stats_position_stride`` is None,
# per platform (chosen when lowering): every row on CPU, where the race of
# docs/transformers.md was measured with every row; every 4th elsewhere
# (tests/test_statistics_cost.py measures what it saves).
PLATFORM_STRIDES = {"cpu": 1, "default": 4}


class KroneckerState(NamedTuple):
  a: jnp.ndarray        # [d_a, d_a], or [d_a] for a diagonal input factor
  g: jnp.ndarray        # [d_g, d_g], or [d_g]
  weight: jnp.ndarray   # [] total EMA weight (zero-debiasing)
  scale: jnp.ndarray    # [] c = rows per example (locations x uses), EMA
  damping: jnp.ndarray  # [] the damping given to the last update_cache
  cache: dict           # name -> array (powers, Cholesky, eigenbases)


def _add_diag(f, d):
  """``f + d I`` for a matrix, ``f + d`` for a diagonal stored as a vector."""
  if f.ndim == 1:
    return f + d
  return f + d * jnp.eye(f.shape[0], dtype=f.dtype)


@dataclasses.dataclass(frozen=True)
class KroneckerBlock(base.Shorthands, base.FieldFactors):
  """``c · A ⊗ G`` with optional diagonal factors. See the module docstring.

  Besides :class:`~.base.Block` it has every capability:
  :class:`~.base.CholeskyProducts`, :class:`~.base.FactorBucketed` and
  :class:`~.base.FusedProduct` (its product is the ``[d_a, d_g]`` matrix).
  """
  layer: Optional[Layer]  # None for a part of another block
  config: base.BlockConfig
  layout: Any
  a_diagonal: bool = False
  g_diagonal: bool = False
  needs_param_grads = False
  factor_fields = ("a", "g", "scale")

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
                          scale=jnp.asarray(self.layout.init_scale, dt),
                          damping=jnp.zeros((), dt), cache=cache)

  def compute_stats(self, data: base.LayerData) -> dict:
    """The layout's factor statistics; a dense layout's from every
    ``k``-th row when ``config.stats_position_stride`` is ``k > 1`` and
    ``data.row_draw`` is given (:func:`.layouts.strided_rows`), ``k``
    chosen when lowering if the stride is None (:data:`PLATFORM_STRIDES`).
    """
    stride = self.config.stats_position_stride
    if (stride == 1 or data.row_draw is None
        or not isinstance(self.layout, layouts.DenseLayout)):
      return self.layout.factor_stats(data, self.a_diagonal, self.g_diagonal)
    strided = lambda k: lambda: self.layout.factor_stats(  # noqa: E731
        data, self.a_diagonal, self.g_diagonal, k)
    if stride is not None:
      return strided(stride)()
    return lax.platform_dependent(
        default=strided(PLATFORM_STRIDES["default"]),
        **{p: strided(k) for p, k in PLATFORM_STRIDES.items()
           if p != "default"})

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, self.factor_fields, stats, ema_decay)

  def update_cache(self, state, damping):
    damping = jnp.asarray(damping, linalg.factor_dtype())
    if self.config.damping_type == "exact":
      cache = {}
      for name in ("a", "g"):
        f = getattr(state, name)
        if f.ndim == 1:
          cache[f"{name}_eigval"] = jnp.maximum(f, 0.0)
        else:
          s, u = linalg.safe_eigh(f)
          cache[f"{name}_eigval"], cache[f"{name}_eigvec"] = s, u
      return state._replace(cache=cache, damping=damping)
    requests = self.factor_requests(state)
    dampings = self.factor_dampings(state, damping, {
        name: linalg.trace_norm(f) for name, f in requests})
    return self.with_factor_caches(state, damping, {
        name: self.factor_cache(f, dampings[name]) for name, f in requests})

  # ---- the "pi" refresh, factor by factor ------------------------------
  # FisherEstimator.update_cache refreshes the dense factors of all such
  # blocks together, in size buckets (linalg.bucketed_map); the result
  # is the same as update_cache's.

  @property
  def factor_options(self) -> tuple:
    """``(exps, compute_cholesky, compute_cholesky_inverse)`` of
    :meth:`factor_cache`: factors with equal options can share a bucket."""
    return (self.config.cached_exps, self.config.compute_cholesky,
            self.config.compute_cholesky_inverse)

  def factor_cache(self, f, d) -> dict:
    """One factor's cache ``{"^e": (f + d I)^e, "_chol", "_chol_inv"}``
    (:func:`linalg.damped_factor_cache`, with this block's options).

    For a matrix ``f`` every entry is a matrix function of ``f`` alone
    (given ``d``): padding ``f`` block-diagonally with an identity pads the
    results the same way, so factors of nearby sizes can be refreshed as
    one padded size (:func:`linalg.bucketed_map`)."""
    return linalg.damped_factor_cache(f, d, *self.factor_options)

  def factor_requests(self, state) -> tuple:
    """``((name, matrix), ...)``: the dense factors of a ``"pi"`` refresh.

    Diagonal factors (vectors) are not requested: :meth:`with_factor_caches`
    refreshes them itself (elementwise, nothing to batch).
    """
    if self.config.damping_type != "pi":
      raise ValueError("factor_requests is for damping_type='pi' only.")
    dt = linalg.factor_dtype()
    return tuple((name, f.astype(dt)) for name, f in
                 (("a", state.a), ("g", state.g)) if f.ndim == 2)

  def factor_dampings(self, state, damping, trace_norms: dict) -> dict:
    """``{"a": d_a, "g": d_g}``: λ split between the factors.

    Pi-adjusted (:func:`linalg.pi_split`) with :math:`\\lambda' = \\lambda /
    c`: ``c (A + d_a I) ⊗ (G + d_g I)``, :math:`d_a = \\pi
    \\sqrt{\\lambda'}`, :math:`d_g = \\sqrt{\\lambda'} / \\pi`,
    :math:`\\pi^2 = \\frac{\\mathrm{tr} A / \\dim A}{\\mathrm{tr} G / \\dim G}`.

    Args:
      state: the block state.
      damping: λ.
      trace_norms: ``tr(F) / dim F`` of any factor already known (the
        others are computed here).
    """
    damping = jnp.asarray(damping, linalg.factor_dtype())
    norms = {n: trace_norms[n] if n in trace_norms
             else linalg.trace_norm(getattr(state, n)) for n in ("a", "g")}
    da, dg = linalg.pi_split(norms["a"], norms["g"], damping / state.scale)
    return {"a": da, "g": dg}

  def with_factor_caches(self, state, damping, caches: dict,
                         dampings: Optional[dict] = None):
    """The refreshed state from the dense factors' caches.

    Args:
      state: the block state.
      damping: λ given to the refresh (stored in ``state.damping``).
      caches: ``{name: factor_cache(f, d_name)}`` for every
        :meth:`factor_requests` entry, ``d`` from :meth:`factor_dampings`
        (computed in any way: alone, or padded in a bucket).
      dampings: ``factor_dampings(state, damping, ...)`` when the caller
        has it (for the diagonal factors; computed here otherwise).

    Returns:
      ``state`` with the cache ``update_cache`` writes: keys ``"a^e"``,
      ``"g^e"``, ``"a_chol"``, ``"a_chol_inv"``, ... as configured.
    """
    damping = jnp.asarray(damping, linalg.factor_dtype())
    caches = dict(caches)
    missing = [n for n in ("a", "g") if n not in caches]
    if missing:  # Diagonal factors: elementwise.
      d = dampings or self.factor_dampings(state, damping, {})
      for n in missing:
        caches[n] = self.factor_cache(getattr(state, n), d[n])
    cache = {}
    for name in ("a", "g"):
      cache.update({name + k: v for k, v in caches[name].items()})
    return state._replace(cache=cache, damping=damping)

  # ---- products --------------------------------------------------------
  def _eig(self, state, name):
    vals = state.cache[f"{name}_eigval"]
    return vals, state.cache.get(f"{name}_eigvec")

  def _exact_spectrum(self, state):
    sa, ua = self._eig(state, "a")
    sg, ug = self._eig(state, "g")
    spec = state.scale * sa[:, None] * sg[None, :] + state.damping
    return spec, ua, ug

  def multiply_matpower(self, state, v, exp):
    """``F̂^exp v``; ``exp=1`` uses the live factors and the last damping."""
    return self.finish_product(self.multiply_matpower_raw(state, v, exp), v)

  def finish_product(self, raw, like):
    return self.layout.from_mat(raw, like)

  def product_input(self, v):
    return self.layout.to_mat(v)

  def multiply_matpower_raw(self, state, v, exp):
    """``F̂^exp v`` as the ``[d_a, d_g]`` matrix (see
    :class:`base.FusedProduct`); ``v`` is the parameter tuple or its
    :meth:`product_input`."""
    exp = base.check_exp(self, exp)
    m = self.product_input(v) if isinstance(v, tuple) else v
    c = state.scale
    if exp == 1.0:
      if self.config.damping_type == "exact":
        out = c * linalg.matmul_right(linalg.matmul_left(state.a, m), state.g)
        out = out + state.damping * m
      else:
        d = self.factor_dampings(state, state.damping, {})
        out = c * linalg.matmul_right(
            linalg.matmul_left(_add_diag(state.a, d["a"]), m),
            _add_diag(state.g, d["g"]))
    elif self.config.damping_type == "exact":
      spec, ua, ug = self._exact_spectrum(state)
      rotated = linalg.rotate(m, ua, ug, True)
      out = linalg.rotate(rotated * jnp.power(spec, exp), ua, ug, False)
    else:
      out = jnp.power(c, exp) * linalg.matmul_right(
          linalg.matmul_left(state.cache[f"a^{exp:g}"], m),
          state.cache[f"g^{exp:g}"])
    return out

  def _cholesky_product(self, state, v, transpose, inverse):
    m = self.layout.to_mat(v)
    if self.config.damping_type == "exact":
      spec, ua, ug = self._exact_spectrum(state)
      return self.layout.from_mat(
          linalg.eigenbasis_cholesky(m, spec, ua, ug, transpose, inverse),
          v)
    suffix = "_chol_inv" if inverse else "_chol"
    la, lg = state.cache["a" + suffix], state.cache["g" + suffix]
    if transpose:
      la = la if la.ndim == 1 else la.T
    else:
      lg = lg if lg.ndim == 1 else lg.T
    scale = jnp.power(state.scale, -0.5 if inverse else 0.5)
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
    """``c · kron(A, G)``, undamped, in ravel order of the params."""
    f = state.scale * jnp.kron(linalg.as_matrix(state.a),
                               linalg.as_matrix(state.g))
    return layouts.to_ravel_order(f, self.layout.ravel_index())


def dense_block(layer: Layer, config: base.BlockConfig) -> KroneckerBlock:
  """The Kronecker block of a (possibly multi-use) dense layer."""
  d_in, d_out, perm = layouts.dense_dims(layer)
  layout = layouts.DenseLayout(
      d_in=d_in, d_out=d_out, has_bias=layer.has_bias,
      num_uses=layer.num_uses, kernel_perm=perm,
      kernel_shape=tuple(layer.param_shapes[0]) if perm is not None
      else None)
  approx = layer.approx
  return KroneckerBlock(
      layer=layer, config=config, layout=layout,
      a_diagonal=approx in ("kron_in_diag", "kron_both_diag"),
      g_diagonal=approx in ("kron_out_diag", "kron_both_diag"))


def dense_reduce_block(layer: Layer, config: base.BlockConfig
                       ) -> KroneckerBlock:
  """The K-FAC-reduce block of a dense layer
  (:class:`.layouts.ReduceDenseLayout`)."""
  expand = dense_block(layer, config)
  lay = expand.layout
  return dataclasses.replace(expand, layout=layouts.ReduceDenseLayout(
      d_in=lay.d_in, d_out=lay.d_out, has_bias=lay.has_bias,
      num_uses=lay.num_uses, kernel_perm=lay.kernel_perm,
      kernel_shape=lay.kernel_shape))
