r"""The registered losses: NLL, sampling, Fisher and GGN factors.

A loss tag's ``z`` has shape ``[..., E]``: the last axis is one position's
event (the ``V`` classes of a categorical, the ``d`` coordinates of a Normal
or of independent Bernoullis) and every leading axis indexes *positions*
(examples, and for sequences the time steps). A 1-D ``z`` of a Normal or
Bernoulli loss is ``[N]``: N positions with a scalar event.

The registered loss is the **mean over the positions** of the negative
log-likelihoods, what ``.mean()`` over per-position losses computes; with a
``mask`` (broadcastable to the leading shape, 0 drops a position) the mean
over the ``N`` unmasked positions. Its Fisher is

.. math::
  F = \frac{w}{N} \sum_{n} m_n J_n^T F_R(z_n) J_n,

``w`` the tag's ``weight``, :math:`m_n \in \{0, 1\}` the mask and
:math:`J_n` the Jacobian of position ``n``'s parameters ``z_n``; so
``[B, T, V]`` and its flattening ``[B·T, V]`` describe the same matrix.

With :math:`F_R(z_n)` the Fisher of the distribution with respect to its
parameters, a *factor* :math:`B_n` satisfies :math:`F_R = B_n B_n^T` (TF
K-FAC ``multiply_fisher_factor``). All three use natural parameters, so
their GGN equals their Fisher (Martens 2014, "New insights and perspectives
on the natural gradient method", sec. 9.2).

Categorical (over the last axis): :math:`F_R = \mathrm{diag}(p) - pp^T`,
:math:`B = \mathrm{diag}(q) - p q^T` with :math:`q = \sqrt p`.
Normal (fixed ``var``): :math:`F_R = I/\mathrm{var}`,
:math:`B = \mathrm{var}^{-1/2} I`.
Multi-Bernoulli: :math:`F_R = \mathrm{diag}(p(1-p))`,
:math:`B = \mathrm{diag}(\sqrt{p(1-p)})`.

Two final classes share the interface :class:`PositionLoss` (positions,
means, and the scales and exact-mode columns every estimation mode needs):
:class:`LossSpec` for those three distributions and
:class:`~kfac_jax_lite.custom_losses.CustomLossSpec` for a user's
per-position loss function (its curvature from autodiff Hessians). Factor
products take the targets ``y`` too (a custom loss's Hessian may depend on
them; the three distributions ignore them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, overload


import jax
import jax.numpy as jnp

from kfac_jax_lite import keys


def _up(x):
  """At least float32 (bf16/f16 logits are promoted; float64 stays)."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def leading_shape(shape) -> tuple:
  """The positions of a loss tag's ``z``: every axis but the event axis
  (the last), or the one axis of a 1-D ``z``."""
  shape = tuple(shape)
  return shape[:-1] if len(shape) >= 2 else shape


def num_positions(shape) -> int:
  """``N``: the number of positions of a ``z`` of this shape (unmasked)."""
  return int(math.prod(leading_shape(shape)))


class PositionLoss:
  """The interface of a registered loss, and its shared, final methods.

  A subclass is a frozen dataclass with the fields ``kind``, ``weight``,
  ``has_targets``, ``shape`` and ``has_mask`` and the per-position methods
  ``nll``, ``nll_grad``, ``sample``, ``fisher_factor``,
  ``fisher_factor_transpose``, ``multiply_fisher``, ``ggn_factor``,
  ``ggn_factor_transpose``, ``multiply_ggn`` and ``check_mode``, and the
  class attribute ``targets_in_curvature`` (whether the factors read the
  targets); what follows (positions, means, scales, exact-mode columns)
  derives from them.
  """
  # The subclass's fields and methods that the methods below read,
  # declared for type checkers (no values: not fields of the subclass).
  kind: str
  weight: float
  targets_in_curvature: bool
  nll: Callable[..., Any]
  fisher_factor: Callable[..., Any]
  ggn_factor: Callable[..., Any]

  # ---- positions --------------------------------------------------------
  @overload
  def keep(self, z, mask: None) -> None: ...
  @overload
  def keep(self, z, mask: Any) -> jax.Array: ...
  def keep(self, z, mask):
    """The mask as booleans of z's leading shape (None without a mask)."""
    if mask is None:
      return None
    return jnp.broadcast_to(mask, leading_shape(z.shape)) != 0

  def count(self, z, mask):
    """``N``: the number of kept positions (a Python int without a mask, a
    traced scalar with one)."""
    if mask is None:
      return num_positions(z.shape)
    return jnp.sum(self.keep(z, mask), dtype=jnp.int32)

  def _per_position(self, z, x):
    """``x`` (of the leading shape) broadcastable against ``z``."""
    return x[..., None] if z.ndim >= 2 else x

  def mean_nll(self, z, y, mask=None):
    """The registered loss without its weight: the mean of :meth:`nll`
    over the (kept) positions; 0 when every position is masked."""
    val = self.nll(z, y)
    if mask is None:
      return jnp.mean(val)
    keep = self.keep(z, mask)
    return jnp.sum(jnp.where(keep, val, 0.0)) / jnp.maximum(
        self.count(z, mask), 1).astype(val.dtype)

  # ---- what the statistics and the Fisher products need -----------------
  def positions_per_example(self, z, examples: int) -> int:
    """``k = N / B``: the positions of one example, when the ``N``
    positions list each example's ``k`` positions together (example
    ``b`` owns the flat positions ``b·k .. b·k + k - 1``: a ``[B, T, V]``
    tag, or its ``reshape(-1, V)``).

    Raises:
      ValueError: if ``N`` is not a multiple of ``examples``.
    """
    n = num_positions(z.shape)
    if examples <= 0 or n % examples:
      raise ValueError(
          f"A {self.kind} loss tag on z of shape {tuple(z.shape)} has {n} "
          f"positions, not a multiple of the batch's {examples} examples "
          "(the leading size of the layers' inputs). The exact estimation "
          "modes need every example's positions together: register the "
          "loss on [B, ..., E] or on its reshape(-1, E).")
    return n // examples

  def factor_columns(self, z, examples: int, y=None, ggn: bool = False):
    """All columns :math:`B e_k` of one example, replicated over the
    batch: ``[K, *z.shape]``, ``K = k·E`` (``k`` positions per example,
    ``E`` the event size); ``B`` the Fisher factor, or with ``ggn`` the
    GGN factor, at targets ``y``.

    Used by the ``exact`` modes: summing :math:`(J^T B e_k)(J^T B e_k)^T`
    over ``k`` gives :math:`\\sum_n J_n^T F_R J_n` without sampling noise,
    because each column has one nonzero position per example (the
    positions of one example are never mixed). Built with ``vmap`` over
    ``k``, never a Python loop.
    """
    factor = self.ggn_factor if ggn else self.fisher_factor
    y = y if self.targets_in_curvature else None
    if z.ndim and z.shape[0] == examples:   # [B, *inner]
      inner, zr, yr = z.shape[1:], z, y
    else:                                   # flattened: [B·k, ...]
      k = self.positions_per_example(z, examples)
      inner = (k,) + z.shape[len(leading_shape(z.shape)):]
      zr = z.reshape((examples,) + inner)
      yr = None if y is None else y.reshape((examples, k) + y.shape[1:])
    size = int(math.prod(inner))

    def column(i):
      e = jax.nn.one_hot(i, size, dtype=_up(z).dtype).reshape(inner)
      return factor(zr, jnp.broadcast_to(e, zr.shape), yr).reshape(z.shape)
    return jax.vmap(column)(jnp.arange(size))

  def cotangent_scale(self, z, mask, examples: int, sources: int = 1):
    """The scale of the cotangents at ``z`` of ``sources`` sources.

    .. math:: \\sqrt{w B / (S N)}\\, m_n

    so that the blocks, which average over the ``B`` examples and sum over
    the ``S`` sources, estimate :math:`\\frac{w}{N} \\sum_n m_n J_n^T F_R
    J_n`. A Python float without a mask; with one, an array that
    broadcasts against ``z`` (0 at masked positions; ``N`` at least 1).
    """
    if mask is None:
      return math.sqrt(self.weight * (examples / num_positions(z.shape))
                       / sources)
    dt = _up(z).dtype
    n = jnp.maximum(self.count(z, mask), 1).astype(dt)
    scale = jnp.sqrt(self.weight * examples / sources / n)
    return self._per_position(
        z, jnp.where(self.keep(z, mask), scale, 0.0).astype(dt))

  def fisher_gram(self, z, mask, jvs, fjvs):
    """``[vᵢᵀ F vⱼ]`` of this loss from ``jvs = [J vᵢ]`` and ``fjvs =
    [F_R J vᵢ]`` (each ``[k, *z.shape]``).

    .. math:: v_i^T F v_j = \\frac{w}{N} \\sum_n m_n
       (J_n v_i)^T F_R(z_n) (J_n v_j)
    """
    jvs = jvs.astype(fjvs.dtype)
    if mask is None:
      return self.weight / num_positions(z.shape) * jnp.einsum(
          "i...,j...->ij", jvs, fjvs)
    keep = self._per_position(z, self.keep(z, mask))
    fjvs = jnp.where(keep, fjvs, 0.0)
    n = jnp.maximum(self.count(z, mask), 1).astype(fjvs.dtype)
    return self.weight / n * jnp.einsum("i...,j...->ij",
                                        jnp.where(keep, jvs, 0.0), fjvs)


@dataclasses.dataclass(frozen=True)
class LossSpec(PositionLoss):
  """A registered loss tag of one of the three distributions (static).

  Attributes:
    kind: ``categorical``, ``normal`` or ``multi_bernoulli``.
    weight: multiplies this loss's Fisher contribution (TF's ``coeff``).
    var: the Normal's variance (``normal`` only).
    has_targets: whether targets were passed at the tag.
    shape: the shape of ``z`` at scan time.
    has_mask: whether a ``mask`` was passed at the tag.

  Example:
    >>> spec = collection.losses[0]
    >>> spec.kind, spec.weight, spec.shape
    ('categorical', 1.0, (128, 5))
    >>> spec.mean_nll(logits, labels)      # the registered loss, unweighted
  """
  kind: str
  weight: float = 1.0
  var: float = 0.5
  has_targets: bool = False
  shape: tuple = ()
  has_mask: bool = False
  targets_in_curvature = False  # F_R depends on z only.

  # ---- per-position log-likelihood -------------------------------------
  def nll(self, z, y):
    """Per-position negative log-likelihood, of the leading shape.

    Args:
      z: the tag's operand ``[..., E]`` (logits or mean).
      y: targets: class ids of the leading shape (categorical) or values
        of ``z``'s shape.

    Returns:
      An array of the leading shape.
    """
    z = _up(z)
    if self.kind == "categorical":
      logp = jax.nn.log_softmax(z, axis=-1)
      y = y.astype(jnp.int32)
      return -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    if self.kind == "normal":
      val = (0.5 / self.var) * jnp.square(y.astype(z.dtype) - z)
      val = val + 0.5 * math.log(2 * math.pi * self.var)
    elif self.kind == "multi_bernoulli":
      y = y.astype(z.dtype)
      val = jnp.logaddexp(0.0, z) - y * z
    else:
      raise ValueError(f"Unknown loss kind {self.kind!r}.")
    return val.sum(axis=-1) if z.ndim >= 2 else val

  def nll_grad(self, z, y):
    """:math:`\\partial\\, \\mathrm{nll}_n / \\partial z_n`, per position.

    Args:
      z: the tag's operand ``[..., E]`` (logits or mean).
      y: targets: class ids of the leading shape (categorical) or values
        of ``z``'s shape.

    Returns:
      An array of ``z``'s shape.
    """
    z32 = _up(z)
    if self.kind == "categorical":
      p = jax.nn.softmax(z32, axis=-1)
      return p - jax.nn.one_hot(y, z.shape[-1], dtype=z32.dtype)
    if self.kind == "normal":
      return (z32 - y.astype(z32.dtype)) / self.var
    if self.kind == "multi_bernoulli":
      return jax.nn.sigmoid(z32) - y.astype(z32.dtype)
    raise ValueError(f"Unknown loss kind {self.kind!r}.")

  def sample(self, key, z):
    """Draws targets ``y ~ p(y | z)`` (same layout as data targets).

    ``key``: a key of :mod:`kfac_jax_lite.keys` (``uint32`` words, or any
    jax.random key); the uniforms come from :func:`keys.uniform`.
    Categorical by the Gumbel-max trick, ``argmax(z - log(-log u))``;
    Normal by the inverse CDF, ``z + sqrt(var) Φ⁻¹(u)``; Bernoulli as
    ``u < sigmoid(z)``. Every position draws independently.

    Args:
      key: a key of :mod:`kfac_jax_lite.keys` or a ``jax.random`` key.
      z: the tag's operand ``[..., E]`` (logits or mean).

    Returns:
      Targets in the layout of data targets.
    """
    z32 = jax.lax.stop_gradient(_up(z))
    u = keys.uniform(key, z.shape, z32.dtype)
    if self.kind == "categorical":
      return jnp.argmax(z32 - jnp.log(-jnp.log(u)), axis=-1)
    if self.kind == "normal":
      return z32 + math.sqrt(self.var) * jax.scipy.special.ndtri(u)
    if self.kind == "multi_bernoulli":
      return (u < jax.nn.sigmoid(z32)).astype(z32.dtype)
    raise ValueError(f"Unknown loss kind {self.kind!r}.")

  # ---- Fisher factor products (per position) ----------------------------
  def check_mode(self, mode: str, index: int):
    """Every estimation mode works with the three distributions.

    Args:
      mode: the estimation mode.
      index: the tag's position among the loss tags (for messages).
    """
    del mode, index

  def fisher_factor(self, z, v, y=None):
    """:math:`B v` with ``v`` of z's shape; :math:`F_R = B B^T`.

    Args:
      z: the tag's operand ``[..., E]`` (logits or mean).
      v: an array of ``z``'s shape.
      y: unused (the factor depends on ``z`` only); accepted for the
        interface shared with custom losses.

    Returns:
      :math:`B v`, of ``z``'s shape.
    """
    del y  # F_R depends on z only.
    z = _up(z)
    if self.kind == "categorical":
      p = jax.nn.softmax(z, axis=-1)
      q = jnp.sqrt(p)
      return q * v - p * jnp.sum(q * v, axis=-1, keepdims=True)
    if self.kind == "normal":
      return v / math.sqrt(self.var)
    if self.kind == "multi_bernoulli":
      p = jax.nn.sigmoid(z)
      return jnp.sqrt(p * (1 - p)) * v
    raise ValueError(f"Unknown loss kind {self.kind!r}.")

  def fisher_factor_transpose(self, z, u, y=None):
    """:math:`B^T u`.

    Args:
      z: the tag's operand ``[..., E]`` (logits or mean).
      u: an array of ``z``'s shape.
      y: unused (the factor depends on ``z`` only); accepted for the
        interface shared with custom losses.

    Returns:
      :math:`B^T u`, of ``z``'s shape.
    """
    del y
    z = _up(z)
    if self.kind == "categorical":
      p = jax.nn.softmax(z, axis=-1)
      q = jnp.sqrt(p)
      return q * u - q * jnp.sum(p * u, axis=-1, keepdims=True)
    return self.fisher_factor(z, u)

  def multiply_fisher(self, z, v, y=None):
    """:math:`F_R v` per position (exact, no sampling).

    Args:
      z: the tag's operand ``[..., E]`` (logits or mean).
      v: an array of ``z``'s shape.
      y: unused (the factor depends on ``z`` only); accepted for the
        interface shared with custom losses.

    Returns:
      :math:`F_R v`, of ``z``'s shape.
    """
    del y
    return self.fisher_factor(z, self.fisher_factor_transpose(z, v))

  # Natural parameters: GGN == Fisher for all three distributions.
  ggn_factor = fisher_factor
  ggn_factor_transpose = fisher_factor_transpose
  multiply_ggn = multiply_fisher


def make_spec(kind: str, meta: dict, shape) -> LossSpec:
  """The :class:`LossSpec` of a built-in loss tag: its kind, static
  metadata and ``z``'s shape (a tag of any kind:
  :func:`kfac_jax_lite.custom_losses.make_loss_spec`)."""
  return LossSpec(kind=kind, weight=float(meta.get("weight", 1.0)),
                  var=float(meta.get("var", 0.5)),
                  has_targets=bool(meta.get("has_targets", False)),
                  shape=tuple(shape),
                  has_mask=bool(meta.get("has_mask", False)))


def total_loss(specs, zs, targets, masks=None) -> jnp.ndarray | float:
  """``Σ_l weight_l · mean_nll_l``: the registered losses (tests/examples).

  Each term is the mean over that tag's (unmasked) positions.
  """
  masks = (None,) * len(specs) if masks is None else masks
  total = 0.0
  for spec, z, y, m in zip(specs, zs, targets, masks):
    total = total + spec.weight * spec.mean_nll(z, y, m)
  return total
