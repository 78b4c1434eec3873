"""Kronecker layouts: a layer's parameters as the matrix ``V`` of a block.

A :class:`~.kronecker.KroneckerBlock` approximates a layer's Fisher block
by ``c · A ⊗ G`` over the ``[d_a, d_g]`` matrix ``V`` of its parameters; a
*layout* says how the parameters become ``V`` and back, and how the
factors' minibatch statistics are formed from the layer's inputs and
output gradients. A layout has ``a_dim``, ``g_dim``, ``init_scale`` (``c``
before the first update), ``to_mat(v)``, ``from_mat(m, like)``,
``ravel_index()`` (where each matrix entry sits in ``ravel_pytree`` order,
or None when the orders agree) and ``factor_stats(data, a_diagonal,
g_diagonal) -> {"a", "g", "scale"}``. ``c`` is a statistic too (``rows /
B``, e.g. the number of conv output locations, known only from the data).

Here are the dense layouts (:class:`DenseLayout`, K-FAC and
``kron_indep``; :class:`ReduceDenseLayout`, ``kron_reduce``), the bare
matrix (:class:`MatrixLayout`), and the statistics every layout shares:
second moments of rows (:func:`second_moment`, :func:`source_moment`,
:func:`kron_stats`) and their unbiased strided estimate
(:func:`strided_rows`). The convolution and embedding layouts are in
:mod:`.conv` and :mod:`.embedding`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from jax import lax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.layer import Layer

def second_moment(rows, diagonal, count=None):
  """``rowsᵀ rows / N`` (or its diagonal); ``rows`` is ``[n, d]``, ``N``
  the ``count`` they stand for (default ``n``).

  Not symmetrised here: every consumer of a factor's inverse or
  eigenbasis symmetrises it once per refresh (:mod:`kfac_jax_lite.linalg`),
  which saves a pass over every factor at every step
  (docs/performance.md#unsymmetrised-factors). The rows are scaled by
  ``1/√N`` before the product, where the scaling fuses into the kernel that
  makes them (one kernel less per factor to compile).
  """
  n = rows.shape[0] if count is None else count
  if diagonal:
    return jnp.sum(jnp.square(rows), axis=0) / n
  rows = rows * (1.0 / math.sqrt(n))
  return rows.T @ rows


def source_moment(rows, diagonal, count=None):
  """``Σ_s rows_sᵀ rows_s / N`` for ``rows`` of shape ``[S, n, d]`` (``N``
  as in :func:`second_moment`; not symmetrised either)."""
  n = rows.shape[1] if count is None else count
  if diagonal:
    return jnp.sum(jnp.square(rows), axis=(0, 1)) / n
  # One [S n, d] matrix, as second_moment's: XLA:CPU emits rowsᵀ rows
  # with the transpose folded into the product, where the einsum over two
  # contracted axes first copied the rows into a transposed layout.
  rows = rows.reshape(-1, rows.shape[-1]) * (1.0 / math.sqrt(n))
  return rows.T @ rows


def strided_rows(rows, axis, stride, draw):
  """Rows ``o, o + k, o + 2k, ...`` of ``rows`` along ``axis``.

  ``k = min(stride, N)`` for ``N`` rows, zero rows appended up to a
  multiple of ``k``, and the offset ``o = ⌊k·u⌋`` from the uniform draw
  ``u ∈ (0, 1)``. Every row is in exactly one of the ``k`` offset classes,
  so each enters with probability ``1/k`` and, for any function ``f`` of
  the rows (``f(0) = 0``),

  .. math::
    \\mathbb{E}_o\\Big[\\frac{k}{N} \\sum_{j} f(x_{o + jk})\\Big]
    = \\frac{1}{N} \\sum_{n=1}^{N} f(x_n):

  the strided mean with count ``N/k`` is an unbiased estimate of the mean
  over all rows (systematic sampling; Cochran 1977, "Sampling
  Techniques", ch. 8). ``⌊k·u⌋`` is exactly uniform for ``k`` a power of
  two (``u`` has 24 random bits), otherwise within ``2⁻²⁴``.

  Returns:
    ``(rows', N / k)``: the selected rows (``⌈N/k⌉`` along ``axis``) and
    the count they stand for.
  """
  n = rows.shape[axis]
  k = max(1, min(int(stride), n))
  if k == 1:
    return rows, n
  m = -(-n // k)
  if m * k != n:
    pad = [(0, 0)] * rows.ndim
    pad[axis] = (0, m * k - n)
    rows = jnp.pad(rows, pad)
  shape = rows.shape[:axis] + (m, k) + rows.shape[axis + 1:]
  offset = jnp.minimum(jnp.floor(draw * k).astype(jnp.int32), k - 1)
  picked = lax.dynamic_index_in_dim(rows.reshape(shape), offset,
                                    axis=axis + 1, keepdims=False)
  return picked, n / k


def kron_stats(x, g, batch_size, a_diagonal, g_diagonal, what,
               stride: int = 1, draw=None):
  """Factor statistics from input rows ``[N, d_a]`` and grads ``[S, N, d_g]``.

  .. math::
    A = \\frac{1}{N} \\sum_n \\bar a_n \\bar a_n^T, \\quad
    G = \\frac{1}{N} \\sum_{s, n} g_{s,n} g_{s,n}^T, \\quad c = N / B

  with ``N = B c`` rows (examples x uses x locations). With ``stride > 1``
  and a ``draw``, both sums run over the rows ``o, o + k, ...`` only,
  ``k = min(stride, c)``, and are divided by ``N/k`` (:func:`strided_rows`:
  unbiased, ``k`` times fewer flops); ``c`` still counts every row. The
  stride thins an example's positions, never the examples: with one row
  per example (``c = 1``) every row is used.
  """
  c = base.rows_per_example(x.shape[0], batch_size, what)
  stride = min(stride, c)
  count = None
  if stride > 1 and draw is not None:
    x, count = strided_rows(x, 0, stride, draw)
    g, _ = strided_rows(g, 1, stride, draw)
  return {"a": second_moment(x, a_diagonal, count),
          "g": source_moment(g, g_diagonal, count),
          "scale": jnp.asarray(c, linalg.factor_dtype())}


def append_ones(x):
  """Appends the homogeneous coordinate (a column of ones) for a bias."""
  return jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)


@dataclasses.dataclass(frozen=True)
class DenseLayout:
  """Dense (and multi-use dense) parameters as ``V = [w; b]``.

  Inputs ``[B, U, ..., d_in]`` give ``B·U·...`` rows; every position is a
  use of the weights, so ``c = U·...`` (summed over tag sites).

  ``kernel_perm`` (with the leaf's ``kernel_shape``) is for a kernel kept in
  another layout than ``[*in_axes, *out_axes]``: Equinox's ``Linear`` holds
  ``[d_out, d_in]`` and computes ``w @ x`` (``kernel_perm = (1, 0)``). ``W``
  is then the kernel of the same layer written ``x @ w.T``, so the factors,
  the curvature and the direction do not depend on how the product was
  written (the inputs and output gradients the scanner records are in the
  ``[..., d_in]`` / ``[..., d_out]`` layout either way).
  """
  d_in: int
  d_out: int
  has_bias: bool
  num_uses: int
  kernel_perm: Optional[tuple] = None
  kernel_shape: Optional[tuple] = None

  @property
  def a_dim(self) -> int:
    return self.d_in + int(self.has_bias)

  @property
  def g_dim(self) -> int:
    return self.d_out

  @property
  def init_scale(self) -> int:
    return self.num_uses

  def to_mat(self, v: tuple):
    w = base.kernel_to_mat(v[0].astype(linalg.factor_dtype()),
                           self.kernel_perm, self.d_in, self.d_out)
    return base.with_bias_row(w, v[1] if self.has_bias else None)

  def from_mat(self, m, like: tuple) -> tuple:
    w, *b = base.split_bias_row(m, self.d_in, self.has_bias)
    if self.kernel_perm is not None:
      assert self.kernel_shape is not None  # recorded with kernel_perm
      w = base.mat_to_kernel(w, self.kernel_perm, self.kernel_shape)
    return base.vector_dtype_cast((w, *b), like)

  def ravel_index(self):
    """None when ``[w; b]`` row-major is the ravel order of ``(w, b)``."""
    idx = base.kernel_ravel_index(self.kernel_perm, self.kernel_shape,
                                  self.d_in, self.d_out)
    if idx is None:
      return None
    n = idx.size
    rows = [idx] + ([np.arange(n, n + self.d_out)[None]]
                    if self.has_bias else [])
    return np.concatenate(rows, axis=0).reshape(-1)

  def rows(self, data: base.LayerData):
    """Input rows ``[N, d_a]`` and gradient rows ``[S, N, d_g]``."""
    dt = linalg.factor_dtype()
    x = jnp.concatenate([inp[0].reshape(-1, self.d_in).astype(dt)
                         for inp in data.inputs], axis=0)
    if self.has_bias:
      x = append_ones(x)
    g = jnp.concatenate([gr.reshape(gr.shape[0], -1, self.d_out).astype(dt)
                         for gr in data.grads], axis=1)
    return x, g

  def factor_stats(self, data, a_diagonal, g_diagonal,
                   stride: int = 1) -> dict:
    """:func:`kron_stats` of :meth:`rows`; ``stride``: every ``k``-th row
    from an offset drawn from ``data.row_draw``."""
    x, g = self.rows(data)
    return kron_stats(x, g, data.batch_size, a_diagonal, g_diagonal,
                      "dense layer", stride, data.row_draw)


@dataclasses.dataclass(frozen=True)
class ReduceDenseLayout(DenseLayout):
  """K-FAC-reduce for a dense layer shared over positions (``kron_reduce``).

  With ``R`` uses per example (the positions of ``[B, T, ..., d_in]``
  inputs, scan steps, repeated tags), Eschenhagen et al. (2023) average
  the inputs and sum the output gradients over the
  shared axis *before* the outer products:

  .. math::
    \\bar a_b = \\frac{1}{R} \\sum_{r} \\bar a_{b,r}, \\quad
    \\bar g_{s,b} = \\sum_{r} g_{s,b,r}, \\quad
    A = \\frac{1}{B} \\sum_b \\bar a_b \\bar a_b^T, \\quad
    G = \\frac{1}{B} \\sum_{s,b} \\bar g_{s,b} \\bar g_{s,b}^T,
    \\quad c = 1

  (``ā`` with the bias's 1 appended). The factors cost ``B`` rows instead
  of ``B·R``. It is exact (``A ⊗ G`` equals the layer's Fisher/GGN block)
  for a deep linear network whose outputs are reduced over the shared
  axis before a Gaussian loss; :class:`DenseLayout` (``kron_indep``,
  K-FAC-expand) is exact when every position has its own loss instead.
  With ``R = 1`` both are K-FAC.

  References:
    Eschenhagen, Immer, Turner, Schneider & Hennig (2023), "Kronecker-
    Factored Approximate Curvature for Modern Neural Network
    Architectures", NeurIPS.
  """

  @property
  def init_scale(self) -> int:
    return 1

  def factor_stats(self, data, a_diagonal, g_diagonal,
                   stride: int = 1) -> dict:
    """Every per-example row (``stride`` is ignored: ``B`` rows are
    already few)."""
    del stride
    x, g = self.rows(data)
    return kron_stats(x, g, data.batch_size, a_diagonal, g_diagonal,
                      "dense layer")

  def rows(self, data: base.LayerData):
    """Per-example rows: mean inputs ``[B, d_a]``, summed gradients
    ``[S, B, d_g]``."""
    dt = linalg.factor_dtype()
    n = data.batch_size
    x = jnp.concatenate([inp[0].reshape(n, -1, self.d_in).astype(dt)
                         for inp in data.inputs], axis=1)
    x = jnp.mean(append_ones(x) if self.has_bias else x, axis=1)
    g = jnp.concatenate([gr.reshape(gr.shape[0], n, -1, self.d_out)
                         .astype(dt) for gr in data.grads], axis=2)
    return x, jnp.sum(g, axis=2)


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
  """A one-array parameter that *is* the ``[a_dim, g_dim]`` matrix.

  Used by blocks that compute their own statistics and run a
  :class:`KroneckerBlock` per slice (e.g. per channel of a depthwise conv).
  """
  a_dim: int
  g_dim: int
  init_scale: int = 1

  def to_mat(self, v: tuple):
    return v[0].astype(linalg.factor_dtype()).reshape(self.a_dim, self.g_dim)

  def from_mat(self, m, like: tuple) -> tuple:
    return base.vector_dtype_cast((m,), like)

  def ravel_index(self):
    return None


def to_ravel_order(f, index):
  """Permutes a matrix-order block to ravel order (``index`` as layouts')."""
  if index is None:
    return f
  index = jnp.asarray(index)
  return jnp.zeros_like(f).at[index[:, None], index[None, :]].set(f)


def dense_dims(layer: Layer) -> tuple:
  """``(d_in, d_out, kernel_perm)`` of a dense layer's kernel.

  A recognised kernel may say (in its metadata) which of its axes are
  inputs: ``kernel_perm`` orders the leaf's axes as ``[*in_axes,
  *out_axes]`` (Equinox's ``[d_out, d_in]``: ``(1, 0)``) and
  ``kernel_in_axes`` counts the input axes (DenseGeneral's ``[*in_axes,
  *out_axes]``); the matrix is the row-major reshape of the ordered kernel.

  Raises:
    ValueError: for a kernel that is not rank 2 and says neither.
  """
  w_shape = tuple(layer.param_shapes[0])
  meta = layer.meta_dict
  perm = meta.get("kernel_perm")
  k = meta.get("kernel_in_axes")
  if k is None and len(w_shape) != 2:
    raise ValueError(
        f"Layer {layer.name!r} has kernel shape {w_shape}; a Kronecker block "
        "needs a rank-2 [d_in, d_out] kernel. Register it with "
        "register_generic(...) or pass approx='diagonal'.")
  k = 1 if k is None else k
  shape = w_shape if perm is None else tuple(w_shape[a] for a in perm)
  perm = None if perm is None else tuple(perm)
  return math.prod(shape[:k]), math.prod(shape[k:]), perm
