"""Blocks made of other blocks: a vmapped stack, and a block-diagonal pair.

:class:`VmappedBlock` holds the block of *one* slice and maps every verb
over a leading axis with ``jax.vmap``, so the compiled program has one
(batched) factor update and one (batched) factorisation whatever the number
of slices. Its Fisher block is block-diagonal,

.. math:: F = \\mathrm{diag}(F_1, \\dots, F_n).

An *axis* strategy says how the layer's data and vectors map to the slices:

* :class:`StackAxis`: a stacked layer, ``W: [L, ...]`` sliced by
  ``lax.scan`` (flax ``nn.scan`` over ``L`` identical layers). Every array
  of the :class:`~.base.LayerData` and of the vectors already has the stack
  axis first (``inputs`` ``[L, B, U, ...]``, ``grads`` ``[L, S, B, U,
  ...]``, ``param_grads`` ``[L, S, ...]``); slice ``l`` is an independent
  layer.
* ``depthwise.ChannelAxis``: the channels of a depthwise conv, each a small
  Kronecker block (:mod:`.depthwise`).

An axis has ``all_or_nothing`` (a non-finite statistic in one slice leaves
every slice unchanged: the slices are one layer), ``stats(inner, data)``
(the stacked statistics), ``to_axis(v)`` / ``from_axis(out, like)`` (the
parameter tuple to the slices' tuples and back) and ``ravel_index()``
(``[n, p]``: where each slice's ravelled entries sit in the layer's ravel
order).

:class:`BlockDiagonal` is ``blockdiag(F_1, F_2, ...)`` over consecutive
groups of the layer's parameters, each part an ordinary block fed with its
own :class:`~.base.LayerData` (a separable conv's depthwise and pointwise
parts, :mod:`.depthwise`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import trees
from kfac_jax_lite.blocks import base
from kfac_jax_lite.layer import Layer


def check_part_caches(block, parts, flag: str, what: str):
  """Raises if a part caches Cholesky factors in its refresh (a factored
  ``"pi"`` refresh) and ``flag`` is off, naming ``block``'s layer."""
  if block.config.damping_type == "pi" and any(
      isinstance(p, base.FactorBucketed) for p in parts):
    base.check_cached(block, flag, what)


@dataclasses.dataclass(frozen=True)
class VmappedBlock(base.Shorthands, base.UnfusedProducts):
  """``size`` copies of ``inner`` (the block of one slice) along ``axis``."""
  layer: Layer
  config: base.BlockConfig
  inner: Any
  size: int
  axis: Any

  @property
  def needs_param_grads(self) -> bool:
    return self.inner.needs_param_grads

  @property
  def row_stats(self) -> tuple:
    """The inner block's per-example row statistics (EK-FAC's), if any."""
    return getattr(self.inner, "row_stats", ())

  def init(self):
    return jax.tree.map(
        lambda x: jnp.broadcast_to(x, (self.size,) + x.shape),
        self.inner.init())

  def compute_stats(self, data: base.LayerData):
    return self.axis.stats(self.inner, data)

  def update_curvature(self, state, stats, ema_decay):
    new = jax.vmap(self.inner.update_curvature, (0, 0, None))(
        state, stats, ema_decay)
    if not self.axis.all_or_nothing:
      return new
    finite = trees.all_finite(stats)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)

  def update_cache(self, state, damping):
    return jax.vmap(self.inner.update_cache, (0, None))(state, damping)

  def _map(self, fn, state, v):
    out = jax.vmap(lambda s, x: fn(self.inner, s, x))(
        state, self.axis.to_axis(v))
    return self.axis.from_axis(out, v)

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    return self._map(lambda b, s, x: b.multiply_matpower(s, x, exp), state, v)

  def multiply_cholesky(self, state, v, transpose=False):
    check_part_caches(self, (self.inner,), "compute_cholesky",
                      "multiply_cholesky")
    return self._map(lambda b, s, x: b.multiply_cholesky(s, x, transpose),
                     state, v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    check_part_caches(self, (self.inner,), "compute_cholesky_inverse",
                      "multiply_cholesky_inverse")
    return self._map(
        lambda b, s, x: b.multiply_cholesky_inverse(s, x, transpose),
        state, v)

  def full_fisher_block(self, state):
    """Block-diagonal over the slices, in ravel order of the params."""
    blocks = jax.vmap(self.inner.full_fisher_block)(state)   # [n, p, p]
    idx = jnp.asarray(self.axis.ravel_index())
    out = jnp.zeros((idx.size, idx.size), blocks.dtype)
    return out.at[idx[:, :, None], idx[:, None, :]].set(blocks)

  def factors(self, state):
    return jax.vmap(self.inner.factors)(state)

  def with_factors(self, state, factors):
    return jax.vmap(self.inner.with_factors)(state, factors)


@dataclasses.dataclass(frozen=True)
class StackAxis:
  """The stack axis of a stacked layer (see the module docstring).

  Attributes:
    param_shapes: the stacked layer's parameter shapes, ``[L, ...]`` each.
  """
  param_shapes: tuple
  all_or_nothing = False

  def stats(self, inner, data: base.LayerData):
    def one(inputs, grads, params, param_grads):
      return inner.compute_stats(base.LayerData(
          inputs=inputs, grads=grads, params=params, param_grads=param_grads,
          batch_size=data.batch_size, row_draw=data.row_draw))
    return jax.vmap(one)(data.inputs, data.grads, data.params,
                         data.param_grads)

  def to_axis(self, v: tuple) -> tuple:
    return v

  def from_axis(self, out: tuple, like: tuple) -> tuple:
    del like
    return out

  def ravel_index(self) -> np.ndarray:
    """Entry ``e`` of parameter ``j`` of slice ``l`` sits at ``offset_j + l
    * size_j + e``: the layer's order is ``(ravel(w), ravel(b), ...)`` with
    ``w: [L, ...]``."""
    size = self.param_shapes[0][0]
    sizes = [int(math.prod(s[1:])) for s in self.param_shapes]
    offsets = np.cumsum([0] + sizes[:-1]) * size
    return np.stack([np.concatenate([
        offsets[j] + l * sizes[j] + np.arange(sizes[j])
        for j in range(len(sizes))]) for l in range(size)])


def stacked_block(layer: Layer, config: base.BlockConfig, inner):
  """The block of a stacked layer around ``inner``, the block of a slice."""
  return VmappedBlock(layer=layer, config=config, inner=inner,
                      size=layer.stack, axis=StackAxis(layer.param_shapes))


@dataclasses.dataclass(frozen=True)
class BlockDiagonal(base.Shorthands, base.UnfusedProducts):
  """``blockdiag(F_1, F_2, ...)`` over consecutive groups of parameters.

  Attributes:
    layer, config: as every block's.
    parts: the blocks (without a layer of their own).
    param_counts: how many of the layer's parameters each part takes.
    split: ``split.data(data) -> (data_1, data_2, ...)``, each part's
      :class:`~.base.LayerData`.
  """
  layer: Layer
  config: base.BlockConfig
  parts: tuple
  param_counts: tuple
  split: Any

  @property
  def needs_param_grads(self) -> bool:
    return any(p.needs_param_grads for p in self.parts)

  def init(self):
    return tuple(p.init() for p in self.parts)

  def compute_stats(self, data: base.LayerData) -> tuple:
    return tuple(p.compute_stats(d)
                 for p, d in zip(self.parts, self.split.data(data)))

  def update_curvature(self, state, stats, ema_decay):
    return tuple(p.update_curvature(s, st, ema_decay)
                 for p, s, st in zip(self.parts, state, stats))

  def update_cache(self, state, damping):
    return tuple(p.update_cache(s, damping)
                 for p, s in zip(self.parts, state))

  def _each(self, fn, state, v):
    out, start = (), 0
    for p, s, n in zip(self.parts, state, self.param_counts):
      out += fn(p, s, v[start:start + n])
      start += n
    return out

  def multiply_matpower(self, state, v, exp):
    exp = base.check_exp(self, exp)
    return self._each(lambda b, s, x: b.multiply_matpower(s, x, exp),
                      state, v)

  def multiply_cholesky(self, state, v, transpose=False):
    check_part_caches(self, self.parts, "compute_cholesky",
                      "multiply_cholesky")
    return self._each(lambda b, s, x: b.multiply_cholesky(s, x, transpose),
                      state, v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    check_part_caches(self, self.parts, "compute_cholesky_inverse",
                      "multiply_cholesky_inverse")
    return self._each(
        lambda b, s, x: b.multiply_cholesky_inverse(s, x, transpose), state, v)

  def full_fisher_block(self, state):
    return jax.scipy.linalg.block_diag(
        *(p.full_fisher_block(s) for p, s in zip(self.parts, state)))

  def factors(self, state) -> tuple:
    return tuple(p.factors(s) for p, s in zip(self.parts, state))

  def with_factors(self, state, factors) -> tuple:
    return tuple(p.with_factors(s, f)
                 for p, s, f in zip(self.parts, state, factors))
