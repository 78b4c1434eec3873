"""Curvature blocks, one family per module; :func:`make_block` picks one.

Which block serves which ``(kind, approx)`` is a row of the layer-kind
registry (:mod:`kfac_jax_lite.kinds`; ``kinds.markdown_table()`` prints the
table). The registry names the factories (``"kronecker.dense_block"``) and
this module resolves them, so that the registry, the collection and the
scanner import no block module. Every block is a frozen dataclass of static
fields whose methods are pure functions of a state pytree; blocks equal up to
``layer`` act identically, so the estimator may stack them. The verbs and
optional capabilities are the protocols of :mod:`.base`.

Example:
  >>> block = make_block(collection.layers[0], BlockConfig(exps=(-1,)))
  >>> state = block.init()
  >>> state = block.update_curvature(state, block.compute_stats(data), 0.95)
  >>> state = block.update_cache(state, damping=1e-3)
  >>> precond = block.multiply_inverse(state, (w_grad, b_grad))
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from kfac_jax_lite import kinds
# Every family is imported here, so that kfac_jax_lite.blocks.<module> works
# and the registry's named factories resolve (registered_factory) from the
# modules in _FAMILIES, with no import at lookup time.
from kfac_jax_lite.blocks import base
from kfac_jax_lite.blocks import combinators
from kfac_jax_lite.blocks import conv
from kfac_jax_lite.blocks import depthwise
from kfac_jax_lite.blocks import diagonal
from kfac_jax_lite.blocks import ekfac
from kfac_jax_lite.blocks import embedding
from kfac_jax_lite.blocks import full
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.blocks import layouts
from kfac_jax_lite.blocks import multi_use
from kfac_jax_lite.blocks import per_example
from kfac_jax_lite.blocks import scale_and_shift
from kfac_jax_lite.blocks import sua
from kfac_jax_lite.blocks import tied
from kfac_jax_lite.blocks.base import Block
from kfac_jax_lite.blocks.base import BlockConfig
from kfac_jax_lite.blocks.base import CholeskyProducts
from kfac_jax_lite.blocks.base import FactorBucketed
from kfac_jax_lite.blocks.base import FusedProduct
from kfac_jax_lite.blocks.base import LayerData
from kfac_jax_lite.layer import Layer

__all__ = ["Block", "BlockConfig", "CholeskyProducts", "FactorBucketed",
           "FusedProduct", "LayerData", "check_cholesky", "check_overrides",
           "make_block",
           "registered_factory"]

# A factory builds the block of one layer: (layer, config) -> block.
Factory = Callable[[Layer, BlockConfig], object]

# The modules a registry name ("kronecker.dense_block") may start with.
_FAMILIES = {m.__name__.rpartition(".")[2]: m for m in (
    base, combinators, conv, depthwise, diagonal, ekfac, embedding, full,
    kronecker, layouts, multi_use, per_example, scale_and_shift, sua, tied)}


def registered_factory(kind: str, approx: str) -> Optional[Factory]:
  """The built-in factory the registry names for ``(kind, approx)``."""
  name = kinds.KINDS[kind].factory(approx) if kind in kinds.KINDS else None
  if name is None:
    return None
  module, function = name.rsplit(".", 1)
  return getattr(_FAMILIES[module], function)


def _override(layer: Layer, overrides: Optional[Mapping]) -> Optional[Factory]:
  """The longest matching path prefix, else the ``(kind, approx)`` key."""
  if not overrides:
    return None
  best = None
  for key in overrides:
    if isinstance(key, str) and any(p.startswith(key)
                                    for p in layer.param_paths):
      if best is None or len(key) > len(best):
        best = key
    elif not isinstance(key, (str, tuple)) or (
        isinstance(key, tuple) and len(key) != 2):
      raise TypeError(
          f"overrides key {key!r}: use a (kind, approx) tuple or a "
          "parameter-path prefix string (as jax.tree_util.keystr prints it).")
  if best is not None:
    return overrides[best]
  return overrides.get((layer.kind, layer.approx))


def check_overrides(layers, overrides: Optional[Mapping]):
  """Raises unless every key of ``overrides`` picks at least one layer.

  Args:
    layers: the collection's layers.
    overrides: ``{key: factory}`` as :func:`make_block` takes them.

  Raises:
    TypeError: for a key that is neither a ``(kind, approx)`` pair nor a
      path-prefix string, or a factory that is not callable.
    ValueError: for a key no layer matches (the message lists the layers).
  """
  for key, factory in (overrides or {}).items():
    if not callable(factory):
      raise TypeError(
          f"block_factories[{key!r}]={factory!r} must be a function "
          "(layer, config) -> block.")
    if isinstance(key, str):
      hit = any(p.startswith(key) for l in layers for p in l.param_paths)
    elif isinstance(key, tuple) and len(key) == 2:
      hit = any((l.kind, l.approx) == key for l in layers)
    else:
      raise TypeError(
          f"block_factories key {key!r}: use a (kind, approx) tuple or a "
          "parameter-path prefix string (as jax.tree_util.keystr prints it).")
    if not hit:
      raise ValueError(
          f"block_factories key {key!r} matches no layer; the layers are "
          f"{[(l.name, l.kind, l.approx) for l in layers]}. Use a prefix of "
          "a layer's param_paths or one of its (kind, approx) pairs.")


def check_cholesky(blocks, what: str):
  """Raises ``ValueError`` naming the first block without
  :class:`.base.CholeskyProducts` (a user block may not have them)."""
  for block in blocks:
    if not isinstance(block, CholeskyProducts):
      raise ValueError(
          f"{what}: the block of layer {base.layer_name(block)!r} "
          f"({type(block).__name__}) has no Cholesky products; give it "
          "multiply_cholesky and multiply_cholesky_inverse "
          "(blocks.base.CholeskyProducts) or choose another block for it.")


def _checked(block, layer: Layer):
  """A user factory's block, checked against :class:`.base.Block`."""
  missing = [n for n in ("init", "compute_stats", "update_curvature",
                         "update_cache", "multiply_matpower", "multiply",
                         "multiply_inverse", "full_fisher_block", "factors",
                         "with_factors", "config", "needs_param_grads")
             if not hasattr(block, n)]
  if missing:
    raise TypeError(
        f"The block factory for layer {layer.name!r} returned a "
        f"{type(block).__name__} without {missing}: a block follows "
        "kfac_jax_lite.blocks.base.Block (docs/custom_blocks.md).")
  return block


def make_block(layer: Layer, config: BlockConfig | None = None,
               overrides: Optional[Mapping] = None):
  """The block for ``layer.kind`` and ``layer.approx``.

  A stacked layer (``layer.stack > 0``) gets a
  :class:`~kfac_jax_lite.blocks.combinators.VmappedBlock` around the block of
  one slice (an override's factory, too, builds the block of one slice).

  Args:
    layer: a static layer description (from :func:`kfac_jax_lite.scan`).
    config: options shared by every block; defaults to ``BlockConfig()``.
    overrides: per-call user blocks, ``{key: factory}`` with ``factory(layer,
      config) -> block`` and ``key`` a ``(kind, approx)`` tuple or a
      parameter-path prefix (``"['params']['Dense_0']"``). The longest
      matching prefix wins over a ``(kind, approx)`` key, which wins over
      the registry. The block must follow :class:`.base.Block` (and be a
      frozen dataclass with a ``layer`` field, so the estimator can group
      equal blocks).

  Returns:
    A block (see :class:`~kfac_jax_lite.blocks.base.Block`).

  Raises:
    ValueError: when the layer's shapes or tag options do not fit its
      approximation (the message names the value and the fix).
    NotImplementedError: for a (kind, approx) pair with no block.
  """
  config = config or BlockConfig()
  if layer.stack:
    return combinators.stacked_block(
        layer, config, make_block(layer.unstacked(), config, overrides))
  user = _override(layer, overrides)
  if user is not None:
    return _checked(user(layer, config), layer)
  factory = registered_factory(layer.kind, layer.approx)
  if factory is None:
    done = [a for a, _ in kinds.KINDS[layer.kind].factories
            ] if layer.kind in kinds.KINDS else []
    raise NotImplementedError(
        f"Layer {layer.name!r}: approximation {layer.approx!r} for kind "
        f"{layer.kind!r} has no block (available: {sorted(done)}). Pass "
        "approximations={...} to scan() to choose another, or a factory "
        "in overrides={(kind, approx): factory}.")
  return factory(layer, config)

