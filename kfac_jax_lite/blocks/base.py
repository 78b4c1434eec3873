"""The curvature-block protocols and the data a block is given.

A block is a static, frozen object (closed over, never traced) whose methods
are pure functions of a state pytree. The estimator hands each block a
:class:`LayerData` per step; the block turns it into minibatch statistics
(``compute_stats``), folds those into its factors with a zero-debiased EMA
(``update_curvature``), refreshes cached inverses / powers / Cholesky factors
(``update_cache``) and multiplies parameter-shaped vectors
(``multiply_matpower``). :class:`Block` is that contract, plus
``factors``/``with_factors``: the EMA'd statistics, which data parallelism
averages across devices. Optional capabilities are protocols of their own:
:class:`CholeskyProducts`, :class:`FactorBucketed` (a refresh factor by
factor, batched across blocks) and :class:`FusedProduct` (a product whose
last reshaping the caller makes).

Vectors are tuples with the structure of ``layer.param_paths`` (e.g.
``(w, b)``); ``full_fisher_block`` is in ``ravel_pytree`` order of that
tuple. Concrete blocks are final: the mixins below give shared methods that
no block overrides.
"""

from __future__ import annotations

import dataclasses
import math
from typing import (Any, Callable, NamedTuple, Optional, Protocol,
                    runtime_checkable)

import jax.numpy as jnp
import numpy as np

from kfac_jax_lite import linalg
from kfac_jax_lite import trees

DAMPING_TYPES = ("pi", "exact")


class LayerData(NamedTuple):
  """What the estimator gives a block at each curvature update.

  Attributes:
    inputs: one entry per tag site: the tuple of recorded tag inputs, each
      ``[B, U, *input_shape[1:]]`` where ``U`` is the product of the
      enclosing ``lax.scan`` lengths (1 outside loops).
    grads: one entry per site: the output gradients ``[S, B, U, *y_shape[1:]]``
      for ``S`` sources (sampled targets, exact-mode columns, ...). Blocks
      *sum* over sources; the estimator has already scaled them, so that
      ``Σ_s g_s g_sᵀ`` estimates :math:`J^T F_R J` for one example.
    params: the layer's parameter values, in ``param_paths`` order.
    param_grads: per parameter leaf, ``[S, *leaf.shape]`` gradients of the
      summed (over the batch) per-source loss; only for blocks with
      ``needs_param_grads``, else ``()``.
    batch_size: ``B``. Under an estimator ``axis_name``, blocks with
      ``needs_param_grads`` get ``param_grads`` summed over the *global*
      batch (all replicas) and ``batch_size`` the global batch size; inputs
      and output gradients are always this replica's.
    row_draw: a ``[]`` float32 uniform draw in ``(0, 1)``, fresh each
      statistics pass, from which blocks that average over a strided subset
      of their rows pick the offset (``BlockConfig.stats_position_stride``);
      None: every row.
  """
  inputs: tuple
  grads: tuple
  params: tuple
  param_grads: tuple
  batch_size: int
  row_draw: Any = None


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Options shared by every block (set by the estimator).

  Attributes:
    exps: matrix powers to cache (``-1`` is the inverse).
    compute_cholesky: cache Cholesky factors of the damped block.
    compute_cholesky_inverse: cache their inverses.
    damping_type: ``"pi"`` (factored Tikhonov with pi-adjustment) or
      ``"exact"`` (``(c A⊗G + λI)^e`` through eigendecompositions).
    stats_position_stride: ``k``: dense Kronecker factors average every
      ``k``-th of their rows from an offset drawn from
      :attr:`LayerData.row_draw` (:func:`.layouts.strided_rows`); None:
      ``k`` is chosen per platform when lowering (1 on CPU, 4 elsewhere).
  """
  exps: tuple = (-1,)
  compute_cholesky: bool = False
  compute_cholesky_inverse: bool = False
  damping_type: str = "pi"
  stats_position_stride: Optional[int] = 1

  def __post_init__(self):
    if self.damping_type not in DAMPING_TYPES:
      raise ValueError(
          f"damping_type={self.damping_type!r}; choose one of "
          f"{list(DAMPING_TYPES)}.")
    for e in self.exps:
      if not isinstance(e, (int, float)) or isinstance(e, bool):
        raise TypeError(f"exps must hold numbers; got {e!r}.")

  @property
  def cached_exps(self) -> tuple:
    return tuple(sorted({float(e) for e in self.exps} - {1.0}))


def layer_name(block) -> str:
  """The block's layer name, for messages (sub-blocks may have no layer)."""
  layer = getattr(block, "layer", None)
  return "<sub-block>" if layer is None else layer.name


def check_exp(block, exp) -> float:
  """Raises ``ValueError`` unless ``exp`` is 1 or was registered in exps."""
  exp = float(exp)
  if exp != 1.0 and exp not in block.config.cached_exps:
    raise ValueError(
        f"multiply_matpower(exp={exp:g}) on layer {layer_name(block)!r}: "
        f"exponent {exp:g} is not in exps={list(block.config.exps)}. Add it "
        "to the estimator's exps=... so its power is cached.")
  return exp


def unsupported(block, what: str, approx: str, exps: str, why: str,
                fix: str = ""):
  """Raises the ``ValueError`` of a product an approximation does not have.

  Args:
    block: the block (for its layer's name).
    what: the call, e.g. ``"multiply_matpower(exp=0.5)"``.
    approx: the approximation's name.
    exps: what it supports, e.g. ``"exps -1 and 1"``.
    why: the reason, in parentheses in the message.
    fix: what to use instead (a sentence), if anything.
  """
  raise ValueError(
      f"{what} on layer {layer_name(block)!r}: approximation {approx!r} "
      f"supports {exps} only ({why}).{' ' + fix if fix else ''}")


def check_cached(block, flag: str, what: str):
  if not getattr(block.config, flag):
    raise ValueError(
        f"{what} on layer {layer_name(block)!r} needs {flag}=True in the "
        "estimator (the factors are computed in update_cache).")


def ema_update(state, factors: tuple, stats: dict, decay):
  """EMA of the named factor fields; non-finite stats leave state as is."""
  finite = trees.all_finite(stats)
  old = {k: getattr(state, k) for k in factors}
  new, weight = trees.ema(old, stats, state.weight, decay)
  new = {k: jnp.where(finite, new[k], old[k]).astype(old[k].dtype)
         for k in factors}
  weight = jnp.where(finite, weight, state.weight)
  return state._replace(weight=weight.astype(state.weight.dtype), **new)


def vector_dtype_cast(out: tuple, like: tuple) -> tuple:
  return tuple(o.astype(x.dtype).reshape(x.shape) for o, x in zip(out, like))


def ravel(v: tuple):
  """Concatenates the flattened leaves of ``v`` in the factor dtype."""
  dt = linalg.factor_dtype()
  return jnp.concatenate([x.astype(dt).reshape(-1) for x in v])


def unravel(flat, like: tuple) -> tuple:
  """Splits a flat vector into arrays shaped and typed like ``like``."""
  out, i = [], 0
  for leaf in like:
    n = int(math.prod(leaf.shape))
    out.append(flat[i:i + n])
    i += n
  return vector_dtype_cast(tuple(out), like)


def rows_per_example(num_rows: int, batch_size: int, what: str) -> int:
  """``c = rows / B``: uses (x locations) per example, a Python int."""
  if batch_size <= 0 or num_rows % batch_size:
    raise ValueError(
        f"{what}: {num_rows} statistic rows are not a multiple of "
        f"batch_size={batch_size}. Every recorded input must have the batch "
        "as its leading axis.")
  return num_rows // batch_size


def kernel_to_mat(w, perm, d_in: int, d_out: int):
  """A dense kernel leaf as the ``[d_in, d_out]`` matrix of ``y = x W``.

  ``perm`` lists the leaf's axes in ``[*in_axes, *out_axes]`` order (None:
  they are in that order already): Equinox's ``Linear`` keeps ``[d_out,
  d_in]`` and applies ``w @ x`` (``perm = (1, 0)``); the matrix is the one
  of the same layer written ``x @ w.T``.
  """
  if perm is not None:
    w = jnp.transpose(w, perm)
  return w.reshape(d_in, d_out)


def mat_to_kernel(m, perm, shape: tuple):
  """The inverse of :func:`kernel_to_mat`: ``[..., d_in, d_out]`` matrices
  back to kernels of the leaf's ``shape`` (leading axes kept)."""
  lead = m.shape[:-2]
  if perm is None:
    return m.reshape(lead + tuple(shape))
  m = m.reshape(lead + tuple(shape[a] for a in perm))
  inv = [perm.index(a) for a in range(len(perm))]
  return jnp.transpose(m, tuple(range(len(lead))) + tuple(
      len(lead) + i for i in inv))


def kernel_ravel_index(perm, shape: Optional[tuple], d_in: int, d_out: int):
  """Where each entry of the ``[d_in, d_out]`` matrix sits in the leaf's
  ravel order (None when the orders agree)."""
  if perm is None:
    return None
  assert shape is not None  # a permuted kernel always records its shape
  idx = np.arange(int(math.prod(shape))).reshape(shape)
  return np.transpose(idx, perm).reshape(d_in, d_out)


def with_bias_row(m, b):
  """``[W; b]``: ``m: [..., r, n]`` with the bias ``b`` (``n`` entries per
  leading index) as one more row; ``m`` itself when ``b`` is None."""
  if b is None:
    return m
  row = b.astype(m.dtype).reshape(m.shape[:-2] + (1, m.shape[-1]))
  return jnp.concatenate([m, row], axis=-2)


def split_bias_row(m, rows: int, has_bias: bool) -> tuple:
  """``(W,)`` or ``(W, b)`` from ``[W; b]`` with ``rows`` rows in ``W``."""
  w = m[..., :rows, :]
  return (w, m[..., rows, :]) if has_bias else (w,)


# ---------------------------------------------------------------------------
# Protocols.
# ---------------------------------------------------------------------------


@runtime_checkable
class Block(Protocol):
  """What every curvature block does (``isinstance`` checks the names).

  Attributes:
    layer: the :class:`~kfac_jax_lite.layer.Layer` (None for a part of
      another block).
    config: the :class:`BlockConfig`.
    needs_param_grads: whether ``compute_stats`` reads
      ``LayerData.param_grads``.
  """
  layer: Any
  config: BlockConfig
  needs_param_grads: bool

  def init(self) -> Any:
    """The state before any update (zero factors, zero weight)."""

  def compute_stats(self, data: LayerData) -> Any:
    """This minibatch's statistics, a pytree like :meth:`factors`."""

  def update_curvature(self, state, stats, ema_decay) -> Any:
    """The zero-debiased EMA of the statistics; non-finite ones are
    ignored."""

  def update_cache(self, state, damping) -> Any:
    """Caches what products with the damped block need."""

  def multiply_matpower(self, state, v: tuple, exp) -> tuple:
    """``(F + damping)^exp v`` (exp 1: the live factors)."""
    ...

  def multiply(self, state, v: tuple) -> tuple:
    """``multiply_matpower(state, v, 1)``."""
    ...

  def multiply_inverse(self, state, v: tuple) -> tuple:
    """``multiply_matpower(state, v, -1)``."""
    ...

  def full_fisher_block(self, state) -> Any:
    """The undamped dense block, in ravel order of the layer's params."""

  def factors(self, state) -> Any:
    """The EMA'd statistics (averaged across devices under ``pmap``)."""

  def with_factors(self, state, factors) -> Any:
    """``state`` with :meth:`factors` replaced."""


@runtime_checkable
class CholeskyProducts(Protocol):
  """Products with a square-root factor ``C`` of the damped block."""

  def multiply_cholesky(self, state, v: tuple, transpose: bool = False):
    """``C v`` (``Cᵀ v``), ``C Cᵀ`` the damped block."""

  def multiply_cholesky_inverse(self, state, v: tuple,
                                transpose: bool = False):
    """``C⁻¹ v`` (``C⁻ᵀ v``)."""


@runtime_checkable
class FactorBucketed(Protocol):
  """A refresh made of independent damped matrix functions of factors, so
  that a caller can batch the factors of many blocks by size."""
  factor_options: tuple

  def factor_requests(self, state) -> tuple:
    """``((name, matrix), ...)``: the dense factors to refresh."""
    ...

  def factor_dampings(self, state, damping, trace_norms: dict) -> dict:
    """``{name: d}``: each factor's share of the damping."""
    ...

  def factor_cache(self, f, d) -> dict:
    """One factor's cache entries, a function of ``f`` and ``d`` only."""
    ...

  def with_factor_caches(self, state, damping, caches: dict,
                         dampings: Optional[dict] = None) -> Any:
    """The refreshed state from every requested factor's cache."""


@runtime_checkable
class FusedProduct(Protocol):
  """A product computed as a matrix and cut into parameters by the caller:
  ``finish_product(multiply_matpower_raw(s, product_input(v), e), v)`` is
  ``multiply_matpower(s, v, e)``."""

  def product_input(self, v: tuple) -> Any:
    """What :meth:`multiply_matpower_raw` multiplies."""

  def multiply_matpower_raw(self, state, v, exp) -> Any:
    """The product before its last reshaping."""

  def finish_product(self, raw, like: tuple) -> tuple:
    """The layer's parameter tuple from the raw product."""
    ...


# ---------------------------------------------------------------------------
# Mixins: shared, final methods.
# ---------------------------------------------------------------------------


class Shorthands:
  """``multiply`` and ``multiply_inverse`` from ``multiply_matpower``."""
  multiply_matpower: Callable[..., tuple]  # the block's own

  def multiply(self, state, v):
    return self.multiply_matpower(state, v, 1)

  def multiply_inverse(self, state, v):
    return self.multiply_matpower(state, v, -1)


class UnfusedProducts:
  """The :class:`FusedProduct` methods of a block whose product needs no
  cut: the input is ``v`` and the raw product is the finished one. Every
  block has the three methods for callers that treat all blocks alike."""
  multiply_matpower: Callable[..., tuple]  # the block's own

  def product_input(self, v: tuple) -> Any:
    return v

  def multiply_matpower_raw(self, state, v: tuple, exp) -> Any:
    return self.multiply_matpower(state, v, exp)

  def finish_product(self, raw, like: tuple) -> tuple:
    del like
    return raw


class FieldFactors:
  """``factors``/``with_factors`` of a NamedTuple state whose fields named
  in the block's ``factor_fields`` hold the EMA'd statistics."""
  factor_fields: tuple

  def factors(self, state) -> dict:
    return {k: getattr(state, k) for k in self.factor_fields}

  def with_factors(self, state, factors: dict):
    return state._replace(**factors)
