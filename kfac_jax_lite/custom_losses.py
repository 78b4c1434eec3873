r"""A user's per-position loss function as a registered loss.

:func:`~kfac_jax_lite.register_loss_function` tags ``z: [..., E]`` with
``loss_fn(z_n, y_n) -> scalar``, the loss of one position ``n`` (the leading
axes index positions, the last axis is one position's ``E`` outputs; a 1-D
``z`` is ``N`` positions of one scalar output). As for the built-in tags
the registered loss is the mean over the (kept) positions, and its
curvature the generalised Gauss-Newton matrix of that mean,

.. math::
  G = \frac{w}{N} \sum_n m_n J_n^T H_n J_n, \qquad
  H_n = \nabla^2_{z}\, \mathrm{loss\_fn}(z_n, y_n)

(Schraudolph 2002; Martens 2014, "New insights and perspectives on the
natural gradient method", sec. 8), with ``w`` the tag's weight, ``m`` its
mask and :math:`J_n` the Jacobian of ``z_n``. ``H_n`` comes from autodiff,
``jax.vmap`` over the positions:

* products :math:`H_n v` (the exact Gram of ``kfac_optimizer``'s quadratic
  model) are Hessian-vector products, ``jax.jvp`` of ``jax.grad``: no
  ``E x E`` matrix;
* the modes that need a square-root factor (``exact_GGN``,
  ``curvature_prop_GGN``) use the symmetric square root
  :math:`B_n = V \max(\Lambda, 0)^{1/2} V^T` of the eigendecomposition
  :math:`H_n = V \Lambda V^T`, ``jax.hessian`` then ``eigh``: ``O(N E^3)``,
  so only for ``E <=`` :data:`MAX_FACTOR_SIZE`. A negative eigenvalue (a
  loss not convex in ``z``) is clipped to 0, the positive part of ``H``.
* ``empirical`` needs only the gradient :math:`\nabla_z \mathrm{loss\_fn}`.

A loss function has no Fisher of its own: the Fisher modes need a
distribution. ``gradients`` works with ``sampler(key, z_n) -> y_n`` (targets
drawn from the model's predictive distribution, so that the sampled
gradients' outer products estimate its Fisher); ``exact`` and
``curvature_prop`` raise (use their ``_GGN`` forms, equal to the Fisher when
``loss_fn`` is the negative log-likelihood of a distribution whose natural
parameters are ``z``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from kfac_jax_lite import keys
from kfac_jax_lite import losses

# The largest event size E whose per-position Hessians are eigendecomposed
# for a square-root factor (exact_GGN, curvature_prop_GGN).
MAX_FACTOR_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class CustomLossSpec(losses.PositionLoss):
  """A registered per-position loss function (static description).

  Attributes:
    loss_fn: ``loss_fn(z_n, y_n) -> scalar``, hashable (compared by
      identity: pass the same function object at every trace).
    sampler: ``sampler(key, z_n) -> y_n`` drawing a target from the model's
      distribution, or None (then the ``gradients`` mode raises).
    weight: multiplies this loss's contribution.
    has_targets: whether targets were passed at the tag (else ``loss_fn``
      gets ``None`` as ``y_n``).
    shape: the shape of ``z`` at scan time (its last axis is the event,
      unless ``z`` is 1-D).
    has_mask: whether a ``mask`` was passed at the tag.
  """
  loss_fn: Callable
  sampler: Optional[Callable] = None
  weight: float = 1.0
  has_targets: bool = False
  shape: tuple = ()
  has_mask: bool = False
  kind: str = "custom"
  targets_in_curvature = True  # H_n may depend on y_n (a Huber loss).

  # ---- layout -----------------------------------------------------------
  @property
  def _event_ndim(self) -> int:
    return 1 if len(self.shape) >= 2 else 0

  def _flat(self, z, y=None):
    """``z -> [N, E]`` and ``y -> [N, ...]``, with ``N`` every axis of
    ``z`` before its event axis (a reshaped ``z`` keeps its event)."""
    lead = z.shape[:z.ndim - self._event_ndim]
    n = int(math.prod(lead))
    zf = losses._up(z).reshape((n, -1))  # pylint: disable=protected-access
    yf = None if y is None else y.reshape((n,) + y.shape[len(lead):])
    return lead, zf, yf

  def _one(self, zv, yn):
    """``loss_fn`` of one position, its ``z_n`` given flat ``[E]``."""
    event = self.shape[len(self.shape) - self._event_ndim:]
    return self.loss_fn(zv.reshape(event), yn)

  def _map(self, fn, z, y, *rest):
    """``fn(z_n, y_n, *rest_n)`` over the positions (``rest`` shaped like
    ``z``); the results stacked ``[N, ...]``."""
    lead, zf, yf = self._flat(z, y)
    rest = [r.reshape(zf.shape).astype(zf.dtype) for r in rest]
    if yf is None:
      return lead, jax.vmap(lambda zv, *r: fn(zv, None, *r))(zf, *rest)
    return lead, jax.vmap(fn)(zf, yf, *rest)

  # ---- per-position loss ------------------------------------------------
  def nll(self, z, y):
    """``loss_fn`` per position, of the leading shape."""
    lead, val = self._map(self._one, z, y)
    return val.reshape(lead)

  def nll_grad(self, z, y):
    """:math:`\\nabla_z \\mathrm{loss\\_fn}(z_n, y_n)`, per position."""
    _, g = self._map(jax.grad(self._one), z, y)
    return g.reshape(z.shape)

  def sample(self, key, z):
    """Targets from ``sampler``, one independent key per position.

    ``key``: a key of :mod:`kfac_jax_lite.keys`; position ``n`` draws with
    the raw ``uint32[2]`` key ``keys.derive(key, n)``.
    """
    if self.sampler is None:
      raise ValueError(self._mode_error("gradients"))
    sampler = self.sampler
    lead, zf, _ = self._flat(jax.lax.stop_gradient(z))
    event = self.shape[len(self.shape) - self._event_ndim:]
    ks = jax.vmap(lambda i: keys.derive(key, i))(jnp.arange(zf.shape[0]))
    ys = jax.vmap(lambda k, zv: sampler(k, zv.reshape(event)))(ks, zf)
    return ys.reshape(lead + ys.shape[1:])

  def check_mode(self, mode: str, index: int):
    """Raises ``ValueError`` for a mode this loss cannot serve."""
    if mode in ("exact", "curvature_prop") or (
        mode == "gradients" and self.sampler is None):
      raise ValueError(self._mode_error(mode, index))
    if mode in ("exact_GGN", "curvature_prop_GGN"):
      size = int(math.prod(self.shape[len(self.shape) - self._event_ndim:]))
      if size > MAX_FACTOR_SIZE:
        raise ValueError(
            f"estimation_mode={mode!r}: loss tag {index} "
            f"(register_loss_function on z of shape {self.shape}) has "
            f"{size} outputs per position; its square-root factor needs "
            f"an eigendecomposition of each position's {size}x{size} "
            f"Hessian, done only up to {MAX_FACTOR_SIZE}. Use "
            "estimation_mode='empirical', or give a sampler=... and use "
            "'gradients'.")

  def _mode_error(self, mode: str, index: Optional[int] = None) -> str:
    tag = "" if index is None else f" (loss tag {index})"
    fix = ("give register_loss_function a sampler=... that draws targets "
           "from the model's distribution, or use 'exact_GGN', "
           "'curvature_prop_GGN' or 'empirical'") if mode == "gradients" else (
               f"use {mode + '_GGN'!r} (the same matrix when loss_fn is the "
               "negative log-likelihood of a distribution with natural "
               "parameters z), or 'empirical'")
    return (f"estimation_mode={mode!r} needs the Fisher of a distribution, "
            f"and register_loss_function{tag} was given only a loss "
            f"function: {fix}.")

  # ---- curvature products -----------------------------------------------
  def _hvp(self, zv, yn, vv):
    return jax.jvp(lambda q: jax.grad(self._one)(q, yn), (zv,), (vv,))[1]

  def multiply_ggn(self, z, v, y=None):
    """:math:`H_n v_n` per position, by Hessian-vector products."""
    _, out = self._map(self._hvp, z, y, v)
    return out.reshape(z.shape)

  def _sqrt_hvp(self, zv, yn, vv):
    """:math:`B v` with :math:`B = V \\max(\\Lambda, 0)^{1/2} V^T`."""
    lam, vec = jnp.linalg.eigh(jax.hessian(self._one)(zv, yn))
    s = jnp.sqrt(jnp.maximum(lam, 0.0))
    return vec @ (s * (vec.T @ vv))

  def ggn_factor(self, z, v, y=None):
    """:math:`B_n v_n`, :math:`B_n B_n^T = H_n^+` (symmetric: ``B = Bᵀ``)."""
    _, out = self._map(self._sqrt_hvp, z, y, v)
    return out.reshape(z.shape)

  def ggn_factor_transpose(self, z, u, y=None):
    """:math:`B_n^T u_n` (the factor is symmetric)."""
    return self.ggn_factor(z, u, y)

  # The Fisher products (the optimizer's quadratic model) use the GGN.
  multiply_fisher = multiply_ggn

  def fisher_factor(self, z, v, y=None):
    del z, v, y
    raise ValueError(self._mode_error("exact"))

  fisher_factor_transpose = fisher_factor


def make_loss_spec(kind: str, meta: dict, shape) -> losses.PositionLoss:
  """The loss of a tag: its kind, static metadata and ``z``'s shape: a
  :class:`CustomLossSpec` for ``kind="custom"``
  (:func:`~kfac_jax_lite.register_loss_function`), else the built-in
  :class:`~kfac_jax_lite.losses.LossSpec` (:func:`losses.make_spec`)."""
  if kind != "custom":
    return losses.make_spec(kind, meta, shape)
  return CustomLossSpec(
      loss_fn=meta["loss_fn"], sampler=meta.get("sampler"),
      weight=float(meta.get("weight", 1.0)),
      has_targets=bool(meta.get("has_targets", False)), shape=tuple(shape),
      has_mask=bool(meta.get("has_mask", False)))
