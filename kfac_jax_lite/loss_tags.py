"""Loss tags: the predictive distributions and custom losses.

Each ``register_*`` function here checks its arrays and options and binds
the loss tag of :mod:`kfac_jax_lite.tags`, marking ``z`` as the parameter
of a predictive distribution (:mod:`kfac_jax_lite.losses`) or of a user's
loss (:mod:`kfac_jax_lite.custom_losses`). The package exports them
(``kfac_jax_lite.register_softmax_cross_entropy_loss``, ...).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.core  # jax.core.Tracer
import numpy as np

from kfac_jax_lite import tag_checks
from kfac_jax_lite import tags


# --------------------------------------------------------------------------
# Loss registration functions.
# --------------------------------------------------------------------------


def _check_mask(z, mask, fn):
  tags.check_array("mask", mask, fn)
  lead = z.shape[:-1] if z.ndim >= 2 else z.shape
  try:
    ok = np.broadcast_shapes(tuple(mask.shape), tuple(lead)) == tuple(lead)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
        f"{fn}: mask has shape {tuple(mask.shape)}, which does not "
        f"broadcast to the leading shape {tuple(lead)} of z "
        f"{tuple(z.shape)} (every axis but the last). Give one entry per "
        "position, e.g. a [B, T] mask for [B, T, V] logits.")


def _loss_tag(kind, z, targets, fn, mask=None, **meta):
  tags.check_array("logits/mean", z, fn)
  if kind == "categorical" and z.ndim < 2:
    raise ValueError(
        f"{fn}: logits have shape {tuple(z.shape)}; they need a leading "
        "(batch) axis and the class axis last, [..., V].")
  operands = (z,) if targets is None else (z, targets)
  if targets is not None:
    tags.check_array("targets", targets, fn)
    tag_checks.check_loss_targets(fn, kind, z, targets)
  if mask is not None:
    _check_mask(z, mask, fn)
    operands += (mask,)
  for k in ("weight", "var"):
    if k in meta:
      v = meta[k]
      if isinstance(v, jax.core.Tracer) or not isinstance(
          v, (int, float)) or isinstance(v, bool):
        raise TypeError(
            f"{fn}: {k}={v!r} must be a Python float (a static value).")
      if v <= 0:
        raise ValueError(f"{fn}: {k}={v!r} must be positive.")
      meta[k] = float(v)
  if mask is not None:
    meta["has_mask"] = True
  return tags.bind_loss_tag(operands, kind,
                            has_targets=targets is not None, **meta)


def register_categorical_predictive_distribution(logits, targets=None, *,
                                                 weight: float = 1.0,
                                                 mask=None):
  """Registers a categorical distribution over the last axis of ``logits``.

  The registered loss is the mean over every leading position of
  ``logits: [..., V]`` (the batch, and for sequences the time axis too),
  ``optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  .mean()``: ``[B, T, V]`` and its flattening ``[B·T, V]`` give the same
  curvature. A flattened tag keeps each example's positions together (row
  ``b·T + t``, as ``reshape(-1, V)`` does). One position's Fisher is
  :math:`F_R = \\mathrm{diag}(p) - p p^T`, :math:`p = \\mathrm{softmax}(z)`.

  Args:
    logits: ``[..., V]``, at least 2-D.
    targets: integer class ids of the leading shape (for ``empirical``).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape (0 drops a
      position): the mean is over the kept positions, ``Σ_n m_n nll_n /
      Σ_n m_n``, counted in this batch (per device under data
      parallelism).

  Returns:
    ``logits``, unchanged.

  Raises:
    ValueError: for a mask that does not broadcast to the leading shape,
      a non-positive ``weight`` or ``var``, or (categorical) 1-D logits.
    TypeError: if ``weight`` or ``var`` is not a Python float.

  Example:
    >>> logits = kl.register_categorical_predictive_distribution(
    ...     logits, labels)             # logits [B, V] or [B, T, V]
  """
  return _loss_tag("categorical", logits, targets,
                   "register_categorical_predictive_distribution",
                   mask=mask, weight=weight)


register_softmax_cross_entropy_loss = (
    register_categorical_predictive_distribution)


def register_normal_predictive_distribution(mean, targets=None, *,
                                            var: float = 0.5,
                                            weight: float = 1.0,
                                            mask=None):
  """Registers a Normal with fixed scalar variance ``var`` around ``mean``.

  ``mean: [..., d]``: the last axis is one position's ``d`` coordinates,
  every other axis indexes positions (a 1-D ``mean`` is ``N`` positions of
  one coordinate). The registered loss is the mean over the positions of
  the per-position NLL; with ``var=0.5`` (up to a constant)
  ``jnp.sum((mean - targets) ** 2, axis=-1).mean()``. ``[B, T, d]`` and
  ``[B·T, d]`` give the same curvature. :math:`F_R = I / \\mathrm{var}`.

  Args:
    mean: ``[..., d]`` (or ``[N]``).
    targets: values of ``mean``'s shape (for ``empirical``).
    var: the fixed variance (a Python float).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape ``mean.shape[:-1]``
      (0 drops a position): the mean over the kept positions of this
      batch, as for the categorical tag.

  Returns:
    ``mean``, unchanged.

  Raises:
    ValueError: for a mask that does not broadcast to the leading shape,
      a non-positive ``weight`` or ``var``, or (categorical) 1-D logits.
    TypeError: if ``weight`` or ``var`` is not a Python float.

  Example:
    >>> y_hat = kl.register_normal_predictive_distribution(y_hat, y)
    >>> loss = jnp.sum((y_hat - y) ** 2, axis=-1).mean()
  """
  return _loss_tag("normal", mean, targets,
                   "register_normal_predictive_distribution",
                   mask=mask, var=var, weight=weight)


register_squared_error_loss = register_normal_predictive_distribution


def register_multi_bernoulli_predictive_distribution(logits, targets=None, *,
                                                     weight: float = 1.0,
                                                     mask=None):
  """Registers independent Bernoullis with the given logits.

  ``logits: [..., d]`` (or ``[N]``) as for the Normal tag: the registered
  loss is ``optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
  .mean()``, the mean over the leading positions.
  :math:`F_R = \\mathrm{diag}(p (1 - p))`, :math:`p = \\sigma(z)`.

  Args:
    logits: ``[..., d]`` (or ``[N]``).
    targets: 0/1 values of ``logits``' shape (for ``empirical``).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape (0 drops a
      position), as for the categorical tag.

  Returns:
    ``logits``, unchanged.

  Raises:
    ValueError: for a mask that does not broadcast to the leading shape,
      a non-positive ``weight`` or ``var``, or (categorical) 1-D logits.
    TypeError: if ``weight`` or ``var`` is not a Python float.

  Example:
    >>> logits = kl.register_multi_bernoulli_predictive_distribution(
    ...     logits, pixels)
  """
  return _loss_tag("multi_bernoulli", logits, targets,
                   "register_multi_bernoulli_predictive_distribution",
                   mask=mask, weight=weight)


register_sigmoid_cross_entropy_loss = (
    register_multi_bernoulli_predictive_distribution)


def register_loss_function(z, targets=None, *, loss_fn: Callable,
                           weight: float = 1.0, mask=None,
                           sampler: Optional[Callable] = None):
  """Registers a loss given by a function of one position's outputs.

  ``z: [..., E]``: every leading axis indexes positions (examples, time
  steps), the last is one position's ``E`` outputs (a 1-D ``z`` is ``N``
  positions of one output). The registered loss is the mean over the
  positions, ``jnp.mean(vmap(loss_fn)(z_n, y_n))`` (over the kept
  positions with a ``mask``), as for the other loss tags, and its
  curvature the generalised Gauss-Newton matrix of that mean,

  .. math:: G = \\frac{w}{N} \\sum_n m_n J_n^T H_n J_n,\\quad
     H_n = \\nabla_z^2\\, \\mathrm{loss\\_fn}(z_n, y_n)

  from autodiff Hessians (:mod:`kfac_jax_lite.custom_losses`): estimation
  modes ``exact_GGN``, ``curvature_prop_GGN`` (an eigendecomposition of each
  ``H_n``, for ``E`` up to ``custom_losses.MAX_FACTOR_SIZE``) and
  ``empirical``; ``gradients`` needs ``sampler``; ``exact`` and
  ``curvature_prop`` raise (a loss function has no Fisher of its own).

  Args:
    z: the model outputs the loss is a function of, ``[..., E]`` or ``[N]``.
      Returned unchanged.
    targets: optional, with z's leading shape first (``y_n = targets[n]``,
      any trailing shape and dtype); without, ``loss_fn`` gets ``None``.
    loss_fn: ``loss_fn(z_n, y_n) -> scalar`` for one position (``z_n`` of
      shape ``[E]``, or ``()`` for a 1-D ``z``). A static value: a
      module-level function or one closing over Python constants only
      (it is called again outside this trace); convex in ``z_n`` for a
      positive semi-definite ``H_n`` (a negative eigenvalue is clipped).
    weight: multiplies this loss's contribution (``weight · mean``).
    mask: optional, broadcastable to the leading shape (0 drops a
      position), as for the categorical tag.
    sampler: optional ``sampler(key, z_n) -> y_n`` drawing a target from
      the model's predictive distribution (``key`` a raw ``uint32[2]``
      jax.random key), for ``estimation_mode="gradients"`` and
      :func:`~kfac_jax_lite.eval_losses_on_samples`.

  Returns:
    ``z``, unchanged.

  Raises:
    TypeError: if ``loss_fn``/``sampler`` is not a function or closes
      over a traced array.
    ValueError: if ``loss_fn`` of one position is not a scalar, or the
      targets' leading shape is not z's.

  Example:
    >>> def poisson(z, y):  # z: [] log-rate of one position
    ...   return jnp.exp(z) - y * z
    >>> z = register_loss_function(model(params, x)[:, 0], counts,
    ...                            loss_fn=poisson)
    >>> loss = jnp.mean(jnp.exp(z) - counts * z)
  """
  fn = "register_loss_function"
  tags.check_array("z", z, fn)
  if targets is not None:
    tags.check_array("targets", targets, fn)
  tag_checks.check_loss_function(z, targets, loss_fn, sampler, fn)
  return _loss_tag("custom", z, targets, fn, mask=mask, weight=weight,
                   loss_fn=loss_fn, sampler=sampler)
