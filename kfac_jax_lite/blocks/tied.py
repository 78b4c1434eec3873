"""Tied embeddings: one table used as a lookup and as the output projection.

A table :math:`W \\in \\mathbb{R}^{V \\times d}` looked up by ids,
:math:`h_t = W^T e_{id_t}`, and reused for the logits, :math:`z_u = W x_u`
(flax ``Embed.attend``, ``x @ table.T``), has the per-example gradient

.. math::
  \\nabla W = \\sum_t e_{id_t} g_t^T + \\sum_u \\delta_u x_u^T,

with :math:`g_t = \\partial \\ell / \\partial h_t \\in \\mathbb{R}^d` and
:math:`\\delta_u = \\partial \\ell / \\partial z_u \\in \\mathbb{R}^V`. The
``kron_sum`` block keeps one K-FAC term per kind of use:

.. math::
  \\hat F = c_e\\, \\mathrm{diag}(a) \\otimes G
          + c_o\\, \\mathrm{diag}(r) \\otimes X,

* lookups (as :mod:`.embedding`): :math:`a = E[e_{id}]` (lookup
  frequencies, the exact diagonal input factor), :math:`G = E[g g^T]`,
  :math:`c_e` = lookups per example;
* attends (a dense layer with kernel :math:`W^T`): :math:`X = E[x x^T]`,
  :math:`r = E[\\delta \\odot \\delta]`, :math:`c_o` = attend positions
  per example.

Assumptions: (i) different uses are uncorrelated, so the cross terms between
positions and between the two kinds of use are dropped (the independence of
``kron_indep``, Martens, Ba & Johnson 2018, sec. 3.1 — but each kind keeps
its own factors instead of pooling two very different kinds of samples);
(ii) within a use, inputs and output gradients are independent (K-FAC,
Martens & Grosse 2015, eq. 1-3); (iii) the ``V x V`` output-gradient factor
:math:`E[\\delta\\delta^T]` of the attend term is replaced by its diagonal,
so nothing of size ``V²`` exists: state and products cost ``O(V d + d²)``
memory and ``O(V d² + d³)`` time.

Both ``V``-side factors are diagonal, so :math:`\\hat F` is block-diagonal
over the table's rows: row ``v`` has the ``d x d`` block
:math:`c_e a_v G + c_o r_v X`. Damping (``damping_type="pi"`` only) is
factored Tikhonov per term with the shared :math:`\\lambda' = \\lambda /
(c_e + c_o)`: term ``t`` becomes :math:`c_t (\\mathrm{diag}(p_t) +
\\gamma_t I) \\otimes (Q_t + \\gamma'_t I)` with the pi-split
:math:`\\gamma_t \\gamma'_t = \\lambda'`, so the damped block is
:math:`\\hat F + \\lambda I` plus the usual factored cross terms. Row ``v``
of the damped block is :math:`M_v = \\alpha_v \\tilde G + \\beta_v \\tilde
X` with :math:`\\alpha = c_e(a + \\gamma_e)`, :math:`\\beta = c_o (r +
\\gamma_o)`. One simultaneous diagonalisation of the pair :math:`(\\tilde
G, \\tilde X)` (Martens & Grosse 2015, appendix B: inverting sums of
Kronecker products), :math:`T^T \\tilde X T = I`, :math:`T^T \\tilde G T =
\\mathrm{diag}(\\mu)`, with :math:`T = U_X \\mathrm{diag}(s_X^{-1/2}) W_N`
(:math:`\\tilde X = U_X \\mathrm{diag}(s_X) U_X^T`, :math:`N = T_0^T
\\tilde G T_0 = W_N \\mathrm{diag}(\\mu) W_N^T`), gives for every row

.. math::
  M_v = T^{-T} \\mathrm{diag}(D_v) T^{-1}, \\qquad
  D_{v j} = \\alpha_v \\mu_j + \\beta_v,

so, with the rows of the table as the rows of ``Y``,
:math:`\\hat F^{-1} Y = ((Y T) \\oslash D) T^T` and the square-root factor
:math:`C = \\mathrm{blockdiag}_v(T^{-T} \\mathrm{diag}(D_v^{1/2}))`:
:math:`C Y = (Y \\odot D^{1/2}) T^{-1}`, :math:`C^T Y = (Y T^{-T}) \\odot
D^{1/2}`, :math:`C^{-1} Y = (Y T) \\oslash D^{1/2}`, :math:`C^{-T} Y = (Y
\\oslash D^{1/2}) T^T` (``C`` is not triangular). ``multiply`` (exp 1)
uses the live factors, as :class:`~.kronecker.KroneckerBlock`. Only exps -1
and 1: other powers of a sum of Kronecker products have no closed form.

Which site is which use is read from the recorded input's dtype: integer
ids are a lookup, a float ``[..., d]`` input an attend.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jax import lax
import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.layer import Layer

_FACTORS = ("lookup_v", "lookup_d", "attend_v", "attend_d", "lookup_scale",
            "attend_scale")


class TiedState(NamedTuple):
  lookup_v: jnp.ndarray      # [V] a = E[e_id], lookup frequencies
  lookup_d: jnp.ndarray      # [d, d] G = E[g gᵀ] over lookups
  attend_v: jnp.ndarray      # [V] r = E[δ ⊙ δ] over attend positions
  attend_d: jnp.ndarray      # [d, d] X = E[x xᵀ] over attend positions
  lookup_scale: jnp.ndarray  # [] c_e, lookups per example
  attend_scale: jnp.ndarray  # [] c_o, attend positions per example
  weight: jnp.ndarray        # [] total EMA weight
  damping: jnp.ndarray       # [] damping at the last update_cache
  cache: dict                # t, t_inv [d, d], mu [d], alpha, beta [V]


def _is_lookup(inputs: tuple) -> bool:
  """A site whose recorded input is integer ids is a lookup, else an attend."""
  return jnp.issubdtype(inputs[0].dtype, jnp.integer)


def _rows(parts, empty_shape, dtype, axis=0):
  """``parts`` concatenated along ``axis`` in ``dtype`` (may be empty)."""
  return jnp.concatenate([jnp.zeros(empty_shape, dtype)] +
                         [p.astype(dtype) for p in parts], axis=axis)


@dataclasses.dataclass(frozen=True)
class TiedEmbeddingBlock(base.Shorthands, base.UnfusedProducts,
                         base.FieldFactors):
  """``c_e diag(a) ⊗ G + c_o diag(r) ⊗ X`` (see the module docstring)."""
  layer: Layer
  config: base.BlockConfig
  vocab: int
  dim: int
  num_uses: int
  needs_param_grads = False
  factor_fields = _FACTORS

  def init(self) -> TiedState:
    dt = linalg.factor_dtype()
    v, d = self.vocab, self.dim
    zero = jnp.zeros((), dt)
    half = jnp.asarray(self.num_uses / 2, dt)
    cache = {"t": jnp.zeros((d, d), dt), "t_inv": jnp.zeros((d, d), dt),
             "mu": jnp.zeros((d,), dt), "alpha": jnp.zeros((v,), dt),
             "beta": jnp.zeros((v,), dt)}
    return TiedState(
        lookup_v=jnp.zeros((v,), dt), lookup_d=jnp.zeros((d, d), dt),
        attend_v=jnp.zeros((v,), dt), attend_d=jnp.zeros((d, d), dt),
        lookup_scale=half, attend_scale=half, weight=zero, damping=zero,
        cache=cache)

  # ---- statistics ------------------------------------------------------
  def compute_stats(self, data: base.LayerData) -> dict:
    dt = linalg.factor_dtype()
    v, d = self.vocab, self.dim
    s = data.grads[0].shape[0]
    sites = list(zip(data.inputs, data.grads))
    look = [(i[0], g) for i, g in sites if _is_lookup(i)]
    att = [(i[0], g) for i, g in sites if not _is_lookup(i)]
    ids = _rows([i.reshape(-1) for i, _ in look], (0,), jnp.int32)
    g = _rows([gr.reshape(s, -1, d) for _, gr in look], (s, 0, d), dt, 1)
    x = _rows([i.reshape(-1, d) for i, _ in att], (0, d), dt)
    delta = _rows([gr.reshape(s, -1, v) for _, gr in att], (s, 0, v), dt, 1)
    n_e, n_o = ids.shape[0], x.shape[0]
    what = f"tied embedding {base.layer_name(self)!r}"
    counts = jnp.zeros((v,), dt).at[ids].add(1.0)
    zero = jnp.zeros((d, d), dt)
    return {
        "lookup_v": counts / max(n_e, 1),
        "lookup_d": layouts.source_moment(g, False) if n_e else zero,
        "attend_v": jnp.sum(jnp.square(delta), axis=(0, 1)) / max(n_o, 1),
        "attend_d": layouts.second_moment(x, False) if n_o else zero,
        "lookup_scale": jnp.asarray(
            base.rows_per_example(n_e, data.batch_size, what), dt),
        "attend_scale": jnp.asarray(
            base.rows_per_example(n_o, data.batch_size, what), dt)}

  def update_curvature(self, state, stats, ema_decay):
    return base.ema_update(state, _FACTORS, stats, ema_decay)

  # ---- damping and cache ------------------------------------------------
  def _damped(self, state, damping):
    """``(α, G̃, β, X̃)``: the damped row coefficients and d-side factors."""
    c_e, c_o = state.lookup_scale, state.attend_scale
    lam = damping / (c_e + c_o)
    eye = jnp.eye(self.dim, dtype=state.lookup_d.dtype)
    out = []
    for c, fv, fd in ((c_e, state.lookup_v, state.lookup_d),
                      (c_o, state.attend_v, state.attend_d)):
      gv, gd = linalg.pi_adjusted_damping(fv, fd, lam)
      out += [c * (jnp.maximum(fv, 0.0) + gv),
              linalg.symmetrize(fd) + gd * eye]
    return tuple(out)

  def update_cache(self, state, damping):
    damping = jnp.asarray(damping, linalg.factor_dtype())
    alpha, g, beta, x = self._damped(state, damping)
    sx, ux = linalg.safe_eigh(x)
    t0 = ux * lax.rsqrt(sx)[None, :]
    mu, wn = linalg.safe_eigh(t0.T @ g @ t0)
    t = t0 @ wn
    t_inv = (wn.T * jnp.sqrt(sx)[None, :]) @ ux.T
    cache = {"t": t, "t_inv": t_inv, "mu": mu, "alpha": alpha, "beta": beta}
    return state._replace(cache=cache, damping=damping)

  def _spectrum(self, state):
    """``D = α μᵀ + β``: ``[V, d]``, the row blocks' diagonal after T."""
    ch = state.cache
    return ch["alpha"][:, None] * ch["mu"][None, :] + ch["beta"][:, None]

  # ---- products ----------------------------------------------------------
  def _mat(self, v):
    return v[0].astype(linalg.factor_dtype()).reshape(self.vocab, self.dim)

  def multiply_matpower(self, state, v, exp):
    """``F̂^exp v`` for exp 1 (live factors) and -1 (cache)."""
    exp = base.check_exp(self, exp)
    y = self._mat(v)
    if exp == 1.0:
      alpha, g, beta, x = self._damped(state, state.damping)
      out = alpha[:, None] * (y @ g) + beta[:, None] * (y @ x)
    elif exp == -1.0:
      t = state.cache["t"]
      out = ((y @ t) / self._spectrum(state)) @ t.T
    else:
      base.unsupported(
          self, f"multiply_matpower(exp={exp:g})", "kron_sum", "exps -1 and 1",
          "a sum of two Kronecker products has no closed-form matrix powers")
    return base.vector_dtype_cast((out,), v)

  def multiply_cholesky(self, state, v, transpose=False):
    """``C v`` (``Cᵀ v``) with ``C Cᵀ`` the damped block (not triangular)."""
    y, root = self._mat(v), jnp.sqrt(self._spectrum(state))
    t_inv = state.cache["t_inv"]
    out = (y @ t_inv.T) * root if transpose else (y * root) @ t_inv
    return base.vector_dtype_cast((out,), v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    """``C⁻¹ v`` (``C⁻ᵀ v``) for the factor of :meth:`multiply_cholesky`."""
    y, root = self._mat(v), jnp.sqrt(self._spectrum(state))
    t = state.cache["t"]
    out = (y / root) @ t.T if transpose else (y @ t) / root
    return base.vector_dtype_cast((out,), v)

  def full_fisher_block(self, state):
    """``c_e diag(a) ⊗ G + c_o diag(r) ⊗ X``, undamped (small V only)."""
    return (state.lookup_scale * jnp.kron(jnp.diag(state.lookup_v),
                                          state.lookup_d) +
            state.attend_scale * jnp.kron(jnp.diag(state.attend_v),
                                          state.attend_d))


def tied_embedding_block(layer: Layer, config: base.BlockConfig):
  """The ``kron_sum`` block of a ``[vocab, d]`` table used by lookups and as
  a transposed output projection.

  Raises:
    ValueError: for a table that is not one 2-D array, or
      ``damping_type="exact"``.
  """
  shape = layer.param_shapes[0]
  if len(layer.param_shapes) != 1 or len(shape) != 2:
    raise ValueError(
        f"Layer {layer.name!r} has parameter shapes {layer.param_shapes}; a "
        "tied embedding is one [vocab, d] table.")
  if config.damping_type != "pi":
    raise ValueError(
        f"Layer {layer.name!r}: approximation 'kron_sum' (tied embedding) "
        f"supports damping_type='pi' only, got {config.damping_type!r}. Use "
        "damping_type='pi', or untie the table.")
  return TiedEmbeddingBlock(layer=layer, config=config, vocab=shape[0],
                            dim=shape[1], num_uses=layer.num_uses)
