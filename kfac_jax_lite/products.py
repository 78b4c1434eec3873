"""The curvature-product verbs of FisherEstimator: ``F̂^exp v`` and kin.

:class:`CurvatureProducts` is the base class of
:class:`~kfac_jax_lite.estimator.FisherEstimator` that holds its
params-shaped products: :meth:`~CurvatureProducts.multiply_matpower` and
the verbs built on it, and the Cholesky products. Each runs one ``vmap``
per group of same-shaped blocks (:mod:`kfac_jax_lite.grouping`), then
cuts the result per layer and per parameter.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TYPE_CHECKING

import jax

from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import distributed
from kfac_jax_lite import grouping
from kfac_jax_lite.grouping import ProductInputs

if TYPE_CHECKING:
  from kfac_jax_lite.collection import LayerCollection


class CurvatureProducts:
  """The product verbs of :class:`~kfac_jax_lite.estimator.FisherEstimator`.

  A base class, not used alone: the estimator provides ``collection``,
  ``blocks``, ``groups``, ``stats_sync``, ``axis_name``, and ``_stacked``
  / ``_replace``, its checked per-group view of a state and the state
  rebuilt from per-group entries.
  """
  # Declared for type checkers only (no values: not dataclass fields of the
  # subclass); the estimator defines each.
  collection: LayerCollection
  blocks: tuple
  groups: tuple
  stats_sync: str
  axis_name: Any
  _stacked: Callable[..., list]
  _replace: Callable[..., Any]
  _blocks: tuple  # set by the estimator's __post_init__, read by blocks

  @functools.cached_property
  def _live(self) -> tuple:
    """Per group, the factor leaves its products read directly
    (:func:`distributed.live_factors`)."""
    return tuple(distributed.live_factors(self.blocks[g[0]])
                 for g in self.groups)

  # ---- products ----------------------------------------------------------
  def _per_group(self, state, fn, xs) -> list:
    """``fn(block, group_state, x)`` per group: one ``vmap`` over the
    group's stack and its ``xs`` (:func:`grouping.combine` of its layers'
    values); results stacked like the state."""
    return [grouping.map_group(fn, self.blocks[g[0]], len(g), st, x)
            for g, st, x in zip(self.groups, self._stacked(state), xs)]

  def _combine(self, parts) -> list:
    return [grouping.combine([parts[i] for i in g]) for g in self.groups]

  def _apply(self, state, v, fn: Callable, finish=None, inputs=None):
    """The params-shaped product: ``fn(block, state, x)`` per group, then
    the results split per layer (at runtime indices,
    :func:`grouping.unstack`) and ``finish(block, r, x)`` (optional)
    turning a layer's result ``r`` into its parameter tuple. The split and
    the finish sit together under ``kfac_merge``, where their slices fuse
    with the consumers of the product. ``inputs`` (:meth:`product_inputs`
    of ``v``) replaces ``v``'s own per-layer tuples as what ``fn``
    multiplies."""
    if inputs is None:
      leaves, parts = grouping.split_params(self.collection, v)
      xs = self._combine(parts)
    else:
      leaves, parts, xs = inputs.leaves, inputs.parts, inputs.per_group
    out = self._per_group(state, fn, xs)
    finish = finish or (lambda b, r, x: r)
    with jax.named_scope("kfac_merge"):
      out = grouping.per_layer(self.groups, out, len(self.blocks),
                               runtime_index=True)
      return grouping.merge_params(self.collection, v, leaves, [
          finish(b, r, x) for b, r, x in zip(self.blocks, out, parts)])

  def product_inputs(self, state, v, name: str = "v") -> ProductInputs:
    """``v`` (params-shaped) as :meth:`multiply_matpower` multiplies it:
    per group of ``state``, the blocks'
    :meth:`~blocks.base.Block.product_input` (``[W; b]`` for dense
    layers), stacked like the group's state.

    Pass it to :meth:`multiply_matpower` as ``inputs=``. A caller that
    also checks ``v`` (the transforms' finiteness check) checks
    :meth:`ProductInputs.checked` instead: ``v``'s leaves are then read
    once, by the kernels that build the matrices
    (docs/performance.md#product-inputs). ``name`` names ``v`` in the
    error raised when it does not match the parameters.

    Args:
      state: the estimator state.
      v: a params-shaped vector.
      name: the name of ``v`` in error messages.

    Returns:
      A ``ProductInputs`` for :meth:`multiply_matpower`'s ``inputs=``.

    Raises:
      ValueError: if ``v`` does not have the parameters' structure.
    """
    leaves, parts = grouping.split_params(self.collection, v, name)
    with jax.named_scope("kfac_inputs"):
      per_group = self._per_group(
          state, lambda b, s, x: b.product_input(x), self._combine(parts))
    used = {i for l in self.collection.layers for i in l.param_indices}
    rest = [x for i, x in enumerate(leaves) if i not in used]
    return ProductInputs(leaves, parts, per_group, rest)

  def multiply_matpower(self, state, v, exp, inputs=None):
    """``F̂^exp v`` (damped) for a params-shaped ``v``.

    Each block computes :meth:`~blocks.base.Block.multiply_matpower_raw`
    (``[W; b]`` as one matrix for dense layers, stacked per group of
    same-shaped layers); it is cut per layer and per parameter afterwards
    (:meth:`~blocks.base.Block.finish_product`), where the slices fuse
    with what consumes the product instead of being kernels of their own.

    Args:
      state: the estimator state (after :meth:`update_cache`).
      v: a params-shaped vector.
      exp: the exponent: 1, or one of the constructor's ``exps``.
      inputs: :meth:`product_inputs` of ``v``, when the caller made it.

    Returns:
      ``F̂^exp v``, params-shaped.

    Raises:
      ValueError: for an exponent neither 1 nor in ``exps``.
    """
    for b in self.blocks:
      blocks_lib.base.check_exp(b, exp)
    if self.stats_sync == "before_refresh" and self.axis_name is not None:
      # Live factors differ across replicas until the next refresh.
      state = self._replace(state, distributed.average_live_factors(
          [self.blocks[g[0]] for g in self.groups], self._stacked(state),
          self._live, self.axis_name))
    with jax.named_scope("kfac_precondition"):
      return self._apply(
          state, v, lambda b, s, x: b.multiply_matpower_raw(s, x, exp),
          finish=lambda b, r, x: b.finish_product(r, x), inputs=inputs)

  def multiply(self, state, v):
    """``F̂ v``: the damped curvature times a params-shaped ``v``.

    Args:
      state: the estimator state.
      v: a params-shaped vector.

    Returns:
      ``(F̂ + λ) v`` as the blocks damp it, params-shaped.
    """
    return self.multiply_matpower(state, v, 1)

  def multiply_inverse(self, state, v):
    """``F̂⁻¹ v`` (damped), the natural-gradient direction of ``v``.

    Args:
      state: the estimator state (after :meth:`update_cache`).
      v: a params-shaped vector.

    Returns:
      ``(F̂ + λ)⁻¹ v``, params-shaped.
    """
    return self.multiply_matpower(state, v, -1)

  def multiply_cholesky(self, state, v, transpose=False):
    """``C v`` with ``C Cᵀ`` the damped block (``compute_cholesky=True``).

    Args:
      state: the estimator state (after :meth:`update_cache`).
      v: a params-shaped vector.
      transpose: apply ``Cᵀ`` instead.

    Returns:
      ``C v`` (or ``Cᵀ v``), params-shaped.
    """
    blocks_lib.check_cholesky(self.blocks, "multiply_cholesky")
    return self._apply(state, v, lambda b, s, x: b.multiply_cholesky(
        s, x, transpose))

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    """``C⁻¹ v`` with ``C Cᵀ`` the damped block
    (``compute_cholesky_inverse=True``).

    Args:
      state: the estimator state (after :meth:`update_cache`).
      v: a params-shaped vector.
      transpose: apply ``C⁻ᵀ`` instead.

    Returns:
      ``C⁻¹ v`` (or ``C⁻ᵀ v``), params-shaped.
    """
    blocks_lib.check_cholesky(self.blocks, "multiply_cholesky_inverse")
    return self._apply(state, v, lambda b, s, x: b.multiply_cholesky_inverse(
        s, x, transpose))
