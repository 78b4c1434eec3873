"""FisherEstimator and the one-pass loss / gradient / statistics function.

The statistics of every block come from one ``jax.vjp`` of the loss function
re-evaluated with zero perturbations at the tagged layer outputs
(:func:`kfac_jax_lite.scanner.perturbed_fn`):

* cotangent 1 on the loss gives the true gradient (and, for free, the
  per-layer gradients of the mean loss);
* cotangents :math:`c_s` at each loss tag's parameters ``z`` give the output
  gradients :math:`J_s^T c_s` used by the Fisher factors. They are, per
  estimation mode (``w`` the loss weight, ``S`` the number of sources):

  - ``gradients``: :math:`\\sqrt{w/S}\\, \\nabla_z \\mathrm{nll}(z, \\hat y_s)`,
    :math:`\\hat y_s \\sim p(y|z)` (Martens & Grosse 2015, sec. 5);
  - ``empirical``: :math:`\\sqrt{w}\\, \\nabla_z \\mathrm{nll}(z, y)` with data
    targets (so the Fisher scales by ``w``, not ``w²`` as TF K-FAC did);
  - ``curvature_prop`` / ``curvature_prop_GGN``: :math:`\\sqrt{w/S}\\, B r_s`,
    ``r`` Rademacher, ``B Bᵀ = F_R`` (Martens, Sutskever & Swersky 2012);
  - ``exact`` / ``exact_GGN``: :math:`\\sqrt{w}\\, B e_k` for every output
    coordinate ``k`` (``vmap``, no Python loop).

  All sources are pulled back through the *same* linearisation with
  ``jax.vmap`` over the cotangents; the forward pass runs once.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import _blas_threads
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import distributed
from kfac_jax_lite import keys as keys_lib
from kfac_jax_lite import linalg
from kfac_jax_lite import scanner
from kfac_jax_lite.collection import LayerCollection

MODES = ("gradients", "empirical", "curvature_prop", "curvature_prop_GGN",
         "exact", "exact_GGN")
MODE_ALIASES = {
    "fisher_gradients": "gradients", "fisher_empirical": "empirical",
    "fisher_curvature_prop": "curvature_prop",
    "ggn_curvature_prop": "curvature_prop_GGN", "fisher_exact": "exact",
    "ggn_exact": "exact_GGN"}


def canonical_mode(mode: str) -> str:
  mode = MODE_ALIASES.get(mode, mode)
  if mode not in MODES:
    raise ValueError(
        f"estimation_mode={mode!r} is unknown; choose one of {list(MODES)} "
        f"(or kfac-jax's names {sorted(MODE_ALIASES)}).")
  return mode


class EstimatorState(NamedTuple):
  blocks: tuple          # one block state per layer, in collection order
  params_stats: Any      # EMA of the mean per-source gradient, or ()
  params_weight: Any     # [] its EMA weight, or ()


class GroupedState(NamedTuple):
  """An :class:`EstimatorState` with same-shaped blocks stacked.

  ``stacked`` maps each group of blocks that differ only in their layer
  (:func:`_groups`) to one state, stacked along a new leading axis when the
  group has more than one layer. Its keys name the group's layer indices
  (``"3"``, ``"1,2,4"``), so the grouping is part of the pytree structure
  and survives ``jit``, checkpoints and flax serialisation. This is the
  estimator state the transforms keep in the optax state
  (``CurvatureState.estimator``): the statistics' EMA, the refresh's
  conditional and the products see one array per group and leaf instead
  of one per layer, so the compiled step has ``O(groups)`` kernels there
  instead of ``O(layers)``, and no step splits the state per layer to
  stack it again (at depth 48 those slices were a third of the compile).

  ``blocks`` is the per-layer view, as :class:`EstimatorState` has it
  (``state.estimator.blocks[i].a``): read-only, sliced out of the stacks
  when asked for. :meth:`FisherEstimator.group_state` and
  :meth:`~FisherEstimator.ungroup_state` convert between the two forms;
  every estimator method accepts either.
  """
  stacked: dict          # "i,j,..." -> the group's (stacked) block state
  params_stats: Any      # as EstimatorState
  params_weight: Any

  @property
  def groups(self) -> tuple:
    """The layer indices of each group, in the order of ``stacked``."""
    return tuple(tuple(int(i) for i in k.split(",")) for k in self.stacked)

  @property
  def blocks(self) -> tuple:
    """One block state per layer, in collection order."""
    groups = self.groups
    return tuple(_per_layer(groups, list(self.stacked.values()),
                            sum(len(g) for g in groups)))


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


def _group_name(group) -> str:
  return ",".join(str(i) for i in group)


# ---------------------------------------------------------------------------
# Cotangents at the loss tags.
# ---------------------------------------------------------------------------


def _loss_cotangents(mode, specs, zs, targets, key, num_samples):
  """Per loss, the stacked cotangents ``[S, *z.shape]`` (same S for all)."""
  if mode == "empirical":
    out = []
    for i, (spec, z, y) in enumerate(zip(specs, zs, targets)):
      if y is None:
        raise ValueError(
            f"estimation_mode='empirical' needs data targets, but loss tag "
            f"{i} ({spec.kind}) was registered without targets. Pass "
            "targets=... to its register_* call, or use 'gradients'.")
      out.append((math.sqrt(spec.weight) * spec.nll_grad(z, y))[None])
    return out
  if mode in ("exact", "exact_GGN"):
    cols = [math.sqrt(s.weight) * s.factor_columns(z)
            for s, z in zip(specs, zs)]
    total = sum(c.shape[0] for c in cols)
    out, offset = [], 0
    for c in cols:
      pad = ((offset, total - offset - c.shape[0]),) + ((0, 0),) * (c.ndim - 1)
      out.append(jnp.pad(c, pad))
      offset += c.shape[0]
    return out
  out = []
  for i, (spec, z) in enumerate(zip(specs, zs)):
    scale = math.sqrt(spec.weight / num_samples)
    # Hashed keys and draws: no threefry in the step (kfac_jax_lite.keys).
    ks = keys_lib.sample_keys(key, i, num_samples)
    if mode == "gradients":
      ct = jax.vmap(lambda kk, z=z, spec=spec: spec.nll_grad(
          z, spec.sample(kk, z)))(ks)
    else:  # curvature_prop(_GGN): B r with Rademacher r.
      def one(kk, z=z, spec=spec):
        dt = jnp.promote_types(z.dtype, jnp.float32)
        r = jnp.where(keys_lib.uniform(kk, z.shape) < 0.5, -1.0, 1.0
                      ).astype(dt)
        return spec.fisher_factor(z, r)
      ct = jax.vmap(one)(ks)
    out.append(scale * ct)
  return out


def _site_layout(x, n_scan):
  """``[T1..Tk, B, ...]`` -> ``[B, U, ...]`` (U = T1*..*Tk, 1 if no scan)."""
  lead = x.shape[:n_scan]
  x = x.reshape((int(math.prod(lead)),) + x.shape[n_scan:])
  return jnp.moveaxis(x, 0, 1)


def _grads_layout(g, n_scan):
  """``[S, T1..Tk, B, ...]`` -> ``[S, B, U, ...]``."""
  return jax.vmap(lambda x: _site_layout(x, n_scan))(g)


def _site_inputs(x, site):
  """A recorded input in block layout; stacked sites get the stack axis first.

  ``[T1..Tk, B, ...]`` -> ``[B, U, ...]``, or ``[L, B, U, ...]`` when scan
  ``site.stack`` slices the layer's stacked parameters (``U`` then counts
  the other scans' steps only).
  """
  n = len(site.scan_lengths)
  if site.stack is None:
    return _site_layout(x, n)
  return jax.vmap(lambda t: _site_layout(t, n - 1))(
      jnp.moveaxis(x, site.stack, 0))


def _site_grads(g, site):
  """``[S, T1..Tk, B, ...]`` -> ``[S, B, U, ...]`` (``[L, S, B, U, ...]``)."""
  n = len(site.scan_lengths)
  if site.stack is None:
    return _grads_layout(g, n)
  return jax.vmap(lambda t: _grads_layout(t, n - 1))(
      jnp.moveaxis(g, site.stack + 1, 0))


def _param_grads(p_bar, layer):
  """``[S, *leaf]``; ``[L, S, ...]`` for a stacked layer."""
  return jnp.moveaxis(p_bar, 1, 0) if layer.stack else p_bar


class Linearized:
  """One linearisation of the loss function (a single forward pass).

  Its transpose gives the gradient and the statistics' output gradients; its
  JVP gives ``J u`` for Fisher-vector products (the optimizer's quadratic
  model). Built inside a trace; not a pytree.

  With ``with_jvp=False`` (the gradient and the statistics only) it is
  built by ``jax.vjp``, whose pullback transposes the linear jaxpr
  directly. ``jax.linearize`` (``with_jvp=True``) returns a JVP function
  instead, and its transpose (``jax.linear_transpose``) first re-traces
  that function into a jaxpr: one more pass over every equation of the
  model at trace time (0.79–0.83 s instead of 0.96–1.05 s to trace the
  48-block unrolled step of ``benchmarks/compile_depth.py``), for the same
  backward program. Asked
  for a JVP anyway, a ``with_jvp=False`` linearisation transposes its
  pullback once (correct, and costs that pass back).
  """

  def __init__(self, collection: LayerCollection, params, batch,
               head_only: bool = False, with_jvp: bool = False):
    # Under shard_map, linearise per replica (see distributed.vary).
    self._axes = distributed.varying_axes(batch)
    params = distributed.vary(params, self._axes)
    traced = scanner.perturbed_fn(collection, params, batch)
    eps = distributed.vary(traced.eps, self._axes)
    if with_jvp:
      (loss, zs), jvp, (aux, records, targets) = jax.linearize(
          traced.fn, params, eps, has_aux=True)
      vjp = jax.linear_transpose(jvp, params, eps)
    else:
      (loss, zs), vjp, (aux, records, targets) = jax.vjp(
          traced.fn, params, eps, has_aux=True)
      jvp = None
    self.collection = collection
    self.params = params
    self.sites = traced.sites
    self.eps = eps
    self.loss, self.zs, self.aux = loss, zs, aux
    self.records, self.targets = records, targets
    self._jvp = jvp
    self.vjp = vjp
    # True for the linearisation of a batch's first ⌈f·B⌉ examples
    # (FisherEstimator.linearize_head): its statistics use every row.
    self.head_only = head_only

  @property
  def jvp(self):
    """``(u, eps_tangent) -> (loss, zs)`` tangents: the linearisation."""
    if self._jvp is None:  # Built by jax.vjp: transpose its pullback once.
      transposed = jax.linear_transpose(self.vjp, (self.loss, self.zs))
      self._jvp = lambda u, eps_t: transposed((u, eps_t))[0]
    return self._jvp

  def gradient(self):
    """``∂ loss / ∂ params``: this replica's own under ``shard_map``/``pmap``.

    Unlike ``jax.grad`` under ``shard_map``, which sums the gradient of
    replicated parameters over the axis, this is never reduced: average it
    with ``lax.pmean`` as under ``pmap``.
    """
    return self.vjp((jnp.ones_like(self.loss),
                     tuple(jnp.zeros_like(z) for z in self.zs)))[0]

  def output_jvp(self, tangent):
    """``J u``: the loss tags' input tangents for a params-shaped ``u``."""
    eps_t = jax.tree.map(jnp.zeros_like, self.eps)
    return self.jvp(distributed.vary(tangent, self._axes), eps_t)[1]


@dataclasses.dataclass(frozen=True)
class _Pass:
  """Statistics inputs from one linearisation."""
  layer_data: tuple
  param_grads_all: Any   # [S, leaf] grads of the summed source losses, or None


def stats_rows(batch_size: int, fraction: float, minimum: int = 1) -> int:
  """``min(B, max(⌈fraction · B⌉, minimum))``: the examples whose rows
  enter the factors."""
  rows = max(minimum, math.ceil(fraction * batch_size - 1e-9))
  return max(1, min(batch_size, rows))


def _first_examples(x, axis: int, rows: int):
  """The first ``rows`` entries of ``x`` along its batch ``axis``."""
  if x.shape[axis] == rows:
    return x
  return lax.slice_in_dim(x, 0, rows, axis=axis)


def _site_head(x, site, rows, leading=0):
  """A recorded site array cut to its first ``rows`` examples (``None``:
  uncut). Its batch axis follows ``leading`` source axes and the site's
  scan axes: ``[S?, T1..Tk, B, ...]``."""
  if rows is None:
    return x
  return _first_examples(x, leading + len(site.scan_lengths), rows)


def _statistics_pass(lin: Linearized, blocks, key, mode, num_samples,
                     need_all_param_grads, axis_name=None,
                     fraction: float = 1.0, min_rows: int = 1) -> _Pass:
  collection = lin.collection
  cts = _loss_cotangents(mode, collection.losses, lin.zs, lin.targets, key,
                         num_samples)
  cts = tuple(c.astype(z.dtype) for c, z in zip(cts, lin.zs))
  generic = sorted({i for l, b in zip(collection.layers, blocks)
                    if b.needs_param_grads for i in l.param_indices})

  def pull(ct):
    p_bar, eps_bar = lin.vjp((jnp.zeros_like(lin.loss), ct))
    leaves = jax.tree.leaves(p_bar)
    if need_all_param_grads:
      return leaves, eps_bar
    return {i: leaves[i] for i in generic}, eps_bar

  if cts[0].shape[0] == 1:
    # One cotangent per loss (one sample): a direct VJP. A size-1 vmap
    # would put a unit axis on every op of the backward pass, which XLA's
    # simplifier strips one layer per fixed-point iteration (its loop
    # length grows with depth).
    p_bars, eps_bars = jax.tree.map(
        lambda x: x[None], pull(tuple(c[0] for c in cts)))
  else:
    p_bars, eps_bars = jax.vmap(pull)(cts)
  batch_size = lin.zs[0].shape[0]
  block_p_bars, block_batch = p_bars, batch_size
  if axis_name is not None and generic:
    # Square-of-sum statistics are no means over examples: sum the
    # per-source gradients over the global batch before the blocks square.
    block_p_bars = {i: lax.psum(p_bars[i], axis_name) for i in generic}
    block_batch = batch_size * distributed.axis_size(axis_name)
  leaves = jax.tree.leaves(lin.params)
  sites_of = {}
  for s in lin.sites:
    sites_of.setdefault(s.leaves, []).append(s)
  # Row statistics use the first ⌈fraction·B⌉ examples: recorded inputs are
  # [T1..Tk, B, ...] and output gradients [S, T1..Tk, B, ...].
  # Blocks from summed parameter gradients keep the whole batch (their
  # sites may have no batch axis at all).
  rows = stats_rows(batch_size, fraction, min_rows)
  data = []
  for layer, block in zip(collection.layers, blocks):
    sites = sites_of.get(layer.param_indices, [])
    n = None if block.needs_param_grads else rows
    data.append(blocks_lib.LayerData(
        inputs=tuple(tuple(_site_inputs(_site_head(x, s, n), s)
                           for x in lin.records[s.key]) for s in sites),
        grads=tuple(_site_grads(_site_head(eps_bars[s.key], s, n, 1), s)
                    for s in sites),
        params=tuple(leaves[i] for i in layer.param_indices),
        param_grads=tuple(_param_grads(block_p_bars[i], layer)
                          for i in layer.param_indices)
        if block.needs_param_grads else (),
        batch_size=block_batch if block.needs_param_grads else rows))
  return _Pass(layer_data=tuple(data),
               param_grads_all=p_bars if need_all_param_grads else None)


# ---------------------------------------------------------------------------
# FisherEstimator.
# ---------------------------------------------------------------------------


def _group_key(block, state):
  """Blocks with equal keys can be stacked: same type, options, layout,
  state shapes and parameter shapes (vectors are stacked too)."""
  shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(state))
  return (dataclasses.replace(block, layer=None), jax.tree.structure(state),
          shapes, block.layer.param_shapes)


def _groups(blocks, states) -> list:
  """Indices of blocks that differ only in their layer, grouped."""
  groups = {}
  for i, (b, s) in enumerate(zip(blocks, states)):
    groups.setdefault(_group_key(b, s), []).append(i)
  return list(groups.values())


def _shapes(tree) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((x.shape, str(x.dtype)) for x in leaves)


def _stack_group(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _unstack_group(tree, n, runtime_index=False) -> list:
  """The ``n`` slices of a stacked tree, ``[x[0], ..., x[n-1]]``.

  With ``runtime_index`` each ``x[j]`` is a ``dynamic_slice`` at an index
  XLA does not know at compile time (:func:`linalg.opaque_indices`): the
  kernels that consume the slices of one group are then one kernel with
  different arguments, which XLA compiles once, where a static slice
  bakes ``j`` into each kernel (at depth 48 of
  ``benchmarks/compile_depth.py``: 196 kernels compiled one by one). Use
  it where the slices are materialised anyway (outputs); static slices
  let XLA cancel a split followed by a stack.
  """
  if not runtime_index:
    return [jax.tree.map(lambda x, j=j: x[j], tree) for j in range(n)]
  index = linalg.opaque_indices(n, jax.tree.leaves(tree)[0])
  return [jax.tree.map(
      lambda x, j=j: jax.lax.dynamic_index_in_dim(x, j, keepdims=False),
      tree) for j in index]


def _per_layer(groups, per_group, num_layers, runtime_index=False) -> list:
  """Per-layer entries from per-group ones (stacked for groups of 2+;
  ``runtime_index`` as :func:`_unstack_group`)."""
  out = [None] * num_layers
  for g, r in zip(groups, per_group):
    parts = [r] if len(g) == 1 else _unstack_group(r, len(g), runtime_index)
    for i, part in zip(g, parts):
      out[i] = part
  return out


def _run_grouped(groups, blocks, fn, *args, static=None, per_group=None):
  """``fn(block, *args_i)`` per layer, one ``jax.vmap`` per group of indices.

  Every group's blocks must be equal up to their layer and its ``args``
  must have equal structures and shapes; ``args`` are per-layer lists (an
  entry None is passed as None). ``static``: optional per-layer Python
  values, equal within a group, passed last and unbatched. ``per_group``:
  an optional list that receives each group's result as computed (stacked
  for groups of 2+), before it is split per layer.
  """
  out = [None] * len(blocks)
  static = static if static is not None else [None] * len(blocks)
  for idx in groups:
    b, st = blocks[idx[0]], static[idx[0]]
    if len(idx) == 1:
      out[idx[0]] = fn(b, *[a[idx[0]] for a in args], st)
      if per_group is not None:
        per_group.append(out[idx[0]])
      continue
    stacked = [_stack_group([a[i] for i in idx]) for a in args]
    res = jax.vmap(lambda *xs, b=b, st=st: fn(b, *xs, st))(*stacked)
    if per_group is not None:
      per_group.append(res)
    for i, r in zip(idx, _unstack_group(res, len(idx))):
      out[i] = r
  return out


def _grouped(blocks, states, fn, extra=None):
  """Applies ``fn(block, state, extra_i)`` per layer, vmapped per group.

  Blocks that differ only in their layer (same type, layout, options and
  state shapes) are stacked and run through one ``jax.vmap``, so the
  compiled program has one eigendecomposition/inverse per *shape*, not per
  layer.
  """
  extra = extra if extra is not None else [None] * len(blocks)
  return _run_grouped(_groups(blocks, states), blocks,
                      lambda b, s, e, _: fn(b, s, e), states, extra)


def _keyed_groups(keys) -> list:
  groups = {}
  for i, k in enumerate(keys):
    groups.setdefault(k, []).append(i)
  return list(groups.values())


def _grouped_compute_stats(blocks, layer_data, per_group=None) -> list:
  """``block.compute_stats(data)`` per layer, one ``vmap`` per group.

  Layers whose blocks are equal up to their layer, with equal parameter
  shapes and equal ``LayerData`` structure, shapes and (static) batch size,
  are stacked: the statistics of ``L`` same-shaped layers are one batched
  computation (one ``dot_general`` per factor for the group, not ``L``),
  split back per layer (``per_group`` as :func:`_run_grouped`).
  """
  data = [d._replace(batch_size=None) for d in layer_data]
  sizes = [d.batch_size for d in layer_data]
  keys = [(dataclasses.replace(b, layer=None), b.layer.param_shapes,
           _shapes(d), n) for b, d, n in zip(blocks, data, sizes)]
  return _run_grouped(
      _keyed_groups(keys), blocks,
      lambda b, d, n: b.compute_stats(d._replace(batch_size=n)),
      data, static=sizes, per_group=per_group)


def _grouped_update_curvature(blocks, states, stats, decay) -> list:
  """``block.update_curvature(state, stats, decay)`` per layer, vmapped per
  group of blocks equal up to their layer (with equal state and statistics
  shapes). Each block still folds in only its own statistics, and only
  when they are finite (the check is per slice under ``vmap``)."""
  keys = [(_group_key(b, s), _shapes(st))
          for b, s, st in zip(blocks, states, stats)]
  return _run_grouped(
      _keyed_groups(keys), blocks,
      lambda b, s, st, _: b.update_curvature(s, st, decay), states, stats)


def _bucketable(block) -> bool:
  """A Kronecker block whose ``"pi"`` refresh has a dense factor."""
  return (isinstance(block, blocks_lib.kronecker.KroneckerBlock)
          and block.config.damping_type == "pi"
          and not (block.a_diagonal and block.g_diagonal))


def _bucket_requests(blocks, states) -> tuple:
  """``(pick, kinds)``: the indices of the blocks whose dense factors go to
  buckets, and their factors ``(i, name, matrix)`` by kind (factors share
  a bucket only with the same options and dtype; both factors of a block
  always share them)."""
  pick = [i for i, b in enumerate(blocks) if _bucketable(b)]
  kinds = {}
  for i in pick:
    for name, f in blocks[i].factor_requests(states[i]):
      key = (blocks[i].factor_options, str(f.dtype))
      kinds.setdefault(key, []).append((i, name, f))
  return pick, kinds


def _bucket_sizes(blocks, states) -> dict:
  """``{(i, name): N}``: the padded size of every bucketed factor in a
  refresh of ``blocks`` (see :func:`_bucketed_update_cache`)."""
  out = {}
  for items in _bucket_requests(blocks, states)[1].values():
    for size, idx in linalg.size_buckets([f.shape[0] for _, _, f in items]):
      for k in idx:
        out[items[k][:2]] = size
  return out


def _bucketed_update_cache(blocks, states, damping,
                           padded_sizes=None) -> list:
  """``[b.update_cache(s, damping)]``, dense Kronecker factors in buckets.

  The dense factors of every Kronecker block with ``damping_type="pi"``
  (:meth:`KroneckerBlock.factor_requests`), whatever their layer, go to
  :func:`linalg.bucketed_map` with the blocks' split dampings
  (:meth:`KroneckerBlock.factor_dampings`, computed for all blocks as one
  vector from the traces the buckets take): factors of nearby sizes (e.g.
  the 1001 of a ``1000 → 500`` layer's input and the 1000 of a
  ``784 → 1000`` layer's output) are padded with an identity block to one
  size, which is exact (a matrix function of a block-diagonal matrix is
  block-diagonal), so XLA:CPU compiles their factorisation kernels once
  per size instead of once per factor size; the padding adds at most 1/16
  of a factor's size (:func:`linalg.size_buckets`). Other blocks are
  refreshed by :func:`_grouped`, as before. ``padded_sizes`` (``{(i,
  name): N}``, as :func:`_bucket_sizes`) sets the padded sizes instead.
  """
  out = [None] * len(blocks)
  pick, kinds = _bucket_requests(blocks, states)
  rest = [i for i in range(len(blocks)) if i not in set(pick)]
  if rest:
    new = _grouped([blocks[i] for i in rest], [states[i] for i in rest],
                   lambda b, s, _: b.update_cache(s, damping))
    for i, s in zip(rest, new):
      out[i] = s
  caches = {i: {} for i in pick}
  split = {}
  for items in kinds.values():
    members = {(i, name): k for k, (i, name, _) in enumerate(items)}
    owners = list(dict.fromkeys(i for i, _, _ in items))

    def dampings(norms, members=members, owners=owners, items=items):
      # KroneckerBlock.factor_dampings for all the kind's blocks at once.
      dt = norms.dtype
      extra = [(i, n) for i in owners for n in ("a", "g")
               if (i, n) not in members]
      at = dict(members)
      at.update({k: len(items) + j for j, k in enumerate(extra)})
      if extra:  # Diagonal factors' norms, after the members'.
        norms = jnp.concatenate([norms, jnp.stack(
            [linalg.trace_norm(getattr(states[i], n)) for i, n in extra]
        ).astype(dt)])
      scale = jnp.stack([states[i].scale for i in owners]).astype(dt)

      def split_at(idx):  # pi_split of owners[idx], as vectors.
        ta, tg = (norms[np.asarray([at[owners[b], n] for b in idx])]
                  for n in ("a", "g"))
        return linalg.pi_split(ta, tg, jnp.asarray(damping, dt)
                               / scale[np.asarray(idx)])

      if extra:  # The diagonal factors' dampings, per block.
        da, dg = split_at(range(len(owners)))
        for b, i in enumerate(owners):
          split[i] = {"a": da[b], "g": dg[b]}
      # Each member's own split: gathers and arithmetic, all fused into
      # one kernel (per-block vectors gathered afterwards were three).
      da, dg = split_at([owners.index(i) for i, _, _ in items])
      return jnp.where(np.asarray([n == "g" for _, n, _ in items]), dg, da)

    res = linalg.bucketed_map(
        blocks[items[0][0]].factor_cache, [f for _, _, f in items], dampings,
        None if padded_sizes is None else [padded_sizes[i, n]
                                           for i, n, _ in items])
    for (i, name, _), r in zip(items, res):
      caches[i][name] = r
  for i in pick:
    out[i] = blocks[i].with_factor_caches(states[i], damping, caches[i],
                                          split.get(i))
  return out


def _alone_refresh(blocks, states, damping, groups) -> Callable:
  """``refresh(i, state)`` for :func:`distributed.update_cache`: a block
  without a same-shaped twin is refreshed through its bucket's padded
  computation, with the sizes the local refresh of a
  :class:`GroupedState` gives it (its singleton groups share buckets), so
  that the distributed refresh rounds as the local one; other blocks are
  refreshed alone, as the local ``vmap`` over their group does."""
  alone = [g[0] for g in groups if len(g) == 1]
  sizes = _bucket_sizes([blocks[i] for i in alone],
                        [states[i] for i in alone])
  where = {i: k for k, i in enumerate(alone)}

  def refresh(i, state):
    if i not in where:
      return blocks[i].update_cache(state, damping)
    mine = {(0, n): size for (k, n), size in sizes.items() if k == where[i]}
    return _bucketed_update_cache([blocks[i]], [state], damping, mine)[0]

  return refresh


@dataclasses.dataclass(frozen=True)
class FisherEstimator:
  """Block-diagonal curvature estimate for the layers of a collection.

  Math: :math:`\\hat F = \\mathrm{diag}(\\hat F_1, \\dots, \\hat F_L)` with one
  block per layer (Kronecker, diagonal, ...), each an exponential moving
  average (zero-debiased) of minibatch statistics.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    cov_ema_decay: EMA decay ``ρ ∈ [0, 1)`` of the factors.
    damping: default damping λ for :meth:`update_cache` (float or array).
    exps: matrix powers to cache (``-1`` the inverse, ``-0.5``, ...).
    estimation_mode: see the module docstring (kfac-jax names accepted).
    compute_cholesky, compute_cholesky_inverse: cache Cholesky factors.
    compute_params_stats: also keep the EMA of the mean per-source gradient
      (in ``empirical`` mode: the mean gradient).
    num_samples: target draws per example (``gradients``,
      ``curvature_prop``).
    damping_type: ``"pi"`` or ``"exact"``.
    axis_name: the ``pmap``/``shard_map`` axis of data parallelism (a name,
      or a tuple of mesh axis names). The statistics then describe the
      global batch (see :mod:`kfac_jax_lite.distributed`): each replica's
      sampling key is folded with its axis index, generic blocks' gradients
      are summed over the axis, and the factors are averaged as
      ``stats_sync`` says. None: no collectives (also right under plain
      ``jax.jit`` over batch-sharded inputs).
    stats_sync: ``"every_update"`` (default) averages the statistics at
      every update, so every replica always holds the global factors and
      the state is identical on all replicas; ``"before_refresh"`` keeps
      per-replica EMAs and averages the factors only in
      :meth:`update_cache`, writing the average back: exact for the cached
      inverses (the EMA is linear), one all-reduce per refresh instead of
      per update, but between refreshes the replicas' factors (and so
      ``multiply``, ``full_fisher``) are local, and the state must be kept
      per replica (``pmap``, or ``shard_map`` with a sharded state).
    distributed_inverses: split :meth:`update_cache` across the devices of
      ``axis_name``: each computes the inverses of its share of the blocks
      and one ``psum`` shares them (:func:`distributed.update_cache`).
    stats_fraction: ``f ∈ (0, 1]``. Factors built from rows of per-example
      quantities (Kronecker ``A = E[a aᵀ]``, ``G = E[g gᵀ]``, conv, scale
      and shift, embeddings) average over the first ``m = ⌈f·B⌉`` examples
      of each batch (of each replica's batch under ``axis_name``) instead
      of all ``B``: the outer products cost ``f`` times as much, and the
      EMA over steps makes up for the noisier minibatch estimate (TF
      K-FAC's ``sub_sample_outer_products`` / ``sub_sample_inputs`` make
      the same trade). ``m`` is at least ``stats_min_examples`` (or the
      whole batch, if smaller), so small batches keep every example. Take
      shuffled batches: the subset is the first ``m``, not a random draw.
      Under ``jax.jit`` with the batch sharded over devices (no
      ``axis_name``) the first ``m`` examples are on the first devices
      only: correct, but unevenly spread; with ``axis_name``
      (``shard_map``/``pmap``) every replica takes its own first ``m``. Blocks built from summed parameter
      gradients (``full``, ``diagonal`` over generic layers) always use
      the whole batch; so do the gradient and the loss.
    stats_min_examples: the floor on ``m`` above (default 64).

  Example:
    >>> est = FisherEstimator(collection, damping=1e-3)
    >>> state = est.init(params)
    >>> state = est.update_curvature(state, params, batch, rng)
    >>> state = est.update_cache(state)
    >>> direction = est.multiply_inverse(state, grads)
  """
  collection: LayerCollection
  cov_ema_decay: Any = 0.95
  damping: Any = 1e-3
  exps: tuple = (-1,)
  estimation_mode: str = "gradients"
  compute_cholesky: bool = False
  compute_cholesky_inverse: bool = False
  compute_params_stats: bool = False
  num_samples: int = 1
  damping_type: str = "pi"
  axis_name: Any = None
  stats_sync: str = "every_update"
  distributed_inverses: bool = False
  stats_fraction: float = 1.0
  stats_min_examples: int = 64

  def __post_init__(self):
    if not isinstance(self.collection, LayerCollection):
      raise TypeError(
          "FisherEstimator(collection=...) needs the LayerCollection returned "
          f"by kfac_jax_lite.scan(...); got {type(self.collection).__name__}.")
    object.__setattr__(self, "estimation_mode",
                       canonical_mode(self.estimation_mode))
    if isinstance(self.cov_ema_decay, (int, float)) and not (
        0.0 <= self.cov_ema_decay < 1.0):
      raise ValueError(
          f"cov_ema_decay={self.cov_ema_decay!r} must be in [0, 1).")
    if isinstance(self.damping, (int, float)) and self.damping < 0:
      raise ValueError(f"damping={self.damping!r} must be >= 0.")
    if isinstance(self.stats_fraction, bool) or not isinstance(
        self.stats_fraction, (int, float)) or not (
            0.0 < self.stats_fraction <= 1.0):
      raise ValueError(
          f"stats_fraction={self.stats_fraction!r} must be a number in "
          "(0, 1]: the fraction of each batch whose examples enter the "
          "factors (1.0 uses every example).")
    if isinstance(self.stats_min_examples, bool) or not isinstance(
        self.stats_min_examples, int) or self.stats_min_examples < 1:
      raise ValueError(
          f"stats_min_examples={self.stats_min_examples!r} must be a "
          "positive int: the fewest examples stats_fraction may keep.")
    if not isinstance(self.num_samples, int) or self.num_samples < 1:
      raise ValueError(
          f"num_samples={self.num_samples!r} must be a positive int.")
    if self.stats_sync not in distributed.STATS_SYNCS:
      raise ValueError(
          f"stats_sync={self.stats_sync!r}; choose one of "
          f"{list(distributed.STATS_SYNCS)}.")
    if self.distributed_inverses and self.axis_name is None:
      raise ValueError(
          "distributed_inverses=True needs axis_name=... (the pmap/shard_map "
          "axis whose devices share the inverses); without an axis every "
          "device computes all of them.")
    exps = tuple(self.exps) if isinstance(self.exps, (list, tuple)) else (
        self.exps,)
    object.__setattr__(self, "exps", exps)
    config = blocks_lib.BlockConfig(
        exps=exps, compute_cholesky=self.compute_cholesky,
        compute_cholesky_inverse=self.compute_cholesky_inverse,
        damping_type=self.damping_type)
    object.__setattr__(self, "_blocks", tuple(
        blocks_lib.make_block(l, config) for l in self.collection.layers))

  @property
  def blocks(self) -> tuple:
    return self._blocks  # pylint: disable=no-member

  # ---- state -------------------------------------------------------------
  def init(self, params) -> EstimatorState:
    self.collection.check_params(params)
    ps, pw = (), ()
    if self.compute_params_stats:
      ps = jax.tree.map(lambda x: jnp.zeros(x.shape, linalg.factor_dtype()),
                        params)
      pw = jnp.zeros((), linalg.factor_dtype())
    return EstimatorState(blocks=tuple(b.init() for b in self.blocks),
                          params_stats=ps, params_weight=pw)

  # ---- statistics --------------------------------------------------------
  def linearize(self, params, batch, with_jvp: bool = False) -> Linearized:
    """One forward pass of the collection's loss function, linearised.

    ``with_jvp``: build it with its JVP (``jax.linearize``), for Fisher
    products through it (:meth:`Linearized.output_jvp`); without, it
    traces faster and its JVP, if asked for, costs one more transpose
    (:class:`Linearized`).
    """
    return Linearized(self.collection, params, batch, with_jvp=with_jvp)

  def linearize_head(self, params, batch, lin: Linearized,
                     with_jvp: bool = True) -> Linearized:
    """The linearisation the curvature of ``batch`` is estimated from.

    ``lin`` itself when ``stats_fraction`` is 1; otherwise a second, smaller
    forward pass over the first ``m = ⌈f·B⌉`` examples (``B`` the rows of
    ``lin``'s loss tags): every batch leaf whose leading axis has ``B``
    entries is cut to its first ``m``. Its statistics use all its rows, and
    JVPs through it (the optimizer's Fisher products) cost ``f`` times
    those through ``lin``. ``with_jvp``: as :meth:`linearize`, for that
    second pass.

    When the cut batch does not give loss tags of ``m`` rows (examples not
    on the leading axis, e.g. a time-major ``[T, B, ...]`` sequence batch)
    it warns at trace time and returns ``lin``: the factors still use the
    first ``m`` rows, the Fisher products the whole batch.
    """
    total = lin.zs[0].shape[0] if lin.zs else 0
    rows = stats_rows(total, self.stats_fraction,
                      self.stats_min_examples) if total else 0
    if rows == total:
      return lin
    head = jax.tree.map(
        lambda x: _first_examples(x, 0, rows)
        if getattr(x, "ndim", 0) and x.shape[0] == total else x, batch)
    try:
      out = Linearized(self.collection, params, head, head_only=True,
                       with_jvp=with_jvp)
      got = sorted({z.shape[0] for z in out.zs})
      problem = None if got == [rows] else f"loss tags of {got} rows"
    except (TypeError, ValueError) as e:  # The full batch traced fine.
      problem = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if problem is None:
      return out
    warnings.warn(
        f"stats_fraction={self.stats_fraction!r}: cutting the batch to its "
        f"first {rows} of {total} examples (every leaf whose leading axis "
        f"has {total} entries) gave {problem}, so the curvature is "
        "linearised on the whole batch: the factors still use the first "
        "rows, but the Fisher products cost as much as without "
        "stats_fraction. Put the example axis first in every batch leaf to "
        "save that.", stacklevel=2)
    return lin

  def stats_from(self, lin: Linearized, rng):
    """Minibatch statistics from a linearisation (a backward pass each).

    With ``axis_name``, ``rng`` is folded with the replica's axis index
    (pass the same key on every replica).
    """
    if self.axis_name is not None:
      rng = distributed.replica_key(rng, self.axis_name)
    p = _statistics_pass(lin, self.blocks, rng, self.estimation_mode,
                         self.num_samples, self.compute_params_stats,
                         self.axis_name,
                         1.0 if lin.head_only else self.stats_fraction,
                         self.stats_min_examples)
    return self._stats_from_pass(p, lin.params)

  def _stats_tag(self) -> dict:
    """Marks statistics with how they were reduced (static: dict keys)."""
    if self.axis_name is None:
      return {}
    return {f"{self.axis_name!r}, {self.stats_sync}": ()}

  def _stats_from_pass(self, p: _Pass, params):
    with jax.named_scope("kfac_stats"):
      grouped = []
      block_stats = tuple(_grouped_compute_stats(self.blocks, p.layer_data,
                                                 grouped))
    params_stats = ()
    if self.compute_params_stats:
      batch_size = p.layer_data[0].batch_size if p.layer_data else 1
      leaves = [jnp.sum(g, axis=0).astype(linalg.factor_dtype()) / batch_size
                for g in p.param_grads_all]
      params_stats = jax.tree.unflatten(jax.tree.structure(params), leaves)
    # Checked on the stacked groups, before they are split per layer: a
    # check of the per-layer statistics compiled one slice kernel per
    # layer and factor (a third of the statistics' compile at depth 48).
    marker = linalg.finite_marker((grouped, params_stats))
    if self.axis_name is not None:
      # Generic blocks were reduced in the pass (psum of their gradients);
      # the others are means over examples: average them unless deferred.
      defer = self.stats_sync == "before_refresh"
      avg = [None if (b.needs_param_grads or defer) else s
             for b, s in zip(self.blocks, block_stats)]
      avg, params_stats = lax.pmean((avg, params_stats), self.axis_name)
      block_stats = tuple(s if a is None else a
                          for s, a in zip(block_stats, avg))
    return {"blocks": block_stats, "params": params_stats,
            "finite_marker": marker, "averaged_over": self._stats_tag()}

  def _check_stats_tag(self, stats):
    if not isinstance(stats, dict) or "averaged_over" not in stats:
      return
    got, want = tuple(stats["averaged_over"]), tuple(self._stats_tag())
    if got != want:
      describe = lambda t: t[0] if t else "no axis"  # noqa: E731
      raise ValueError(
          f"stats=... were reduced for ({describe(got)}) but this estimator "
          f"has axis_name={self.axis_name!r}, stats_sync={self.stats_sync!r} "
          f"({describe(want)}). Build value_grad_and_stats with the same "
          "axis_name and stats_sync, or pass it estimator=... .")

  def compute_stats(self, params, batch, rng):
    """Minibatch statistics of every block (one forward pass, no gradient)."""
    return self.stats_from(self.linearize(params, batch), rng)

  def update_curvature(self, state: EstimatorState, params=None, batch=None,
                       rng=None, *, stats=None, ema_decay=None):
    """Folds one minibatch into the factors (zero-debiased EMA).

    Give either ``(params, batch, rng)`` or ``stats`` (from
    :func:`value_grad_and_stats` or :meth:`compute_stats`).
    """
    if (batch is None) == (stats is None):
      raise ValueError(
          "update_curvature needs exactly one of batch=... (statistics are "
          "computed from it) or stats=... (from value_grad_and_stats); got "
          f"{'both' if batch is not None else 'neither'}.")
    if stats is None:
      if rng is None:
        rng = jax.random.PRNGKey(0)
      stats = self.compute_stats(params, batch, rng)
    self._check_stats_tag(stats)
    decay = self.cov_ema_decay if ema_decay is None else ema_decay
    with jax.named_scope("kfac_ema"):
      if isinstance(state, GroupedState):
        new_blocks = tuple(self._grouped_ema(state, stats["blocks"], decay))
      else:
        new_blocks = tuple(_grouped_update_curvature(
            self.blocks, state.blocks, stats["blocks"], decay))
    ps, pw = state.params_stats, state.params_weight
    if self.compute_params_stats:
      finite = linalg.all_finite(stats["params"])
      new_ps, new_pw = linalg.ema(ps, stats["params"], pw, decay)
      ps = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_ps, ps)
      pw = jnp.where(finite, new_pw, pw)
    if isinstance(state, GroupedState):
      return state._replace(stacked=dict(zip(state.stacked, new_blocks)),
                            params_stats=ps, params_weight=pw)
    return EstimatorState(blocks=new_blocks, params_stats=ps,
                          params_weight=pw)

  # ---- grouped (stacked) states ------------------------------------------
  def group_state(self, state: EstimatorState) -> GroupedState:
    """Stacks the states of blocks that differ only in their layer.

    :meth:`update_curvature`, :meth:`update_cache` and the products accept
    the result (and return a :class:`GroupedState` for one); every layer's
    results are the same as with the per-layer state. Convert back with
    :meth:`ungroup_state`.
    """
    if isinstance(state, GroupedState):
      return state
    groups = tuple(tuple(g) for g in _groups(self.blocks, state.blocks))
    blocks = tuple(state.blocks[g[0]] if len(g) == 1 else
                   _stack_group([state.blocks[i] for i in g]) for g in groups)
    return GroupedState(dict(zip(map(_group_name, groups), blocks)),
                        state.params_stats, state.params_weight)

  def ungroup_state(self, state) -> EstimatorState:
    """The per-layer :class:`EstimatorState` of a :class:`GroupedState`."""
    if not isinstance(state, GroupedState):
      return state
    return EstimatorState(blocks=state.blocks,
                          params_stats=state.params_stats,
                          params_weight=state.params_weight)

  def _per_group(self, state: GroupedState, fn, xs, stacked=False) -> list:
    """``fn(block, group_state, x)`` per group of ``state``: one ``vmap``
    over the group's stacked state and its layers' ``xs`` (per-layer
    entries; with ``stacked``, per-group entries already stacked like the
    state), or layer by layer when those differ in shape. Results are
    per group, stacked like ``state.stacked``."""
    out = []
    for k, (g, st) in enumerate(zip(state.groups, state.stacked.values())):
      b = self.blocks[g[0]]
      if len(g) == 1:
        out.append(fn(b, st, xs[k] if stacked else xs[g[0]]))
        continue
      if stacked:
        out.append(jax.vmap(lambda s_, x, b=b: fn(b, s_, x))(st, xs[k]))
        continue
      members = [xs[i] for i in g]
      if len({_shapes(m) for m in members}) == 1:
        out.append(jax.vmap(lambda s_, x, b=b: fn(b, s_, x))(
            st, _stack_group(members)))
      else:  # Inputs of different shapes: one layer at a time.
        out.append(_stack_group([
            fn(b, s_, x)
            for s_, x in zip(_unstack_group(st, len(g)), members)]))
    return out

  def _grouped_ema(self, state: GroupedState, stats, decay) -> list:
    return self._per_group(
        state, lambda b, s_, x: b.update_curvature(s_, x, decay), stats)

  def _grouped_update_cache(self, state: GroupedState, damping,
                            layers=None) -> GroupedState:
    wanted = None if layers is None else set(layers)
    out = []
    # Layers without a same-shaped twin are refreshed together, so that
    # factors of nearby sizes share padded buckets (_bucketed_update_cache).
    alone = [k for k, g in enumerate(state.groups) if len(g) == 1 and (
        wanted is None or g[0] in wanted)]
    stacked = list(state.stacked.values())
    refreshed = dict(zip(alone, _bucketed_update_cache(
        [self.blocks[state.groups[k][0]] for k in alone],
        [stacked[k] for k in alone], damping)))
    for k, (g, st) in enumerate(zip(state.groups, stacked)):
      b = self.blocks[g[0]]
      fn = lambda s_, b=b: b.update_cache(s_, damping)  # noqa: E731
      pos = [j for j, i in enumerate(g) if wanted is None or i in wanted]
      if k in refreshed:
        out.append(refreshed[k])
      elif not pos:
        out.append(st)
      elif len(pos) == len(g):
        out.append(jax.vmap(fn)(st))
      else:  # A staggered refresh: only some layers of the group.
        idx = jnp.asarray(pos)
        new = jax.vmap(fn)(jax.tree.map(lambda x: x[idx], st))
        out.append(jax.tree.map(lambda x, n: x.at[idx].set(n), st, new))
    return state._replace(stacked=dict(zip(state.stacked, out)))

  def sync_factors(self, state: EstimatorState, layers=None):
    """Averages the factors over ``axis_name`` (no-op without an axis).

    .. math:: \\bar F \\leftarrow \\frac{1}{R} \\sum_{r=1}^{R} \\bar F^{(r)}

    The average of the replicas' EMAs is the EMA of the averaged
    statistics (the EMA is linear and its weight is the same everywhere),
    so after this every replica holds the factors of the global batch.
    :meth:`update_cache` calls it with ``stats_sync="before_refresh"``.

    Args:
      state: the estimator state.
      layers: optional indices of the layers to average (default: all).
    """
    if self.axis_name is None:
      return state
    if isinstance(state, GroupedState):
      return self.group_state(self.sync_factors(self.ungroup_state(state),
                                                layers))
    idx = range(len(self.blocks)) if layers is None else tuple(layers)
    new = distributed.average_factors([self.blocks[i] for i in idx],
                                      [state.blocks[i] for i in idx],
                                      self.axis_name)
    blocks = list(state.blocks)
    for i, s in zip(idx, new):
      blocks[i] = s
    return state._replace(blocks=tuple(blocks))

  @_blas_threads.limited  # One LAPACK thread: docs/performance.md.
  def update_cache(self, state: EstimatorState, damping=None, layers=None):
    """Refreshes inverses / powers / Cholesky factors at ``damping``.

    With ``stats_sync="before_refresh"`` the refreshed layers' factors are
    first averaged over ``axis_name`` (:meth:`sync_factors`); with
    ``distributed_inverses`` each device of the axis computes a share of
    the blocks (:func:`kfac_jax_lite.distributed.update_cache`).

    Args:
      state: the estimator state.
      damping: λ (float or scalar array); None uses the constructor's.
      layers: optional indices of the layers to refresh (others keep their
        cache); used to stagger refreshes over several steps.
    """
    damping = self.damping if damping is None else damping
    damping = jnp.asarray(damping, linalg.factor_dtype())
    if isinstance(state, GroupedState):
      if self.distributed_inverses:
        return self.group_state(self.update_cache(
            self.ungroup_state(state), damping, layers))
      if self.stats_sync == "before_refresh":
        state = self.sync_factors(state, layers)
      return self._grouped_update_cache(state, damping, layers)
    idx = range(len(self.blocks)) if layers is None else tuple(layers)
    if self.stats_sync == "before_refresh":
      state = self.sync_factors(state, idx)
    blocks = [self.blocks[i] for i in idx]
    states = [state.blocks[i] for i in idx]
    if self.distributed_inverses:
      groups = _groups(blocks, states)
      new = distributed.update_cache(blocks, states, damping, self.axis_name,
                                     groups, _alone_refresh(
                                         blocks, states, damping, groups))
    else:
      new = _bucketed_update_cache(blocks, states, damping)
    blocks = list(state.blocks)
    for i, s in zip(idx, new):
      blocks[i] = s
    return state._replace(blocks=tuple(blocks))

  # ---- products ----------------------------------------------------------
  def _split(self, v, name="v"):
    self.collection.check_params(v, name)
    leaves = jax.tree.leaves(v)
    return leaves, [tuple(leaves[i] for i in l.param_indices)
                    for l in self.collection.layers]

  def _merge(self, v, leaves, parts):
    leaves = list(leaves)
    for layer, part in zip(self.collection.layers, parts):
      for i, x in zip(layer.param_indices, part):
        leaves[i] = x
    return jax.tree.unflatten(jax.tree.structure(v), leaves)

  def _apply(self, state, v, fn: Callable, finish=None, inputs=None):
    """The params-shaped product: ``fn(block, state, x)`` per group (one
    ``vmap`` over a :class:`GroupedState`'s stack, per layer otherwise),
    then the results split per layer and ``finish(block, r, x)``
    (optional) turning a layer's result ``r`` into its parameter tuple.
    The split and the finish sit together under ``kfac_merge``, where
    their slices fuse with the consumers of the product. ``inputs``
    (:meth:`product_inputs` of ``v``) replaces ``v``'s own per-layer
    tuples as what ``fn`` multiplies."""
    blocks = self.blocks
    grouped = isinstance(state, GroupedState)
    if inputs is not None and not grouped:
      raise ValueError(
          "inputs= (product_inputs) needs the state as a GroupedState; got a "
          f"state of type {type(state).__name__}. Pass est.group_state(state) "
          "as the state.")
    leaves, parts = (self._split(v) if inputs is None
                     else (inputs.leaves, inputs.parts))
    finish = finish or (lambda b, r, x: r)
    if inputs is not None:
      out = self._per_group(state, fn, inputs.per_group, stacked=True)
    else:
      out = (self._per_group(state, fn, parts) if grouped
             else _grouped(blocks, state.blocks, fn, parts))
    with jax.named_scope("kfac_merge"):
      if grouped:
        out = _per_layer(state.groups, out, len(blocks), runtime_index=True)
      return self._merge(v, leaves, [finish(b, r, x) for b, r, x in zip(
          blocks, out, parts)])

  def product_inputs(self, state, v, name: str = "v") -> ProductInputs:
    """``v`` (params-shaped) as :meth:`multiply_matpower` multiplies it:
    per group of ``state`` (grouped with :meth:`group_state` if it is
    not), the blocks' :meth:`~blocks.base.Block.product_input` (``[W;
    b]`` for dense layers), stacked like the group's state.

    Pass it to :meth:`multiply_matpower` as ``inputs=``. A caller that
    also checks ``v`` (the transforms' finiteness check) checks
    :meth:`ProductInputs.checked` instead: ``v``'s leaves are then read
    once, by the kernels that build the matrices, and what produced them
    fuses into those (on the autoencoder of ``benchmarks/step_time.py``,
    the gradients of its L2 term were 13 kernels of their own). ``name``
    names ``v`` in the error raised when it does not match the
    parameters.
    """
    state = self.group_state(state)
    leaves, parts = self._split(v, name)
    per_group = self._per_group(state, lambda b, s, x: b.product_input(x),
                                parts)
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
    ``inputs``: :meth:`product_inputs` of ``v``, when the caller made it.
    """
    for b in self.blocks:
      blocks_lib.base.check_exp(b, exp)
    return self._apply(
        state, v, lambda b, s, x: b.multiply_matpower_raw(s, x, exp),
        finish=lambda b, r, x: b.finish_product(r, x), inputs=inputs)

  def multiply(self, state, v):
    return self.multiply_matpower(state, v, 1)

  def multiply_inverse(self, state, v):
    return self.multiply_matpower(state, v, -1)

  def multiply_cholesky(self, state, v, transpose=False):
    return self._apply(state, v, lambda b, s, x: b.multiply_cholesky(
        s, x, transpose))

  def multiply_cholesky_inverse(self, state, v, transpose=False):
    return self._apply(state, v, lambda b, s, x: b.multiply_cholesky_inverse(
        s, x, transpose))

  def full_fisher(self, state):
    """Undamped dense block-diagonal ``[P, P]``, ``ravel_pytree`` order."""
    state = self.ungroup_state(state)
    sizes = [int(math.prod(s)) for s in _leaf_shapes(self.collection)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    out = jnp.zeros((total, total), linalg.factor_dtype())
    for layer, b, s in zip(self.collection.layers, self.blocks, state.blocks):
      idx = jnp.concatenate([jnp.arange(starts[i], starts[i] + sizes[i])
                             for i in layer.param_indices])
      out = out.at[idx[:, None], idx[None, :]].set(b.full_fisher_block(s))
    return out

  def params_stats(self, state):
    if not self.compute_params_stats:
      raise ValueError(
          "params_stats needs FisherEstimator(compute_params_stats=True).")
    return state.params_stats


def _leaf_shapes(collection):
  if collection.leaf_shapes:  # Includes leaves outside params_filter.
    return list(collection.leaf_shapes)
  shapes = [None] * len(collection.leaf_paths)
  for layer in collection.layers:
    for i, s in zip(layer.param_indices, layer.param_shapes):
      shapes[i] = s
  return shapes


# ---------------------------------------------------------------------------
# One pass for loss, gradient and statistics.
# ---------------------------------------------------------------------------


def value_grad_and_stats(loss_fn: Callable, collection: LayerCollection, *,
                         estimation_mode: str = "gradients",
                         has_aux: bool = False, num_samples: int = 1,
                         axis_name: Any = None,
                         stats_sync: str = "every_update",
                         stats_fraction: float = 1.0,
                         stats_min_examples: int = 64,
                         estimator: Optional[FisherEstimator] = None):
  """Loss, gradient and curvature statistics from one forward pass.

  Returns ``fn(params, batch, rng) -> (loss_or_(loss, aux), grads, stats)``.
  The gradient equals ``jax.grad(loss_fn)``; ``stats`` can be passed to
  ``FisherEstimator.update_curvature(stats=...)`` or to the optax
  transforms' ``update(..., stats=...)``.

  Under ``pmap``/``shard_map`` the loss and gradient are this replica's
  (average the gradient yourself, ``lax.pmean(grads, axis_name)``); the
  statistics are reduced over ``axis_name`` as the consumer expects, so
  give the same ``axis_name`` and ``stats_sync`` as the transform (a
  mismatch raises ``ValueError`` in ``update``).

  Args:
    loss_fn: the scanned loss function (must be ``collection.loss_fn``).
    collection: its LayerCollection.
    estimation_mode: as :class:`FisherEstimator`; must match the consumer.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    num_samples: target draws per example.
    axis_name, stats_sync, stats_fraction, stats_min_examples: as
      :class:`FisherEstimator`.
    estimator: use this estimator's blocks and options instead.
  """
  if loss_fn is not collection.loss_fn:
    raise ValueError(
        "value_grad_and_stats(loss_fn=...) must be the function the "
        "collection was scanned from (collection.loss_fn).")
  if has_aux != collection.has_aux:
    raise ValueError(
        f"has_aux={has_aux} but the collection was scanned with "
        f"has_aux={collection.has_aux}.")
  est = estimator or FisherEstimator(
      collection, estimation_mode=estimation_mode, num_samples=num_samples,
      axis_name=axis_name, stats_sync=stats_sync,
      stats_fraction=stats_fraction, stats_min_examples=stats_min_examples)

  def fn(params, batch, rng):
    lin = est.linearize(params, batch)
    stats = est.stats_from(lin, rng)
    out = (lin.loss, lin.aux) if has_aux else lin.loss
    return out, lin.gradient(), stats

  return fn
