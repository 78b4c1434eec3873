"""Embedding blocks: ``c · diag(a) ⊗ G`` without any ``vocab x vocab`` array.

A lookup ``y = table[id]`` is a dense layer applied to the one-hot vector
:math:`e_{id}`, so its per-example gradient is :math:`e_{id} g^T` and the
K-FAC input factor is

.. math::
  A = E[e_{id} e_{id}^T] = \\mathrm{diag}(E[\\mathrm{counts}]), \\qquad
  G = E[g g^T],

exactly diagonal whatever the ids (TF K-FAC ``EmbeddingKFACFB`` with its
``DiagonalKroneckerFactor``; Martens & Grosse 2015, eq. 1-3 for K-FAC). ``A``
is a vector of length ``vocab`` built with a scatter-add of the ids (never
a one-hot matrix), so updates and products cost ``O(N + vocab·d + d³)``.

Ids ``[B, k]`` are ``k`` uses per example, like the positions of a dense
layer applied to ``[B, T, d]``: rows are averaged over ``B·k`` lookups and
``c = k``; a table used at several tag sites (tied weights, ``lax.scan``) is
``kron_indep`` with ``c`` = total lookups per example (Martens, Ba & Johnson
2018, sec. 3.1). Negative ids wrap around as in the lookup; ids
``>= vocab`` add nothing to ``A`` (``.at[].add`` drops them).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kfac_jax_lite import linalg
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.layer import Layer


@dataclasses.dataclass(frozen=True)
class EmbeddingLayout:
  """``V`` is the ``[vocab, d]`` table itself; ``A`` is always diagonal."""
  vocab: int
  dim: int
  num_uses: int

  @property
  def a_dim(self) -> int:
    return self.vocab

  @property
  def g_dim(self) -> int:
    return self.dim

  @property
  def init_scale(self) -> int:
    return self.num_uses

  def to_mat(self, v: tuple):
    return v[0].astype(linalg.factor_dtype()).reshape(self.vocab, self.dim)

  def from_mat(self, m, like: tuple) -> tuple:
    return base.vector_dtype_cast((m,), like)

  def ravel_index(self):
    return None

  def factor_stats(self, data, a_diagonal, g_diagonal) -> dict:
    del a_diagonal  # Always diagonal.
    dt = linalg.factor_dtype()
    ids = jnp.concatenate([inp[0].reshape(-1) for inp in data.inputs])
    g = jnp.concatenate([gr.reshape(gr.shape[0], -1, self.dim).astype(dt)
                         for gr in data.grads], axis=1)
    n = ids.shape[0]
    c = base.rows_per_example(n, data.batch_size, "embedding layer")
    counts = jnp.zeros((self.vocab,), dt).at[ids.astype(jnp.int32)].add(1.0)
    return {"a": counts / n, "g": layouts.source_moment(g, g_diagonal),
            "scale": jnp.asarray(c, dt)}


def embedding_block(layer: Layer, config: base.BlockConfig):
  """``kron`` / ``kron_indep`` block of a ``[vocab, d]`` embedding table."""
  shape = layer.param_shapes[0]
  if len(layer.param_shapes) != 1 or len(shape) != 2:
    raise ValueError(
        f"Layer {layer.name!r} has parameter shapes {layer.param_shapes}; "
        "register_embedding needs one [vocab, d] table. Reshape the table, "
        "or register it with register_generic(...).")
  layout = EmbeddingLayout(vocab=shape[0], dim=shape[1],
                           num_uses=layer.num_uses)
  return kronecker.KroneckerBlock(layer=layer, config=config, layout=layout,
                                  a_diagonal=True)
