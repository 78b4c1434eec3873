"""Stacked layers: one independent block per slice, ``vmap``-ped.

A parameter leaf ``W: [L, ...]`` sliced by ``lax.scan`` (flax ``nn.scan``
over ``L`` identical layers) is ``L`` layers. Its curvature is the
block-diagonal

.. math:: F = \\mathrm{diag}(F_1, \\dots, F_L),

with :math:`F_l` the block of slice ``l`` (Kronecker, diagonal, ...). The
:class:`StackedBlock` holds the block of *one* slice and maps every method
over the stack axis with ``jax.vmap``, so the compiled program contains one
(batched) factor update and one (batched) eigendecomposition or inverse per
stacked layer whatever ``L`` is: compile time does not grow with depth.

Layout: every array of the wrapped state, of the :class:`LayerData` and of
the vectors has the stack axis first (``inputs`` ``[L, B, U, ...]``,
``grads`` ``[L, S, B, U, ...]``, ``param_grads`` ``[L, S, ...]``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from kfac_jax_lite.blocks import base
from kfac_jax_lite.collection import Layer


@dataclasses.dataclass(frozen=True)
class StackedBlock(base.Block):
  """``L`` independent copies of ``inner``, the block of one slice."""
  layer: Layer
  config: base.BlockConfig
  inner: Any
  size: int

  @property
  def needs_param_grads(self) -> bool:  # pytype: disable=signature-mismatch
    return self.inner.needs_param_grads

  def init(self):
    return jax.tree.map(
        lambda x: jnp.broadcast_to(x, (self.size,) + x.shape),
        self.inner.init())

  def compute_stats(self, data: base.LayerData):
    def one(inputs, grads, params, param_grads):
      return self.inner.compute_stats(base.LayerData(
          inputs=inputs, grads=grads, params=params, param_grads=param_grads,
          batch_size=data.batch_size))
    return jax.vmap(one)(data.inputs, data.grads, data.params,
                         data.param_grads)

  def update_curvature(self, state, stats, ema_decay):
    return jax.vmap(lambda s, st: self.inner.update_curvature(
        s, st, ema_decay))(state, stats)

  def update_cache(self, state, damping):
    return jax.vmap(lambda s: self.inner.update_cache(s, damping))(state)

  def multiply_matpower(self, state, v, exp):
    return jax.vmap(lambda s, x: self.inner.multiply_matpower(s, x, exp))(
        state, v)

  def multiply_cholesky(self, state, v, transpose=False):
    return jax.vmap(lambda s, x: self.inner.multiply_cholesky(
        s, x, transpose))(state, v)

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    return jax.vmap(lambda s, x: self.inner.multiply_cholesky_inverse(
        s, x, transpose))(state, v)

  def full_fisher_block(self, state):
    """The block-diagonal ``[P, P]`` in ravel order of the stacked leaves.

    Slice ``l``'s block is in ravel order of ``(w_l, b_l, ...)``; the layer's
    order is ``(ravel(w), ravel(b), ...)`` with ``w: [L, ...]``, so entry
    ``e`` of parameter ``j`` of slice ``l`` sits at
    ``offset_j + l * size_j + e``.
    """
    blocks = jax.vmap(self.inner.full_fisher_block)(state)   # [L, p, p]
    sizes = [int(math.prod(s[1:])) for s in self.layer.param_shapes]
    offsets = [sum(sizes[:j]) * self.size for j in range(len(sizes))]
    idx = jnp.stack([jnp.concatenate([
        offsets[j] + l * sizes[j] + jnp.arange(sizes[j])
        for j in range(len(sizes))]) for l in range(self.size)])
    total = sum(sizes) * self.size
    out = jnp.zeros((total, total), blocks.dtype)
    return out.at[idx[:, :, None], idx[:, None, :]].set(blocks)
