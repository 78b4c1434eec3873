"""One linearisation of the loss, and the statistics pass read from it.

:class:`Linearized` is one ``jax.vjp`` (or ``jax.linearize``) of the loss;
:func:`statistics_pass` reads each layer's inputs and output gradients
from it (one :class:`~kfac_jax_lite.blocks.LayerData` per layer), which
:func:`kfac_jax_lite.stats.make_stats` turns into the blocks'
:class:`~kfac_jax_lite.stats.Stats`.

The statistics of every block come from one ``jax.vjp`` of the loss function
re-evaluated with zero perturbations at the tagged layer outputs
(:func:`kfac_jax_lite.scanner.perturbed_fn`):

* cotangent 1 on the loss gives the true gradient (and, for free, the
  per-layer gradients of the mean loss);
* cotangents :math:`c_s` at each loss tag's parameters ``z`` give the output
  gradients :math:`J_s^T c_s` used by the Fisher factors. They are, per
  estimation mode (``S`` the number of sources, and per position ``n`` the
  scale :math:`\\rho_n = \\sqrt{w B / N}\\, m_n`: ``w`` the loss weight,
  ``B`` the batch's examples, ``N`` the tag's kept positions, ``m`` its
  mask, :meth:`~kfac_jax_lite.losses.LossSpec.cotangent_scale`):

  - ``gradients``: :math:`\\rho_n S^{-1/2} \\nabla_z \\mathrm{nll}(z_n,
    \\hat y_{s,n})`, :math:`\\hat y_s \\sim p(y|z)` (Martens & Grosse 2015,
    sec. 5);
  - ``empirical``: :math:`\\rho_n \\nabla_z \\mathrm{nll}(z_n, y_n)` with
    data targets (so the Fisher scales by ``w``, not ``w²`` as TF K-FAC
    did);
  - ``curvature_prop`` / ``curvature_prop_GGN``: :math:`\\rho_n S^{-1/2}
    B_n r_{s,n}`, ``r`` Rademacher, ``B Bᵀ = F_R`` (Martens, Sutskever &
    Swersky 2012);
  - ``exact`` / ``exact_GGN``: :math:`\\rho_n B_n e_k` for every coordinate
    ``k`` of one example's positions (``vmap``, no Python loop).

  All sources are pulled back through the *same* linearisation with
  ``jax.vmap`` over the cotangents; the forward pass runs once. The blocks
  average over the ``B`` examples, so with :math:`\\rho` they estimate the
  Fisher of the registered mean loss, :math:`\\frac{w}{N} \\sum_n m_n
  J_n^T F_R(z_n) J_n` (:mod:`kfac_jax_lite.losses`).

The examples are rows of the layer sites' batch axis: ``B`` is a leading
size (after ``lax.scan`` axes) of the recorded layer inputs, the first loss
tag's leading size when it is one and divides every tag's positions (a
``[B, T, V]`` tag), else the smallest size that does (a ``[B·T, V]`` tag).
A site with ``k·B`` rows holds ``k`` consecutive rows per example (a
flattened ``[B·T, d]`` activation); without layer inputs ``B`` is the first
loss tag's leading size. A loss tag's positions group by example in the
same way (:meth:`~kfac_jax_lite.losses.LossSpec.positions_per_example`):
that grouping matters to the ``exact`` modes' columns, to ``stats_fraction``
(which keeps whole examples: all positions of the first ``⌈f·B⌉``
sequences) and to blocks that sum over an example's uses before squaring
(``kron_reduce``, ``diagonal``, ``full``); a Kronecker ``kron``/
``kron_indep`` block does not depend on it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, cast
import warnings

import jax
from jax import lax
import jax.numpy as jnp

from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import distributed
from kfac_jax_lite import keys as keys_lib
from kfac_jax_lite import losses as losses_lib
from kfac_jax_lite import scanner
from kfac_jax_lite.collection import LayerCollection

MODES = ("gradients", "empirical", "curvature_prop", "curvature_prop_GGN",
         "exact", "exact_GGN")
MODE_ALIASES = {
    "fisher_gradients": "gradients", "fisher_empirical": "empirical",
    "fisher_curvature_prop": "curvature_prop",
    "ggn_curvature_prop": "curvature_prop_GGN", "fisher_exact": "exact",
    "ggn_exact": "exact_GGN"}


# keys.derive's index of the draw that offsets strided factor rows (the
# loss tags' target samples use the indices 0, 1, ...).
ROW_DRAW_INDEX = 0x7FFF_FFFF


def canonical_mode(mode: str) -> str:
  mode = MODE_ALIASES.get(mode, mode)
  if mode not in MODES:
    raise ValueError(
        f"estimation_mode={mode!r} is unknown; choose one of {list(MODES)} "
        f"(or kfac-jax's names {sorted(MODE_ALIASES)}).")
  return mode


def _scaled(scale, x):
  """``scale · x``: a Python float, or a per-position array (masked
  positions give 0 even where ``x`` is not finite)."""
  if isinstance(scale, float):
    return scale * x
  return jnp.where(scale > 0, scale * x, 0.0)


def _loss_cotangents(mode, specs, zs, targets, masks, key, num_samples,
                     examples):
  """Per loss, the stacked cotangents ``[S, *z.shape]`` (same S for all)."""
  for i, spec in enumerate(specs):
    spec.check_mode(mode, i)
  ggn = mode.endswith("_GGN")
  if mode == "empirical":
    out = []
    for i, (spec, z, y, m) in enumerate(zip(specs, zs, targets, masks)):
      if y is None:
        raise ValueError(
            f"estimation_mode='empirical' needs data targets, but loss tag "
            f"{i} ({spec.kind}) was registered without targets. Pass "
            "targets=... to its register_* call, or use 'gradients'.")
      out.append(_scaled(spec.cotangent_scale(z, m, examples),
                         spec.nll_grad(z, y))[None])
    return out
  if mode in ("exact", "exact_GGN"):
    cols = [_scaled(s.cotangent_scale(z, m, examples),
                    s.factor_columns(z, examples, y, ggn))
            for s, z, y, m in zip(specs, zs, targets, masks)]
    total = sum(c.shape[0] for c in cols)
    out, offset = [], 0
    for c in cols:
      pad = ((offset, total - offset - c.shape[0]),) + ((0, 0),) * (c.ndim - 1)
      out.append(jnp.pad(c, pad))
      offset += c.shape[0]
    return out
  out = []
  for i, (spec, z, y, m) in enumerate(zip(specs, zs, targets, masks)):
    scale = spec.cotangent_scale(z, m, examples, num_samples)
    # Hashed keys and draws: no threefry in the step (kfac_jax_lite.keys).
    ks = keys_lib.sample_keys(key, i, num_samples)
    if mode == "gradients":
      ct = jax.vmap(lambda kk, z=z, spec=spec: spec.nll_grad(
          z, spec.sample(kk, z)))(ks)
    else:  # curvature_prop(_GGN): B r with Rademacher r.
      def one(kk, z=z, y=y, spec=spec):
        dt = jnp.promote_types(z.dtype, jnp.float32)
        r = jnp.where(keys_lib.uniform(kk, z.shape) < 0.5, -1.0, 1.0
                      ).astype(dt)
        return (spec.ggn_factor if ggn else spec.fisher_factor)(z, r, y)
      ct = jax.vmap(one)(ks)
    out.append(_scaled(scale, ct))
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
  directly; ``jax.linearize`` (``with_jvp=True``) returns a JVP function
  whose transpose re-traces the model once more at trace time
  (docs/performance.md#vjp-not-linearize). Asked for a JVP anyway, a
  ``with_jvp=False`` linearisation transposes its pullback once.
  """

  def __init__(self, collection: LayerCollection, params, batch,
               head_only: bool = False, with_jvp: bool = False):
    # Under shard_map, linearise per replica (see distributed.vary).
    self._axes = distributed.varying_axes(batch)
    params = distributed.vary(params, self._axes)
    traced = scanner.perturbed_fn(collection, params, batch)
    eps = distributed.vary(traced.eps, self._axes)
    if with_jvp:
      (loss, zs), jvp, (aux, records, targets, masks) = jax.linearize(
          traced.fn, params, eps, has_aux=True)
      vjp = jax.linear_transpose(jvp, params, eps)
    else:
      (loss, zs), vjp, (aux, records, targets, masks) = jax.vjp(
          traced.fn, params, eps, has_aux=True)
      jvp = None
    self.collection = collection
    self.params = params
    self.sites = traced.sites
    self.eps = eps
    self.loss, self.zs, self.aux = loss, zs, aux
    self.records, self.targets, self.masks = records, targets, masks
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


def output_fisher_gram(lin: Linearized, jvs) -> jnp.ndarray:
  """``[vᵢᵀ F vⱼ]`` with ``F`` the exact minibatch Fisher (GGN) of the
  registered losses, from their output tangents.

  .. math:: v_i^T F v_j = \\sum_\\ell \\frac{w_\\ell}{N_\\ell} \\sum_n
     m_{\\ell,n} (J_n v_i)^T F_R(z_n) (J_n v_j)

  (``N_ℓ`` the kept positions of tag ``ℓ``, ``m`` its mask).

  Args:
    lin: the linearisation the tangents come from.
    jvs: per loss tag, the stacked ``[k, *z.shape]`` tangents ``J vᵢ``
      (e.g. :meth:`Linearized.output_jvp` of ``k`` vectors, stacked).

  Returns:
    The ``[k, k]`` Gram matrix (this replica's, not averaged).
  """
  gram = 0.0
  for spec, z, y, m, jv in zip(lin.collection.losses, lin.zs, lin.targets,
                               lin.masks, jvs):
    fjv = jax.vmap(lambda v, z=z, y=y, spec=spec: spec.multiply_fisher(
        z, v, y))(jv)
    gram = gram + spec.fisher_gram(z, m, jv, fjv)
  return cast(jnp.ndarray, gram)  # an array: a collection has a loss tag


@dataclasses.dataclass(frozen=True)
class Pass:
  """Statistics inputs from one linearisation."""
  layer_data: tuple
  param_grads_all: Any   # [S, leaf] grads of the summed source losses, or None
  grad_norm: Any = 1     # √(B·N): param_grads_all's sum over S / it = mean


def check_fraction(stats_fraction):
  """Raises ``ValueError`` unless ``stats_fraction`` is a number in
  ``(0, 1]`` (NaN fails the comparison too)."""
  if isinstance(stats_fraction, bool) or not isinstance(
      stats_fraction, (int, float)) or not (
          0.0 < stats_fraction <= 1.0):
    raise ValueError(
        f"stats_fraction={stats_fraction!r} must be a number in "
        "(0, 1]: the fraction of each batch whose examples enter the "
        "factors (1.0 uses every example).")


def check_stride(stats_position_stride):
  """Raises ``ValueError`` unless ``stats_position_stride`` is None or a
  positive int."""
  k = stats_position_stride
  if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                        or k < 1):
    raise ValueError(
        f"stats_position_stride={k!r} must be a positive int k (dense "
        "Kronecker factors average every k-th row: 1 uses every row) or "
        "None (chosen per platform when lowering).")


def check_options(stats_fraction, stats_min_examples, num_samples,
                  stats_position_stride: Optional[int] = 1):
  """Raises ``ValueError`` for an invalid option of the statistics."""
  check_fraction(stats_fraction)
  check_stride(stats_position_stride)
  if isinstance(stats_min_examples, bool) or not isinstance(
      stats_min_examples, int) or stats_min_examples < 1:
    raise ValueError(
        f"stats_min_examples={stats_min_examples!r} must be a "
        "positive int: the fewest examples stats_fraction may keep.")
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(
        f"num_samples={num_samples!r} must be a positive int.")


# The fewest examples a ``stats_fraction`` below 1 keeps of a batch (the
# ``stats_min_examples`` default of ``FisherEstimator``,
# ``value_grad_and_stats`` and ``kfac``'s ``stats_fraction``).
STATS_MIN_EXAMPLES = 64


def stats_rows(batch_size: int, fraction: float, minimum: int = 1) -> int:
  """``min(B, max(⌈fraction · B⌉, minimum))``: the examples whose rows
  enter the factors."""
  rows = max(minimum, math.ceil(fraction * batch_size - 1e-9))
  return max(1, min(batch_size, rows))


def first_examples(x, axis: int, rows: int):
  """The first ``rows`` entries of ``x`` along its batch ``axis``."""
  if x.shape[axis] == rows:
    return x
  return lax.slice_in_dim(x, 0, rows, axis=axis)


def batch_head(batch, total: int, rows: int):
  """The first ``rows`` examples of ``batch``: every leaf whose leading axis
  has ``total`` entries is cut to its first ``rows``; the others stay."""
  return jax.tree.map(
      lambda x: first_examples(x, 0, rows)
      if getattr(x, "ndim", 0) and x.shape[0] == total else x, batch)


def _site_rows(lin: Linearized) -> dict:
  """``{leading size: site}`` of the sites with recorded inputs (their
  batch axis follows the site's scan axes)."""
  out = {}
  for s in lin.sites:
    recs = lin.records[s.key]
    axis = len(s.scan_lengths)
    if recs and recs[0].ndim > axis:
      out.setdefault(int(recs[0].shape[axis]), s)
  return out


def example_count(lin: Linearized) -> int:
  """``B``, the examples of the batch (see the module docstring).

  Raises:
    ValueError: if a layer input's leading size is not a multiple of the
      smallest one.
  """
  sizes = _site_rows(lin)
  z0 = lin.zs[0]
  first = int(z0.shape[0]) if z0.ndim else 1
  if not sizes:
    return first
  # Prefer a size that divides every loss tag's positions, and among those
  # the first loss tag's leading size (a [B, T, V] tag: B).
  fits = [n for n in sizes if all(p % n == 0 for p in _positions(lin))]
  b = first if first in fits else min(fits or sizes)
  bad = [n for n in sizes if n % b]
  if bad:
    raise ValueError(
        f"The layer at {sizes[bad[0]].key} records inputs with {bad[0]} "
        f"rows on its batch axis, not a multiple of the batch's {b} "
        f"examples (the smallest leading size, at {sizes[b].key}). Every "
        "tagged layer input needs the batch as its leading axis (after any "
        "lax.scan axes), or a flattening of it with each example's rows "
        "together; register a layer without one with register_generic.")
  return b


def _site_head(x, site, rows, examples, leading=0):
  """A recorded site array cut to its first ``rows`` examples (``None``:
  uncut). Its batch axis follows ``leading`` source axes and the site's
  scan axes, ``[S?, T1..Tk, R, ...]``, and holds ``R / examples``
  consecutive rows per example."""
  if rows is None:
    return x
  axis = leading + len(site.scan_lengths)
  return first_examples(x, axis, rows * (x.shape[axis] // examples))


def _map_sources(pull, cts):
  """``pull`` over the leading (source) axis of ``cts``: one ``vmap``, or a
  ``lax.map`` where JAX has no batching rule for the backward pass (the
  kernel transpose of a grouped convolution, as in depthwise and separable
  layers, under ``shard_map``/``pmap``)."""
  try:
    return jax.vmap(pull)(cts)
  except NotImplementedError:
    return lax.map(pull, cts)


def statistics_pass(lin: Linearized, blocks, key, mode, num_samples,
                     need_all_param_grads, axis_name=None,
                     fraction: float = 1.0, min_rows: int = 1) -> Pass:
  collection = lin.collection
  batch_size = example_count(lin)
  cts = _loss_cotangents(mode, collection.losses, lin.zs, lin.targets,
                         lin.masks, key, num_samples, batch_size)
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
    p_bars, eps_bars = _map_sources(pull, cts)
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
  # [T1..Tk, R, ...] and output gradients [S, T1..Tk, R, ...], R = k·B.
  # Blocks from summed parameter gradients keep the whole batch (their
  # sites may have no batch axis at all).
  rows = stats_rows(batch_size, fraction, min_rows)
  # One offset draw per pass for blocks that average a strided subset of
  # their rows (BlockConfig.stats_position_stride).
  # Without a key (the modes that sample nothing) every row is used.
  draw = None if key is None else keys_lib.uniform(
      keys_lib.derive(key, ROW_DRAW_INDEX), ())
  data = []
  for layer, block in zip(collection.layers, blocks):
    sites = sites_of.get(layer.param_indices, [])
    n = None if block.needs_param_grads else rows
    data.append(blocks_lib.LayerData(
        inputs=tuple(tuple(_site_inputs(_site_head(x, s, n, batch_size), s)
                           for x in lin.records[s.key]) for s in sites),
        grads=tuple(_site_grads(_site_head(eps_bars[s.key], s, n,
                                           batch_size, 1), s)
                    for s in sites),
        params=tuple(leaves[i] for i in layer.param_indices),
        param_grads=tuple(_param_grads(block_p_bars[i], layer)
                          for i in layer.param_indices)
        if block.needs_param_grads else (),
        batch_size=block_batch if block.needs_param_grads else rows,
        row_draw=None if block.needs_param_grads else draw))
  return Pass(layer_data=tuple(data),
              param_grads_all=p_bars if need_all_param_grads else None,
              grad_norm=_grad_norm(lin, batch_size))


def _grad_norm(lin: Linearized, examples: int):
  """``√(B·N)`` of the first loss tag: the sum over the batch of the
  summed sources' parameter gradients, divided by it, is the mean
  per-source gradient of that (weight-1) loss."""
  spec, z, m = lin.collection.losses[0], lin.zs[0], lin.masks[0]
  n = spec.count(z, m)
  if isinstance(n, int):
    return examples if n == examples else math.sqrt(examples * n)
  return jnp.sqrt(examples * jnp.maximum(n, 1).astype(jnp.float32))


def _positions(lin: Linearized) -> tuple:
  return tuple(losses_lib.num_positions(z.shape) for z in lin.zs)


def linearize_head(collection, params, batch, lin: Linearized,
                   fraction: float, min_examples: int,
                   with_jvp: bool = True) -> Linearized:
  """:meth:`FisherEstimator.linearize_head`: ``lin``, or the linearisation
  of the batch's first ``m = ⌈f·B⌉`` examples (warning and returning
  ``lin`` when the cut batch does not give ``m`` examples whose loss tags
  have ``m/B`` of the positions)."""
  try:
    total = example_count(lin)
  except ValueError as e:  # The statistics pass raises it again.
    warnings.warn(f"stats_fraction={fraction!r}: {e}", stacklevel=3)
    return lin
  rows = stats_rows(total, fraction, min_examples)
  if rows == total:
    return lin
  head = batch_head(batch, total, rows)
  want = tuple(p * rows // total for p in _positions(lin))
  try:
    out = Linearized(collection, params, head, head_only=True,
                     with_jvp=with_jvp)
    got, pos = example_count(out), _positions(out)
    problem = None if (got, pos) == (rows, want) else (
        f"{got} examples and loss tags of {list(pos)} rows")
  except (TypeError, ValueError) as e:  # The full batch traced fine.
    problem = f"{type(e).__name__}: {str(e).splitlines()[0]}"
  if problem is None:
    return out
  warnings.warn(
      f"stats_fraction={fraction!r}: cutting the batch to its "
      f"first {rows} of {total} examples (every leaf whose leading axis "
      f"has {total} entries) gave {problem}, not {rows} examples and "
      f"{list(want)} rows, so the curvature is "
      "linearised on the whole batch: the factors still use the first "
      "rows, but the Fisher products cost as much as without "
      "stats_fraction. Put the example axis first in every batch leaf to "
      "save that.", stacklevel=3)
  return lin
