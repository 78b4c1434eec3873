"""Adam in the Kronecker eigenbasis of K-FAC's factors (SOAP with K-FAC's
statistics): ``scale_by_kfac_eigen_adam`` and ``kfac_soap``.

For a dense layer whose weight and bias form the ``[d_a, d_g]`` matrix
``W`` (``d_a = d_in (+1)``, ``d_g = d_out``, as in
:mod:`kfac_jax_lite.blocks.kronecker`), K-FAC keeps the factors
:math:`A = E[a a^T] = Q_A \\Lambda_A Q_A^T` and
:math:`G = E[g g^T] = Q_G \\Lambda_G Q_G^T`. Their eigenvectors give the
Kronecker eigenbasis :math:`Q = Q_A \\otimes Q_G` of the layer's curvature
(EK-FAC, George et al. 2018). SOAP (Vyas et al. 2024) runs Adam in such a
basis, the one of Shampoo's gradient statistics; here the basis is K-FAC's,
refreshed every ``p`` steps from its exponential moving averages (EMA).
With the gradient :math:`\\nabla W_t`,

.. math::
  G'_t = Q_A^T \\nabla W_t Q_G,\\quad
  M_t = \\beta_1 M_{t-1} + (1-\\beta_1) G'_t,\\quad
  V_t = \\beta_2 V_{t-1} + (1-\\beta_2) G'^{\\odot 2}_t,

.. math::
  u_t = Q_A \\frac{M_t / (1-\\beta_1^t)}{\\sqrt{V_t / (1-\\beta_2^t)}
  + \\epsilon} Q_G^T.

``M`` is kept in the basis: when a refresh moves the basis from ``Q`` to
``Q'`` it is rotated exactly, :math:`M \\leftarrow R_A^T M R_G` with
:math:`R = Q^T Q'`, so the first moment is the EMA of the gradients in the
parameters' own coordinates, as in SOAP's Algorithm 1. ``V`` stays as it is
(SOAP's choice), or, with ``rotate_second_moments``, it is carried as
EK-FAC carries its scalings, :math:`V \\leftarrow (R_A^{\\odot 2})^T V
R_G^{\\odot 2}` (the diagonal, in the new basis, of the old diagonal
estimate). Every other parameter (embeddings, normalisation scales, biases
outside a dense layer, unregistered leaves) gets plain Adam with the same
``β₁, β₂, ε``.

The refresh is the estimator's: two ``eigh`` per dense layer every ``p``
steps under ``lax.cond``, one ``vmap`` per group of same-shaped layers
(:func:`kfac_jax_lite.refresh.update_cache` with ``damping_type="exact"``).
Per step the statistics cost as in :func:`~kfac_jax_lite.scale_by_kfac`
and the rotations ``4 d_a d_g (d_a + d_g)`` flops per layer.

References:
  Vyas, Morwani, Zhao, Shapira, Brandfonbrener, Janson & Kakade (2024),
  "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321,
  Algorithm 1. George, Laurent, Bouthillier, Ballas & Vincent (2018),
  "Fast Approximate Natural Gradient Descent in a Kronecker-factored
  Eigenbasis", NeurIPS, sec. 3. Martens & Grosse (2015), K-FAC.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, cast

import jax
from jax import lax
import jax.numpy as jnp
import optax

from kfac_jax_lite import eigen_basis
from kfac_jax_lite import estimator as estimator_lib
from kfac_jax_lite import grouping
from kfac_jax_lite import linearization
from kfac_jax_lite.blocks import kronecker
from kfac_jax_lite.collection import LayerCollection
from kfac_jax_lite.curvature import CurvatureState
from kfac_jax_lite.curvature import ScalarOrSchedule
from kfac_jax_lite.curvature import check_period
from kfac_jax_lite.curvature import update_curvature
from kfac_jax_lite.step_rules import statistics_from_head
from kfac_jax_lite.transform import check_hyperparameter
from kfac_jax_lite.transform import check_state
from kfac_jax_lite.transform import skip_nonfinite


class EigenAdamState(NamedTuple):
  """State of :func:`scale_by_kfac_eigen_adam`.

  Attributes:
    count: ``[]`` int32, the Adam steps taken (bias correction).
    curvature: the K-FAC factors and their eigenbases
      (:class:`~kfac_jax_lite.CurvatureState`).
    mu: group name -> ``[(n,) d_a, d_g]``, the first moment in the
      eigenbasis of each group of same-shaped dense layers.
    nu: group name -> the second moment in that basis.
    rest_mu: the first moments of the other leaves, in leaf order.
    rest_nu: their second moments.

  Example:
    >>> state = kl.scale_by_kfac_eigen_adam(collection).init(params)
    >>> state.count, list(state.nu), state.curvature.num_inverse_updates
  """
  count: jnp.ndarray         # [] int32
  curvature: CurvatureState  # factors and eigenbases
  mu: dict                   # group -> [(n,) d_a, d_g]
  nu: dict                   # group -> [(n,) d_a, d_g]
  rest_mu: tuple             # leaf-shaped, other leaves
  rest_nu: tuple             # leaf-shaped, other leaves


def rotated(block) -> bool:
  """Whether ``block`` gets Adam in its eigenbasis: a Kronecker block with
  an eigendecomposed (``damping_type="exact"``) dense factor."""
  return (isinstance(block, kronecker.KroneckerBlock)
          and block.config.damping_type == "exact"
          and not (block.a_diagonal and block.g_diagonal))


def _basis(state):
  """``(Q_A, Q_G)`` of a block state (None for a diagonal factor)."""
  return state.cache.get("a_eigvec"), state.cache.get("g_eigvec")


def carry_moments(mu, nu, old, new, rotate_nu: bool, orders=(None, None)):
  """``(R_Aᵀ M R_G, V or (R_A²)ᵀ V R_G²)`` with ``R = Q_oldᵀ Q_new``; ``V``
  kept has its rows and columns taken in ``orders`` (the columns of
  ``Q_new`` that continue those of ``Q_old``, None: in place)."""
  (oa, og), (na, ng) = _basis(old), _basis(new)
  ra = None if na is None else oa.T @ na
  rg = None if ng is None else og.T @ ng
  mu = mu if ra is None else ra.T @ mu
  mu = mu if rg is None else mu @ rg
  if rotate_nu:
    nu = nu if ra is None else jnp.square(ra).T @ nu
    nu = nu if rg is None else nu @ jnp.square(rg)
    return mu, nu
  order_a, order_g = orders
  nu = nu if order_a is None else jnp.take(nu, order_a, axis=0)
  return mu, nu if order_g is None else jnp.take(nu, order_g, axis=1)


def _into(m, ua, ug):
  m = m if ua is None else ua.T @ m
  return m if ug is None else m @ ug


def _out(m, ua, ug):
  m = m if ua is None else ua @ m
  return m if ug is None else m @ ug.T


def adam_direction(mu, nu, count, b1, b2, eps):
  """``(μ / (1-β₁ᵗ)) / (√(ν / (1-β₂ᵗ)) + ε)``."""
  t = count.astype(mu.dtype)
  return (mu / (1 - b1 ** t)) / (jnp.sqrt(nu / (1 - b2 ** t)) + eps)


def check_beta(name, value):
  """A decay in ``[0, 1)`` given as a Python number."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      0.0 <= value < 1.0):
    raise ValueError(
        f"{name}={value!r} must be a number in [0, 1) (an EMA decay; Adam "
        f"uses 0.9 / 0.999, SOAP 0.95 / 0.95).")


def check_eps(value):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      value > 0):
    raise ValueError(f"eps={value!r} must be a number > 0 (added to √v; "
                     "e.g. eps=1e-8).")


def eigen_estimator(collection, estimator, axis_name, cov_ema_decay
                    ) -> estimator_lib.FisherEstimator:
  """The estimator of ``collection`` with eigendecomposed factors, or
  ``estimator`` checked to be one."""
  if estimator is None:
    if not isinstance(collection, LayerCollection):
      raise TypeError(
          "collection=... must be the LayerCollection returned by "
          f"kfac_jax_lite.scan(...); got {type(collection).__name__}.")
    return estimator_lib.FisherEstimator(
        collection, damping=0.0, damping_type="exact", axis_name=axis_name,
        cov_ema_decay=0.95 if cov_ema_decay is None else cov_ema_decay)
  if not isinstance(estimator, estimator_lib.FisherEstimator):
    raise TypeError("estimator=... must be a kfac_jax_lite.FisherEstimator;"
                    f" got {type(estimator).__name__}.")
  if estimator.damping_type != "exact":
    raise ValueError(
        f"estimator=... has damping_type={estimator.damping_type!r}; the "
        "eigenbasis needs the factors' eigenvectors: build it with "
        "FisherEstimator(..., damping_type='exact').")
  given = {"axis_name": axis_name, "cov_ema_decay": cov_ema_decay}
  given = {k: v for k, v in given.items() if v is not None}
  if given:
    raise ValueError(
        f"{', '.join(f'{k}={v!r}' for k, v in given.items())} given with "
        "estimator=...: set these on the FisherEstimator instead.")
  if collection is not None and estimator.collection is not collection:
    raise ValueError("estimator=... was built for another collection than "
                     "the one given; pass estimator.collection (or None).")
  return estimator


class _Layout(NamedTuple):
  """Static: which groups are rotated, and the leaves Adam takes alone."""
  groups: tuple   # (j, name) of each rotated group
  rest: tuple     # leaf indices outside rotated layers
  layers: tuple   # layer indices of the rotated groups


def _layout(est) -> _Layout:
  groups = tuple((j, grouping.group_name(g)) for j, g in enumerate(
      est.groups) if rotated(est.blocks[g[0]]))
  layers = tuple(i for j, _ in groups for i in est.groups[j])
  used = {p for i in layers for p in est.collection.layers[i].param_indices}
  total = len(est.collection.leaf_paths)
  rest = tuple(i for i in range(total)
               if i not in used and est.collection.is_trainable(i))
  return _Layout(groups, rest, layers)


def _init(est, curvature, lay, params):
  cstate = curvature.init(params)
  stacked = cstate.estimator.stacked
  mu, nu = {}, {}
  for j, name in lay.groups:
    b, n = est.blocks[est.groups[j][0]], len(est.groups[j])
    shape = ((n,) if n > 1 else ()) + (b.layout.a_dim, b.layout.g_dim)
    mu[name] = jnp.zeros(shape, stacked[name].scale.dtype)
    nu[name] = jnp.zeros(shape, stacked[name].scale.dtype)
  leaves = jax.tree.leaves(params)
  rest = tuple(jnp.zeros_like(leaves[i]) for i in lay.rest)
  return EigenAdamState(jnp.zeros((), jnp.int32), cstate, mu, nu, rest,
                        tuple(jnp.zeros_like(x) for x in rest))


def scale_by_kfac_eigen_adam(
    collection: Optional[LayerCollection], *, b1: float = 0.9,
    b2: float = 0.95, eps: float = 1e-8, refresh_period: int = 5,
    cov_ema_decay: Optional[float] = None, cov_update_period: int = 1,
    rotate_second_moments: bool = False, axis_name: Any = None,
    seed: int = 0,
    estimator: Optional[estimator_lib.FisherEstimator] = None,
    basis_update: str = "eigh",
) -> optax.GradientTransformationExtraArgs:
  """Adam in the Kronecker eigenbasis of K-FAC's factors (see the module
  docstring for the math).

  .. math::
    u = Q_A \\frac{\\hat M}{\\sqrt{\\hat V} + \\epsilon} Q_G^T,\\quad
    \\hat M, \\hat V \\text{ Adam's moments of } Q_A^T \\nabla W Q_G

  Returns a *direction*, like ``optax.scale_by_adam``; dense layers (a
  Kronecker block, its factors eigendecomposed) get it in their eigenbasis,
  every other parameter plain Adam (:func:`rotated_layers` lists which).

  Args:
    collection: from :func:`kfac_jax_lite.scan` (None with ``estimator``).
    b1: β₁, decay of the first moment, in ``[0, 1)``.
    b2: β₂, decay of the second moment, in ``[0, 1)``.
    eps: ε > 0, added to ``√V̂``.
    refresh_period: recompute the eigenbases every this many steps (at
      steps 0, p, 2p, ...; under ``lax.cond``).
    cov_ema_decay: EMA decay of K-FAC's factors, in ``[0, 1)`` (default
      0.95).
    cov_update_period: fold in statistics every this many steps.
    rotate_second_moments: carry ``V`` into a refreshed basis
      (``(R_A²)ᵀ V R_G²``) instead of keeping it (SOAP).
    axis_name: ``pmap``/``shard_map`` axis of data parallelism: the
      factors describe the global batch. Average the gradients yourself
      (``lax.pmean``); every replica then keeps the same state.
    seed: seed of K-FAC's sampling key.
    estimator: a :class:`~kfac_jax_lite.FisherEstimator` with
      ``damping_type="exact"`` for its other options (``stats_fraction``,
      ``estimation_mode``, ...); ``cov_ema_decay`` and ``axis_name`` are
      then set on it.
    basis_update: how a refresh after the first moves the basis:
      ``"eigh"``, a new eigendecomposition, or ``"qr"``, one step of
      orthogonal iteration from the current basis
      (:func:`~kfac_jax_lite.linalg.power_basis_step`, SOAP's update:
      cheaper per refresh, a larger program; docs/kfac_soap.md compares
      them). The first refresh is an ``eigh`` either way.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`EigenAdamState`, whose ``update`` takes ``params`` and exactly
    one of ``batch=`` or ``stats=``.

  Raises:
    ValueError: for ``b1``, ``b2`` or ``cov_ema_decay`` outside ``[0,
      1)``, ``eps <= 0``, a period below 1, a non-bool
      ``rotate_second_moments``, a ``basis_update`` other than ``"qr"``
      and ``"eigh"``, an ``estimator`` without
      ``damping_type="exact"``; at ``update``, without ``params``.

  Example:
    >>> tx = optax.chain(kl.scale_by_kfac_eigen_adam(collection),
    ...                  optax.scale_by_learning_rate(3e-3))
    >>> updates, state = tx.update(grads, state, params, batch=batch)
  """
  check_beta("b1", b1)
  check_beta("b2", b2)
  check_eps(eps)
  if cov_ema_decay is not None:
    check_beta("cov_ema_decay", cov_ema_decay)
  check_period("refresh_period", refresh_period)
  if not isinstance(rotate_second_moments, bool):
    raise ValueError(f"rotate_second_moments={rotate_second_moments!r} must "
                     "be True or False.")
  eigen_basis.check_basis_update(basis_update)
  est = eigen_estimator(collection, estimator, axis_name, cov_ema_decay)
  power = basis_update == "qr"
  # With "qr" the estimator's refresh (an eigh) runs at the first applied
  # step only: count % (2³¹ - 1) is 0 there and never again.
  curvature = update_curvature(
      est, damping=0.0, cov_update_period=cov_update_period,
      inverse_update_period=eigen_basis.ONCE if power else refresh_period,
      seed=seed)
  lay = _layout(est)

  def update_fn(updates, state, params=None, *, batch=None, stats=None,
                **extra_args):
    del extra_args
    check_state(state, EigenAdamState._fields, "scale_by_kfac_eigen_adam")
    if params is None:
      raise ValueError("scale_by_kfac_eigen_adam.update needs params=... "
                       "(the current parameters), as optax.adamw does.")
    est.collection.check_params(params)
    inputs = est.product_inputs(state.curvature.estimator, updates,
                                "updates")
    _, cstate = curvature.update(inputs.checked(), state.curvature, params,
                                 batch=batch, stats=stats)
    # update_curvature's state is a CurvatureState (optax types it as any
    # pytree).
    cstate = cast(CurvatureState, cstate)
    count = jnp.asarray(optax.safe_increment(state.count))
    refreshed = cstate.num_inverse_updates > (
        state.curvature.num_inverse_updates)
    orders = {}
    if power:
      cstate, moved, orders = eigen_basis.power_update(
          est, lay.groups, state.curvature.count, cstate, refresh_period)
      refreshed = refreshed | moved
    outs, mu, nu = _rotated_step(est, lay, state, cstate, inputs, count,
                                 refreshed, (b1, b2, eps),
                                 rotate_second_moments, orders)
    rest_mu, rest_nu, rest_out = [], [], []
    for i, m, v in zip(lay.rest, state.rest_mu, state.rest_nu):
      g = inputs.leaves[i]
      m = b1 * m + (1 - b1) * g
      v = b2 * v + (1 - b2) * jnp.square(g)
      rest_mu.append(m)
      rest_nu.append(v)
      rest_out.append(adam_direction(m, v, count, b1, b2, eps).astype(
          g.dtype))
    leaves = list(inputs.leaves)
    for i, x in zip(lay.rest, rest_out):
      leaves[i] = x
    parts = [outs[i] if outs[i] is not None else tuple(
        leaves[p] for p in layer.param_indices)
             for i, layer in enumerate(est.collection.layers)]
    direction = grouping.merge_params(est.collection, updates, leaves, parts)
    return direction, EigenAdamState(count, cstate, mu, nu, tuple(rest_mu),
                                     tuple(rest_nu))

  return optax.GradientTransformationExtraArgs(
      lambda params: _init(est, curvature, lay, params), update_fn)


def _rotated_step(est, lay, state, cstate, inputs, count, refreshed, hyper,
                  rotate_nu, orders):
  """The rotated groups' new moments and each rotated layer's parameter
  tuple (None for the other layers)."""
  b1, b2, eps = hyper
  old, new = state.curvature.estimator.stacked, cstate.estimator.stacked
  mu, nu, per_group, groups = {}, {}, [], []
  for j, name in lay.groups:
    g = est.groups[j]
    block = est.blocks[g[0]]

    def carry(args, g=g):
      m, v, o, s, k = args
      fn = lambda m, v, o, s, k: carry_moments(m, v, o, s, rotate_nu, k)  # noqa
      return jax.vmap(fn)(m, v, o, s, k) if len(g) > 1 else fn(m, v, o, s, k)

    m, v = lax.cond(refreshed, carry, lambda a: a[:2],
                    (state.mu[name], state.nu[name], old[name], new[name],
                     orders.get(name, (None, None))))

    rot = grouping.map_group(lambda b, s, x: _into(x, *_basis(s)), block,
                             len(g), new[name], inputs.per_group[j])
    m = b1 * m + (1 - b1) * rot
    v = b2 * v + (1 - b2) * jnp.square(rot)
    d = adam_direction(m, v, count, b1, b2, eps)
    out = grouping.map_group(lambda b, s, x: _out(x, *_basis(s)), block,
                             len(g), new[name], d)
    mu[name], nu[name] = m, v
    per_group.append(out)
    groups.append(g)
  layers = grouping.per_layer(groups, per_group, len(est.blocks),
                              runtime_index=True)
  parts = inputs.parts
  outs = [None if r is None else est.blocks[i].finish_product(r, parts[i])
          for i, r in enumerate(layers)]
  return outs, mu, nu


def rotated_layers(source) -> tuple:
  """The names of the layers :func:`scale_by_kfac_eigen_adam` runs in
  their eigenbasis; every other parameter gets plain Adam.

  A layer is rotated when its block is a Kronecker block (dense layers,
  embeddings: their output side only) whose factors are
  eigendecomposed; convolutions, normalisation scales, generic layers and
  EK-FAC blocks are not.

  Args:
    source: a :class:`~kfac_jax_lite.LayerCollection` (its default
      estimator) or a :class:`~kfac_jax_lite.FisherEstimator` with
      ``damping_type="exact"``.

  Returns:
    A tuple of layer names, in collection order.

  Example:
    >>> kl.rotated_layers(collection)
    ("['blocks'][0]['qkv']", ...)
  """
  if isinstance(source, estimator_lib.FisherEstimator):
    est = eigen_estimator(None, source, None, None)
  else:
    est = eigen_estimator(source, None, None, None)
  return tuple(est.collection.layers[i].name for i in _layout(est).layers)


def kfac_soap(learning_rate: ScalarOrSchedule,
              collection: Optional[LayerCollection], *,
              b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
              weight_decay: float = 0.01, refresh_period: int = 5,
              cov_ema_decay: Optional[float] = None,
              stats_fraction: float = 0.125,
              rotate_second_moments: bool = False, seed: int = 0,
              estimator: Optional[estimator_lib.FisherEstimator] = None,
              basis_update: str = "eigh",
              ) -> optax.GradientTransformationExtraArgs:
  """SOAP with K-FAC's statistics: AdamW in the factors' eigenbasis.

  .. math::
    \\Delta\\theta_t = -\\alpha_t\\,(u_t + \\eta\\,\\theta_t)

  with ``u`` the direction of :func:`scale_by_kfac_eigen_adam`. It is

  .. code-block:: python

    skip_nonfinite(optax.chain(
        scale_by_kfac_eigen_adam(collection, b1=b1, b2=b2, eps=eps, ...),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate)))

  with the statistics taken from the first ``⌈stats_fraction · B⌉``
  examples of ``batch=``. Its learning rate is of AdamW's order. On the
  character-level GPT of ``examples/char_gpt.py`` (``docs/kfac_soap.md``,
  2-core CPU) it reached AdamW's 600-step validation loss in 300 steps at
  ``lr=3e-3, refresh_period=10`` (:func:`~kfac_jax_lite.kfac_adamw`: 350),
  and a refresh every 5 steps (the default) was ahead of that over the
  150 steps compared.

  Args:
    learning_rate: α, a float or schedule.
    collection: from :func:`kfac_jax_lite.scan` (None with ``estimator``).
    b1: β₁ (first moment).
    b2: β₂ (second moment, in the eigenbasis).
    eps: ε.
    weight_decay: η, decoupled.
    refresh_period: recompute the eigenbases every this many steps.
    cov_ema_decay: EMA decay of the factors (default 0.95).
    stats_fraction: the share ``f ∈ (0, 1]`` of ``batch=``'s examples the
      statistics use (see :func:`~kfac_jax_lite.kfac_adamw`).
    rotate_second_moments: see :func:`scale_by_kfac_eigen_adam`.
    seed: seed of K-FAC's sampling key.
    estimator: see :func:`scale_by_kfac_eigen_adam`.
    basis_update: ``"eigh"`` or ``"qr"``, see
      :func:`scale_by_kfac_eigen_adam`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` of descent updates; steps
    whose gradients or statistics are not finite are skipped and counted
    (:func:`~kfac_jax_lite.skip_nonfinite`).

  Raises:
    ValueError: as :func:`scale_by_kfac_eigen_adam`, and for a negative
      ``weight_decay`` or a ``stats_fraction`` outside ``(0, 1]``.

  Example:
    >>> tx = kfac_jax_lite.kfac_soap(3e-3, collection)
    >>> updates, state = tx.update(grads, state, params, batch=batch)
  """
  check_hyperparameter("learning_rate", learning_rate)
  check_hyperparameter("weight_decay", weight_decay)
  linearization.check_fraction(stats_fraction)
  direction = scale_by_kfac_eigen_adam(
      collection, b1=b1, b2=b2, eps=eps, refresh_period=refresh_period,
      cov_ema_decay=cov_ema_decay,
      rotate_second_moments=rotate_second_moments, seed=seed,
      estimator=estimator, basis_update=basis_update)
  if stats_fraction < 1.0:
    direction = statistics_from_head(direction, stats_fraction)
  return skip_nonfinite(optax.chain(
      direction, optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate)))
