"""Groups of same-shaped blocks, stacked and mapped with one ``vmap``.

Blocks that differ only in their layer (same type, options, layout, state
and parameter shapes) form a group. The estimator state holds one state per
group, stacked along a new leading axis when the group has more than one
layer, and every verb runs one ``jax.vmap`` per group: the compiled step
has one eigendecomposition, inverse or EMA per *shape*, not per layer
(docs/performance.md#stacked-groups).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import _xla_cpu
from kfac_jax_lite import linalg


class EstimatorState(NamedTuple):
  """The estimator state: one (stacked) block state per group.

  ``stacked`` maps each group of same-shaped blocks to its state, stacked
  along a new leading axis when the group has more than one layer. Its keys
  name the group's layer indices (``"3"``, ``"1,2,4"``), so the grouping is
  part of the pytree structure and survives ``jit``, checkpoints and flax
  serialisation. :attr:`blocks` is a read-only per-layer view.

  Attributes:
    stacked: ``"i,j,..."`` (the group's layer indices) -> the group's block
      state, stacked along a leading layer axis.
    params_stats: the EMA of the mean per-source gradient
      (``compute_params_stats``), or ``()``.
    params_weight: ``[]``, that EMA's weight, or ``()``.

  Example:
    >>> state = kl.FisherEstimator(collection).init(params)
    >>> list(state.stacked)           # e.g. ['0', '1,2']
    >>> state.blocks[1]               # layer 1's block state
  """
  stacked: dict          # "i,j,..." -> the group's (stacked) block state
  params_stats: Any      # EMA of the mean per-source gradient, or ()
  params_weight: Any     # [] its EMA weight, or ()

  @property
  def groups(self) -> tuple:
    """The layer indices of each group, in the order of ``stacked``."""
    return parse_names(self.stacked)

  @property
  def blocks(self) -> tuple:
    """One block state per layer, in collection order (sliced out of the
    stacks when asked for; read-only)."""
    return layer_view(self.stacked)


class Unstacked(NamedTuple):
  """Per-layer values of a group whose members' shapes differ (one per
  layer of the group, in its order), where a stack is not possible."""
  members: tuple


def group_name(group) -> str:
  return ",".join(str(i) for i in group)


def parse_names(stacked: dict) -> tuple:
  """The groups of a dict keyed by :func:`group_name`."""
  return tuple(tuple(int(i) for i in k.split(",")) for k in stacked)


def layer_view(stacked: dict) -> tuple:
  """Per-layer entries of a dict of per-group (stacked) entries."""
  groups = parse_names(stacked)
  return tuple(per_layer(groups, list(stacked.values()),
                         sum(len(g) for g in groups)))


def shapes(tree) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((x.shape, str(x.dtype)) for x in leaves)


def group_key(block, state):
  """Blocks with equal keys can be stacked: same type, options, layout,
  state shapes and parameter shapes (vectors are stacked too)."""
  return (dataclasses.replace(block, layer=None), shapes(state),
          block.layer.param_shapes)


def keyed_groups(keys) -> tuple:
  """Indices with equal keys, grouped in order of first occurrence."""
  groups = {}
  for i, k in enumerate(keys):
    groups.setdefault(k, []).append(i)
  return tuple(tuple(g) for g in groups.values())


def find_groups(blocks, states) -> tuple:
  """Indices of blocks that differ only in their layer, grouped."""
  return keyed_groups([group_key(b, s) for b, s in zip(blocks, states)])


class Part(NamedTuple):
  """Some layers of one group (:func:`select`)."""
  group: int          # the group's index
  index: Any          # their positions in the group's stack (None: all)
  state: Any          # the group's state restricted to them


def select(groups, stacked: list, layers) -> list:
  """A :class:`Part` for every group with layers in ``layers`` (None:
  all layers); a part of a stacked group stays stacked."""
  wanted = None if layers is None else set(layers)
  out = []
  for k, (g, st) in enumerate(zip(groups, stacked)):
    pos = [j for j, i in enumerate(g) if wanted is None or i in wanted]
    if pos:
      idx = None if len(pos) == len(g) else np.asarray(pos)
      out.append(Part(k, idx, st if idx is None else jax.tree.map(
          lambda x, idx=idx: x[idx], st)))
  return out


def put(stacked: list, parts, new) -> list:
  """``stacked`` with each of :func:`select`'s parts replaced by ``new``."""
  out = list(stacked)
  for p, n in zip(parts, new):
    out[p.group] = n if p.index is None else jax.tree.map(
        lambda x, y, idx=p.index: x.at[idx].set(y), out[p.group], n)
  return out


def entries(x, names: tuple, name: str) -> list:
  """The per-group entries of a state or statistics ``x`` (named ``name``
  in the error), checked to have the groups ``names``, in their order.

  The names are compared as sets: jax flattens a dict in sorted key order,
  so a state that went through ``jit`` comes back with its groups sorted.
  """
  if set(getattr(x, "stacked", None) or ()) != set(names):
    got = (list(x.stacked) if isinstance(getattr(x, "stacked", None), dict)
           else type(x).__name__)
    raise ValueError(
        f"{name}=... does not match this estimator: its groups are {got}, "
        f"the estimator's {list(names)}. Pass the {name} made by "
        "this estimator (init / compute_stats / value_grad_and_stats "
        "with estimator=...).")
  return [x.stacked[n] for n in names]


def check_state_shapes(state: EstimatorState, want: dict, groups,
                       layer_names, name: str) -> None:
  """Each group's arrays end in the shapes of ``want`` (the initial
  state's, per group name; leading axes, e.g. a replica axis, are
  allowed)."""
  for (group, shapes), layers in zip(want.items(), groups):
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    got = jax.tree.leaves(state.stacked[group])
    if len(got) != len(flat):
      continue
    names = [layer_names[i] for i in layers]
    for (path, w), g in zip(flat, got):
      shape, ws = tuple(jnp.shape(g)), tuple(w.shape)
      if len(shape) < len(ws) or shape[len(shape) - len(ws):] != ws:
        raise ValueError(
            f"{name}=... holds {jax.tree_util.keystr(path)} of shape "
            f"{shape} for the layers {names}; this estimator's have "
            f"{ws}: the {name} belongs to another model. Pass the {name} "
            "made by this estimator (tx.init(params) of this model).")


def stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree, n, runtime_index=False) -> list:
  """The ``n`` slices of a stacked tree, ``[x[0], ..., x[n-1]]``.

  With ``runtime_index`` each ``x[j]`` is a ``dynamic_slice`` at an index
  XLA:CPU does not know at compile time
  (:func:`~kfac_jax_lite._xla_cpu.opaque_indices`; a constant on other
  platforms), so the kernels that consume the slices of one group are one
  kernel, compiled once. Use it
  where the slices are materialised anyway (outputs); static slices let
  XLA cancel a split followed by a stack.
  """
  if not runtime_index:
    return [jax.tree.map(lambda x, j=j: x[j], tree) for j in range(n)]
  index = _xla_cpu.opaque_indices(n, jax.tree.leaves(tree)[0])
  return [jax.tree.map(
      lambda x, j=j: jax.lax.dynamic_index_in_dim(x, j, keepdims=False),
      tree) for j in index]


def per_layer(groups, per_group, num_layers, runtime_index=False) -> list:
  """Per-layer entries from per-group ones (stacked for groups of 2+;
  ``runtime_index`` as :func:`unstack`)."""
  out = [None] * num_layers
  for g, r in zip(groups, per_group):
    parts = [r] if len(g) == 1 else (
        list(r.members) if isinstance(r, Unstacked)
        else unstack(r, len(g), runtime_index))
    for i, part in zip(g, parts):
      out[i] = part
  return out


def combine(parts: list):
  """One group entry from its layers' values: stacked when their shapes
  agree (a single layer's value as is), else :class:`Unstacked`."""
  if len(parts) == 1:
    return parts[0]
  if len({shapes(p) for p in parts}) == 1:
    return stack(parts)
  return Unstacked(tuple(parts))


def map_group(fn, block, n: int, state, x):
  """``fn(block, state, x)`` for a group of ``n`` layers: one ``vmap``
  over the stacked ``state`` and ``x``, or layer by layer when ``x`` is
  :class:`Unstacked`."""
  if n == 1:
    return fn(block, state, x)
  if isinstance(x, Unstacked):
    return stack([fn(block, s, m) for s, m in zip(unstack(state, n),
                                                   x.members)])
  return jax.vmap(lambda s, m: fn(block, s, m))(state, x)


def grouped_map(blocks, states, fn) -> list:
  """``[fn(b, s)]`` for per-layer blocks and states, one ``vmap`` per group
  of same-shaped blocks."""
  out = [None] * len(blocks)
  for g in find_groups(blocks, states):
    b = blocks[g[0]]
    if len(g) == 1:
      out[g[0]] = fn(b, states[g[0]])
      continue
    res = jax.vmap(lambda s, b=b: fn(b, s))(stack([states[i] for i in g]))
    for i, r in zip(g, unstack(res, len(g))):
      out[i] = r
  return out


def group_stats(blocks, groups, layer_data) -> list:
  """``block.compute_stats(data)`` per group, stacked like the state.

  Within a group, the layers whose ``LayerData`` have equal structure,
  shapes and (static) batch size are one ``vmap``: the statistics of ``L``
  same-shaped layers are one batched computation (one ``dot_general`` per
  factor, not ``L``). A group whose layers' data differ in shape is
  computed per subgroup and then combined (:func:`combine`).
  """
  out = []
  for g in groups:
    b = blocks[g[0]]
    data = [layer_data[i]._replace(batch_size=None) for i in g]
    sizes = [layer_data[i].batch_size for i in g]
    subs = keyed_groups([(shapes(d), n) for d, n in zip(data, sizes)])
    parts = [None] * len(g)
    results = []
    for sub in subs:
      n = sizes[sub[0]]
      def fn(d, b=b, n=n):
        return b.compute_stats(d._replace(batch_size=n))
      res = fn(data[sub[0]]) if len(sub) == 1 else jax.vmap(fn)(
          stack([data[j] for j in sub]))
      results.append(res)
      if len(subs) > 1:
        for j, r in zip(sub, unstack(res, len(sub)) if len(sub) > 1
                        else [res]):
          parts[j] = r
    out.append(results[0] if len(subs) == 1 else combine(parts))
  return out


class ProductInputs(NamedTuple):
  """A params-shaped ``v`` as the blocks multiply it
  (:meth:`FisherEstimator.product_inputs`)."""
  leaves: list     # v's leaves
  parts: list      # per layer: the layer's leaves
  per_group: list  # per group of the state: the blocks' product inputs
  rest: list       # v's leaves in no layer

  def checked(self) -> tuple:
    """Everything of ``v``, as the product reads it: the values to check
    (e.g. for finiteness) instead of ``v``."""
    return self.per_group, self.rest


def split_params(collection, v, name="v"):
  """``v``'s leaves, and per layer of ``collection`` the tuple of its
  leaves (``v`` checked against the parameters, named ``name``)."""
  collection.check_params(v, name)
  leaves = jax.tree.leaves(v)
  return leaves, [tuple(leaves[i] for i in l.param_indices)
                  for l in collection.layers]

def merge_params(collection, v, leaves, parts):
  """``v``-shaped tree of ``leaves`` with each layer's ``parts`` put in."""
  leaves = list(leaves)
  for layer, part in zip(collection.layers, parts):
    for i, x in zip(layer.param_indices, part):
      leaves[i] = x
  return jax.tree.unflatten(jax.tree.structure(v), leaves)


def dense_block_diagonal(collection, blocks, states):
  """The undamped dense ``[P, P]`` block-diagonal matrix of the layers'
  ``full_fisher_block``, in ``ravel_pytree`` order of the parameters."""
  sizes = [int(math.prod(s)) for s in _leaf_shapes(collection)]
  starts = [sum(sizes[:i]) for i in range(len(sizes))]
  total = sum(sizes)
  out = jnp.zeros((total, total), linalg.factor_dtype())
  for layer, b, s in zip(collection.layers, blocks, states):
    idx = jnp.concatenate([jnp.arange(starts[i], starts[i] + sizes[i])
                           for i in layer.param_indices])
    out = out.at[idx[:, None], idx[None, :]].set(b.full_fisher_block(s))
  return out


def _leaf_shapes(collection) -> list:
  if collection.leaf_shapes:  # Includes leaves outside params_filter.
    return list(collection.leaf_shapes)
  shapes = [None] * len(collection.leaf_paths)
  for layer in collection.layers:
    for i, s in zip(layer.param_indices, layer.param_shapes):
      shapes[i] = s
  return shapes
