r"""The registered losses evaluated on data and on sampled targets.

A collection's loss tags describe the loss :math:`\sum_\ell w_\ell\,
\bar L_\ell`, with :math:`\bar L_\ell` the mean over tag ``ℓ``'s kept
positions of its per-position loss (:mod:`kfac_jax_lite.losses`). These
functions evaluate it, tag by tag or summed (TF K-FAC's ``eval_losses``,
``total_loss``, ``eval_losses_on_samples``, ``total_sampled_loss``):

* on the data targets given at the tags;
* on targets drawn from the model's predictive distribution (for
  ``register_loss_function``, its ``sampler``), averaged over
  ``num_samples`` draws: a Monte Carlo estimate of the expected loss
  under the model, for a negative log-likelihood its entropy.

They run the scanned ``loss_fn`` once (forward only) and read the loss
tags' operands. :func:`loss_value` is the scanned function's own value
(regularisers and all), what ``kfac_optimizer``'s damping rule compares.

Under ``pmap``/``shard_map`` pass ``axis_name`` to average over the axis
(each replica's sampling key is folded with its axis index).

Example:
  >>> collection = kl.scan(loss_fn, params, batch)
  >>> kl.total_loss(collection, params, batch)   # registered part of loss
  >>> kl.eval_losses_on_samples(collection, params, batch, rng,
  ...                           num_samples=8)  # one value per loss tag
"""

from __future__ import annotations

from typing import Any, Optional, cast

import jax
from jax import lax
import jax.numpy as jnp

from kfac_jax_lite import distributed
from kfac_jax_lite import keys
from kfac_jax_lite import scanner
from kfac_jax_lite.collection import LayerCollection


def _tags(collection: LayerCollection, params, batch):
  """``(zs, targets, masks)`` of the loss tags at ``params``."""
  if not isinstance(collection, LayerCollection):
    raise TypeError(
        "collection=... must be the LayerCollection returned by "
        f"kfac_jax_lite.scan(...); got {type(collection).__name__}.")
  traced = scanner.perturbed_fn(collection, params, batch)
  (_, zs), (_, _, targets, masks) = traced.fn(params, traced.eps)
  return zs, targets, masks


def _mean(x, axis_name):
  return x if axis_name is None else lax.pmean(x, axis_name)


def loss_value(collection: LayerCollection, params, batch, *,
               axis_name: Any = None, dtype=None) -> jnp.ndarray:
  """The scanned ``loss_fn``'s loss at ``params`` (its aux dropped).

  The user's whole loss, regularisers included, unlike :func:`total_loss`.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    params: the parameters.
    batch: the batch.
    axis_name: average over this ``pmap``/``shard_map`` axis.
    dtype: cast to this dtype before averaging (None: keep).

  Returns:
    A scalar.

  Example:
    >>> collection = kl.scan(loss_fn, params, batch)
    >>> kl.loss_value(collection, params, batch)    # == loss_fn(params, batch)
  """
  out = collection.loss_fn(params, batch)
  loss = out[0] if collection.has_aux else out
  if dtype is not None:
    loss = loss.astype(dtype)
  return _mean(loss, axis_name)


def eval_losses(collection: LayerCollection, params, batch, *,
                axis_name: Any = None) -> tuple:
  """Each loss tag's registered loss on the data targets.

  .. math:: (w_\\ell \\bar L_\\ell(z_\\ell, y_\\ell))_\\ell

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    params: the parameters.
    batch: the batch.
    axis_name: average over this ``pmap``/``shard_map`` axis.

  Returns:
    A tuple of scalars, one per loss tag in trace order.

  Raises:
    ValueError: if a tag was registered without targets.

  Example:
    >>> collection = kl.scan(loss_fn, params, batch)
    >>> (xent,) = kl.eval_losses(collection, params, batch)   # one loss tag
  """
  zs, targets, masks = _tags(collection, params, batch)
  out = []
  for i, (spec, z, y, m) in enumerate(zip(collection.losses, zs, targets,
                                          masks)):
    if y is None:
      raise ValueError(
          f"eval_losses: loss tag {i} ({spec.kind}) was registered without "
          "targets. Pass targets=... to its register_* call, or use "
          "eval_losses_on_samples.")
    out.append(_mean(spec.weight * spec.mean_nll(z, y, m), axis_name))
  return tuple(out)


def total_loss(collection: LayerCollection, params, batch, *,
               axis_name: Any = None) -> jnp.ndarray:
  """The sum of :func:`eval_losses`: the registered loss on the data.

  .. math:: \\sum_\\ell w_\\ell \\bar L_\\ell(z_\\ell, y_\\ell)

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    params: the parameters.
    batch: the batch.
    axis_name: average over this ``pmap``/``shard_map`` axis.

  Returns:
    A scalar.

  Raises:
    ValueError: if a tag was registered without targets.

  Example:
    >>> collection = kl.scan(loss_fn, params, batch)
    >>> kl.total_loss(collection, params, batch)   # the registered losses
  """
  # An array: a collection has at least one loss tag.
  return cast(jnp.ndarray, sum(eval_losses(collection, params, batch,
                                           axis_name=axis_name)))


def eval_losses_on_samples(collection: LayerCollection, params, batch, rng,
                           *, num_samples: int = 1,
                           axis_name: Any = None) -> tuple:
  """Each loss tag's registered loss at targets drawn from the model.

  .. math:: \\Big(\\frac{1}{S} \\sum_{s=1}^{S} w_\\ell \\bar L_\\ell(
     z_\\ell, \\hat y_{\\ell,s})\\Big)_\\ell,\\quad \\hat y_{\\ell,s} \\sim
     p(y \\mid z_\\ell)

  The draws are those of the ``gradients`` estimation mode (tag ``ℓ``
  draws with the hashed keys of :mod:`kfac_jax_lite.keys`).

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    params: the parameters.
    batch: the batch (its targets are not used).
    rng: a jax.random key (or ``uint32`` key words).
    num_samples: ``S``, draws per position.
    axis_name: average over this ``pmap``/``shard_map`` axis; each
      replica folds ``rng`` with its axis index.

  Returns:
    A tuple of scalars, one per loss tag in trace order.

  Raises:
    ValueError: if a ``register_loss_function`` tag has no ``sampler``.

  Example:
    >>> collection = kl.scan(loss_fn, params, batch)
    >>> kl.eval_losses_on_samples(collection, params, batch,
    ...                           jax.random.PRNGKey(0), num_samples=8)
  """
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(f"num_samples={num_samples!r} must be a positive int.")
  if axis_name is not None:
    rng = distributed.replica_key(rng, axis_name)
  zs, targets, masks = _tags(collection, params, batch)
  del targets
  out = []
  for i, (spec, z, m) in enumerate(zip(collection.losses, zs, masks)):
    if getattr(spec, "sampler", True) is None:
      raise ValueError(
          f"eval_losses_on_samples: loss tag {i} (register_loss_function) "
          "has no sampler; pass sampler=... to register_loss_function, or "
          "use eval_losses.")

    def one(key, spec=spec, z=z, m=m):
      return spec.mean_nll(z, spec.sample(key, z), m)
    ks = keys.sample_keys(rng, i, num_samples)
    out.append(_mean(spec.weight * jnp.mean(jax.vmap(one)(ks)), axis_name))
  return tuple(out)


def total_sampled_loss(collection: LayerCollection, params, batch, rng, *,
                       num_samples: int = 1,
                       axis_name: Optional[Any] = None) -> jnp.ndarray:
  """The sum of :func:`eval_losses_on_samples`.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    params: the parameters.
    batch: the batch (its targets are not used).
    rng: a jax.random key (or ``uint32`` key words).
    num_samples: ``S``, draws per position.
    axis_name: average over this ``pmap``/``shard_map`` axis; each
      replica folds ``rng`` with its axis index.

  Returns:
    A scalar.

  Raises:
    ValueError: if a ``register_loss_function`` tag has no ``sampler``.

  Example:
    >>> collection = kl.scan(loss_fn, params, batch)
    >>> kl.total_sampled_loss(collection, params, batch,
    ...                       jax.random.PRNGKey(0), num_samples=8)
  """
  # An array: a collection has at least one loss tag.
  return cast(jnp.ndarray, sum(eval_losses_on_samples(
      collection, params, batch, rng, num_samples=num_samples,
      axis_name=axis_name)))
