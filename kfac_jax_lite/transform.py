"""K-FAC as optax transforms: ``scale_by_kfac`` and ``kfac``.

``scale_by_kfac`` runs :func:`~kfac_jax_lite.update_curvature` (the
factors, cached damped powers, counters and sampling key, all in the optax
state) and multiplies the gradient by the refreshed curvature; ``kfac`` is
``skip_nonfinite(chain(scale_by_kfac, add_decayed_weights, trace,
scale_by_learning_rate))``, as ``optax.adam`` is ``chain(scale_by_adam,
scale_by_learning_rate)``. :func:`kfac`'s docstring has an example.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, cast

import jax
import jax.numpy as jnp
import optax

from kfac_jax_lite import estimator as estimator_lib
from kfac_jax_lite import sharded
from kfac_jax_lite import step_rules
from kfac_jax_lite.collection import LayerCollection
from kfac_jax_lite.curvature import CurvatureState
from kfac_jax_lite.curvature import ScalarOrSchedule
from kfac_jax_lite.curvature import check_nonnegative
from kfac_jax_lite.curvature import dynamic
from kfac_jax_lite.curvature import inputs_finite
from kfac_jax_lite.curvature import update_curvature
from kfac_jax_lite.curvature import value_at
from kfac_jax_lite.step_rules import DEFAULT_INVERSE_UPDATE_WARMUP
from kfac_jax_lite.step_rules import DEFAULT_NORM_CONSTRAINT


def select_tree(pred, new, old):
  """``where(pred, new, old)`` leaf by leaf; leaves that are the very same
  array in both (passed through unchanged) are not touched, so no copy of
  them is traced."""
  return jax.tree.map(lambda n, o: n if n is o else jnp.where(pred, n, o),
                      new, old)


def zero_unless(pred, tree):
  """``where(pred, x, 0)`` leaf by leaf: the updates of a step that is
  applied only when ``pred`` (a skipped step moves nothing)."""
  return jax.tree.map(lambda x: jnp.where(pred, x, jnp.zeros((), x.dtype)),
                      tree)


def make_estimator(collection, estimator, power, **fields
                   ) -> estimator_lib.FisherEstimator:
  """``estimator``, checked against ``collection`` and ``power``, or a new
  :class:`FisherEstimator` of ``collection`` with the ``fields`` that are
  not None."""
  if not isinstance(power, (int, float)) or isinstance(power, bool) or (
      power >= 0):
    raise ValueError(
        f"power={power!r} must be a static negative number (-1, -0.5); under "
        "optax.inject_hyperparams pass static_args=('power',).")
  fields = {k: v for k, v in fields.items() if v is not None}
  if estimator is None:
    exps = (power,)
    return estimator_lib.FisherEstimator(collection, damping=0.0, exps=exps,
                                         **fields)
  if fields:
    raise ValueError(
        f"{', '.join(f'{k}={v!r}' for k, v in fields.items())} given with "
        "estimator=...: set these on the FisherEstimator instead.")
  if not isinstance(estimator, estimator_lib.FisherEstimator):
    raise TypeError(
        "estimator=... must be a kfac_jax_lite.FisherEstimator; got "
        f"{type(estimator).__name__}.")
  if collection is not None and estimator.collection is not collection:
    raise ValueError(
        "estimator=... was built for another collection than the one "
        "given; pass the estimator's own (estimator.collection).")
  if power not in estimator.exps:
    raise ValueError(
        f"power={power!r} is not in the estimator's exps="
        f"{list(estimator.exps)}; add it there, so its power is cached.")
  return estimator


def check_hyperparameter(name, value):
  """A float, an int, a scalar array or a schedule (a callable of the step
  count); numbers must be >= 0 (arrays are checked at each step: a
  non-finite value skips the step)."""
  if callable(value) or (isinstance(value, (int, float)) and not isinstance(
      value, bool)):
    check_nonnegative(name, value)
    return
  if hasattr(value, "shape") and hasattr(value, "dtype") and (
      jnp.ndim(value) == 0) and jnp.issubdtype(
          cast(Any, value).dtype, jnp.number):  # hasattr checked dtype
    return
  raise TypeError(
      f"{name}={value!r} is a {type(value).__name__}; expected a number, a "
      "scalar array or an optax schedule (a function of the step count), "
      f"e.g. {name}=1e-3.")


def check_state(state, fields, fn):
  """``state`` is the transformation's own state (a NamedTuple with
  ``fields``), e.g. not None before ``init``."""
  if not all(hasattr(state, f) for f in fields):
    raise TypeError(
        f"{fn}.update: state is a {type(state).__name__}, not this "
        "transformation's state. Create it with state = tx.init(params) "
        "and pass the state that tx.update returned.")


def scale_by_kfac(collection: Optional[LayerCollection], *,
                  damping: ScalarOrSchedule = 1e-3,
                  cov_ema_decay: Optional[float] = None,
                  cov_update_period: int = 1,
                  inverse_update_period: int = 5,
                  estimation_mode: Optional[str] = None,
                  power: float = -1,
                  norm_constraint: Optional[float] = None,
                  learning_rate: ScalarOrSchedule = 1.0,
                  axis_name: Any = None,
                  stats_sync: Optional[str] = None,
                  distributed_inverses: Optional[bool] = None,
                  seed: int = 0,
                  stagger_inverse_updates: bool = False,
                  estimator: Optional[estimator_lib.FisherEstimator] = None,
                  mesh: Any = None,
                  curvature_axis: Any = None,
                  inverse_update_warmup: int = 0,
                  param_shardings: Any = None,
                  ) -> optax.GradientTransformationExtraArgs:
  """Preconditions gradients with the K-FAC curvature: ``F̂^power g``.

  .. math::
    u = \\nu\\, (\\hat F + \\lambda I)^{p} g,\\qquad \\hat F =
    \\mathrm{diag}_\\ell (c_\\ell A_\\ell \\otimes G_\\ell)

  with factors refreshed every ``cov_update_period`` steps and their damped
  powers every ``inverse_update_period`` steps (Martens & Grosse 2015), and
  ``ν`` the KL-clipping coefficient when ``norm_constraint`` is set. Returns
  a *direction*, like ``optax.scale_by_adam``. The state is that of
  :func:`~kfac_jax_lite.update_curvature`, which this runs every step.

  ``cov_ema_decay``, ``estimation_mode``, ``axis_name``, ``stats_sync`` and
  ``distributed_inverses`` are options of the
  :class:`~kfac_jax_lite.FisherEstimator` this builds (None: its default);
  for its other options (``num_samples``, ``damping_type``, ``exps``,
  ``compute_cholesky``, ``stats_fraction``, ...) pass ``estimator=`` and
  leave those five unset.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    damping: λ, a float or an ``optax.Schedule`` of the step count.
    cov_ema_decay: EMA decay of the factors, in ``[0, 1)`` (default 0.95).
    cov_update_period: update the statistics every this many steps.
    inverse_update_period: refresh the damped powers every this many steps
      (at steps 0, k, 2k, ...), under ``lax.cond``.
    estimation_mode: ``gradients`` (default), ``empirical``,
      ``curvature_prop``, ``curvature_prop_GGN``, ``exact``, ``exact_GGN``.
    power: the exponent ``p`` (``-1`` natural gradient, ``-0.5``).
    norm_constraint: ``C`` of KL clipping, or None (the default here;
      :func:`kfac` clips at ``1e-3`` by default).
    learning_rate: the learning rate the direction will be scaled by: used
      by KL clipping, and a non-finite value skips the step (``kfac`` passes
      its own).
    axis_name: ``pmap``/``shard_map`` axis of data parallelism: the
      statistics describe the global batch and every replica keeps the same
      state. Average the gradients yourself first (``lax.pmean(grads,
      axis_name)``): ``update`` preconditions the gradient it is given.
    stats_sync: ``"every_update"`` (default) or ``"before_refresh"``: when
      the factors are averaged over ``axis_name``.
    distributed_inverses: split the refresh across the devices of
      ``axis_name``.
    seed: seed of the sampling key kept in the state.
    stagger_inverse_updates: refresh a slice of the blocks every step
      instead of all blocks every ``inverse_update_period`` steps.
    estimator: a :class:`~kfac_jax_lite.FisherEstimator` of ``collection``
      to use instead of building one; its ``exps`` must contain ``power``.
    mesh: a ``jax.sharding.Mesh`` to spread the curvature over (with
      ``curvature_axis``; None: every device holds all of it). The state's
      factors and caches then live each on one device of the axis, are
      refreshed there, and precondition their layer's gradient there; only
      the preconditioned update moves (:mod:`kfac_jax_lite.sharded`, the
      plan: :mod:`kfac_jax_lite.placement`). Run the step under
      ``jax.jit`` with the batch sharded over the mesh, not with
      ``axis_name``.
    curvature_axis: the mesh axis name (or a tuple of names) the curvature
      is spread over.
    param_shardings: with ``mesh``, the sharded (FSDP) parameters'
      shardings, a params-like pytree of ``NamedSharding`` (or
      ``PartitionSpec``), e.g. ``jax.tree.map(lambda x: x.sharding,
      params)``: the update then stays split, laid out as they are
      (None: it is all-gathered, whole on every device).
    inverse_update_warmup: also refresh the damped powers at each of the
      first this many steps (0, the default here: none; :func:`kfac` uses
      20).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``params`` and exactly one of ``batch=``, ``stats=`` or ``linearized=``
    (``lin = FisherEstimator(collection).linearize(params, batch)``, with
    ``lin.gradient()`` the gradient: one forward pass for both, the
    statistics as ``batch=`` gives them). Where the gradients, statistics,
    damping or learning rate are not finite, the counters, key and caches
    stay and ``state.last_finite`` is False (the direction is then not
    finite either; :func:`skip_nonfinite` skips such steps).

  Raises:
    ValueError: for a negative ``learning_rate``, ``norm_constraint`` or
      ``inverse_update_warmup``, a period below 1, an unknown
      ``estimation_mode``, an ``estimator`` whose ``exps`` lack ``power``,
      a ``curvature_axis`` or ``param_shardings`` without ``mesh``, a
      ``curvature_axis`` not in it, ``mesh`` with ``axis_name``; at
      ``init``, parameters on devices outside ``mesh``; at ``update``,
      without ``params``, with neither or both of ``batch=`` and
      ``stats=``, with params that do not match ``collection``, or
      ``param_shardings`` that do not match them.
    TypeError: a ``param_shardings`` leaf that is not a sharding.

  Example:
    >>> tx = optax.chain(
    ...     kl.scale_by_kfac(collection, damping=1e-2),
    ...     optax.scale_by_learning_rate(1e-2))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params, batch=batch)
  """
  check_hyperparameter("learning_rate", learning_rate)
  check_hyperparameter("damping", damping)
  if norm_constraint is not None:
    check_hyperparameter("norm_constraint", norm_constraint)
  est = make_estimator(
      collection, estimator, power, cov_ema_decay=cov_ema_decay,
      estimation_mode=estimation_mode, axis_name=axis_name,
      stats_sync=stats_sync, distributed_inverses=distributed_inverses)
  est = sharded.place(est, mesh, curvature_axis, param_shardings)
  curvature = update_curvature(
      est, damping=damping, cov_update_period=cov_update_period,
      inverse_update_period=inverse_update_period,
      stagger_inverse_updates=stagger_inverse_updates, seed=seed,
      inverse_update_warmup=inverse_update_warmup)

  def update_fn(updates, state, params=None, *, batch=None, stats=None,
                linearized=None, **extra_args):
    del extra_args  # Unknown extra args are ignored (optax.chain forwards).
    check_state(state, CurvatureState._fields, "scale_by_kfac")
    if params is None:
      raise ValueError("scale_by_kfac.update needs params=... (the current "
                       "parameters), as optax.adamw does.")
    # Checked before the updates: a tree that matches neither is reported
    # as params, the argument a caller most likely got wrong.
    est.collection.check_params(params)
    lr = value_at(learning_rate, state.count)
    bound = value_at(norm_constraint, state.count)
    inputs = est.product_inputs(state.estimator, updates, "updates")
    # The curvature checks the gradients as the product reads them: one
    # reader per gradient leaf (docs/performance.md#one-read-per-gradient).
    _, state = curvature.update((inputs.checked(), dynamic(lr)), state,
                                params, batch=batch, stats=stats,
                                linearized=linearized)
    # update_curvature's state is a CurvatureState (optax types it as any
    # pytree).
    state = cast(CurvatureState, state)
    direction = est.multiply_matpower(state.estimator, updates, power,
                                      inputs=inputs)
    if norm_constraint is not None:
      nu = step_rules.kl_clip_coefficient(direction, updates, lr, bound)
      direction = jax.tree.map(lambda d: (nu * d).astype(d.dtype), direction)
    return direction, state

  return optax.GradientTransformationExtraArgs(curvature.init, update_fn)


class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    num_skipped: ``[]`` int32, the number of steps skipped so far.
    last_finite: ``[]`` bool, whether the last step was applied.
    inner: the wrapped transformation's state (for :func:`kfac`, the tuple
      of its chain's states, the first a ``CurvatureState``).

  Example:
    >>> state = kl.kfac(1e-2, collection).init(params)
    >>> state.num_skipped, state.inner[0].count
  """
  num_skipped: jnp.ndarray  # [] int32, steps skipped
  last_finite: jnp.ndarray  # [] bool, the last step was applied
  inner: Any                # the wrapped transformation's state


def _is_curvature(x) -> bool:
  return isinstance(x, CurvatureState)


def _step_finite(inner_state, updates, stats, axis_name):
  """Whether a step applies: the ``last_finite`` of every
  :class:`CurvatureState` in ``inner_state`` (each checked its inputs);
  without one, whether ``updates`` and ``stats`` are finite."""
  flags = [s.last_finite for s in jax.tree.leaves(
      inner_state, is_leaf=_is_curvature) if _is_curvature(s)]
  if not flags:
    return inputs_finite(updates, stats, axis_name)
  finite = flags[0]
  for f in flags[1:]:
    finite = finite & f
  return finite


def _skipped(finite, updates, new_inner, state):
  """The updates and state of a step that applies only where ``finite``:
  the inner state's leaves are selected, except the curvature states, which
  already kept themselves."""
  new_inner = jax.tree.map(
      lambda n, o: n if _is_curvature(n) else select_tree(finite, n, o),
      new_inner, state.inner, is_leaf=_is_curvature)
  return zero_unless(finite, updates), SkipNonFiniteState(
      state.num_skipped + (~finite).astype(jnp.int32), finite, new_inner)


def skip_nonfinite(inner: optax.GradientTransformation,
                   axis_name: Any = None
                   ) -> optax.GradientTransformationExtraArgs:
  """Skips the steps that K-FAC finds non-finite, like
  ``optax.apply_if_finite``.

  A step is skipped when a :class:`CurvatureState` inside ``inner`` (of
  :func:`scale_by_kfac` or :func:`update_curvature`) reports
  ``last_finite=False``: its gradients, statistics, damping or learning
  rate were not finite (on any replica of its ``axis_name``). Without one,
  when ``updates`` or ``stats=`` are not finite (on any replica of
  ``axis_name``). A skipped step returns zero updates and the inner state
  unchanged (momentum, step counts, the curvature's counters, key and
  caches; K-FAC factors fold in only finite statistics, and finite
  statistics that came with non-finite gradients still count);
  ``state.num_skipped`` counts skipped steps and ``state.last_finite``
  says whether the last step applied. Unlike ``optax.apply_if_finite`` it
  never gives up skipping.

  The inner update always runs and its results are selected with
  ``jnp.where``; the curvature states guard themselves, so their factors
  and caches are never copied through a select or a conditional.

  Args:
    inner: the transformation to guard (an ``optax.chain`` holding
      :func:`scale_by_kfac`, or any other).
    axis_name: the data-parallel axis over which finiteness is agreed when
      ``inner`` holds no curvature state; None outside ``pmap``/
      ``shard_map``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`SkipNonFiniteState`; extra arguments go to ``inner``.

  Example:
    >>> tx = kl.skip_nonfinite(optax.chain(
    ...     kl.scale_by_kfac(collection, power=-0.5),
    ...     optax.scale_by_learning_rate(1e-2)))
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return SkipNonFiniteState(jnp.zeros((), jnp.int32), jnp.ones((), bool),
                              inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    check_state(state, SkipNonFiniteState._fields, "skip_nonfinite")
    new_updates, new_inner = inner.update(updates, state.inner, params,
                                          **extra_args)
    finite = _step_finite(new_inner, updates, extra_args.get("stats"),
                          axis_name)
    return _skipped(finite, new_updates, new_inner, state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _skip_nonfinite_chain(*transforms) -> optax.GradientTransformationExtraArgs:
  """``skip_nonfinite(optax.chain(*transforms))``, the same updates and
  state, when only ``transforms[0]`` holds curvature states.

  The step's decision is known once ``transforms[0]`` ran, so each later
  state is selected as soon as it is computed, and an update leaf that is
  also a leaf of its transformation's new state (``optax.trace``'s
  velocity) is read from the selected state: the caller's
  ``apply_updates`` then reads the buffer the step writes
  (docs/performance.md#update-from-the-new-velocity).
  """
  transforms = [optax.with_extra_args_support(t) for t in transforms]

  def init_fn(params):
    return SkipNonFiniteState(jnp.zeros((), jnp.int32), jnp.ones((), bool),
                              tuple(t.init(params) for t in transforms))

  def update_fn(updates, state, params=None, **extra_args):
    check_state(state, SkipNonFiniteState._fields, "kfac")
    first, *rest = transforms
    new_updates, head = first.update(updates, state.inner[0], params,
                                     **extra_args)
    finite = _step_finite(head, updates, extra_args.get("stats"), None)
    new = [head]
    for t, old in zip(rest, state.inner[1:]):
      new_updates, s = t.update(new_updates, old, params, **extra_args)
      picked = select_tree(finite, s, old)
      same = {id(n): p for n, p in zip(jax.tree.leaves(s),
                                       jax.tree.leaves(picked))}
      new_updates = jax.tree.map(lambda u: same.get(id(u), u), new_updates)
      new.append(picked)
    return zero_unless(finite, new_updates), SkipNonFiniteState(
        state.num_skipped + (~finite).astype(jnp.int32), finite, tuple(new))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def kfac(learning_rate: ScalarOrSchedule, collection: LayerCollection, *,
         momentum: float = 0.9, weight_decay: float = 0.0,
         damping: ScalarOrSchedule = 1e-3,
         cov_ema_decay: Optional[float] = None,
         cov_update_period: int = 1, inverse_update_period: int = 5,
         estimation_mode: Optional[str] = None,
         norm_constraint: Optional[float] = DEFAULT_NORM_CONSTRAINT,
         axis_name: Any = None,
         stats_sync: Optional[str] = None,
         distributed_inverses: Optional[bool] = None, seed: int = 0,
         estimator: Optional[estimator_lib.FisherEstimator] = None,
         mesh: Any = None, curvature_axis: Any = None,
         inverse_update_warmup: int = DEFAULT_INVERSE_UPDATE_WARMUP,
         param_shardings: Any = None,
         stats_fraction: Optional[float] = None,
         ) -> optax.GradientTransformationExtraArgs:
  """K-FAC with momentum and a learning rate: descent updates like adam.

  .. math::
    v \\leftarrow \\mu v + \\nu\\hat F^{-1} g + \\eta\\,\\theta,\\qquad
    \\Delta\\theta = -\\alpha\\, v

  (weight decay ``η`` after preconditioning: TF K-FAC's ``use_weight_decay``).
  ``ν``, KL clipping (Ba, Grosse & Martens 2017, sec. 5), is on by default:

  .. math:: \\nu = \\min\\left(1, \\sqrt{C / (\\alpha^2\\, g^T \\hat F^{-1}
    g)}\\right),\\qquad C = 10^{-3}

  so that the step's predicted KL, :math:`\\alpha^2 \\nu^2 g^T\\hat F^{-1}
  g`, is at most ``C`` (``norm_constraint=None`` turns it off). The damped
  inverses are refreshed at each of the first ``inverse_update_warmup``
  (20) steps, then every ``inverse_update_period`` (5): a stale inverse
  early on, when the factors change fastest, inflates ``gᵀF̂⁻¹g`` by
  orders of magnitude and the clipping would shrink the step to nothing.
  On the examples' three models no rate of 1e-3, 1e-2, 1e-1 diverges; the
  best reaches the best Adam's 400-step loss in fewer steps on the MNIST
  autoencoder and the flax CNN, within Adam's seconds on the MNIST one
  only (docs/guides/tuning.md: the numbers, where a step goes, and what
  ``stats_fraction`` and ``damping`` change on the Equinox autoencoder).
  :func:`kfac_optimizer` adapts the damping, learning rate and momentum. It is

  ```python
  skip_nonfinite(optax.chain(
      scale_by_kfac(collection, learning_rate=learning_rate, ...),
      optax.add_decayed_weights(weight_decay),  # if weight_decay
      optax.trace(decay=momentum),              # if momentum
      optax.scale_by_learning_rate(learning_rate)))
  ```

  (the same updates and state; ``inverse_update_warmup`` passed on, and
  ``batch=`` cut to its head when ``stats_fraction < 1``). Build it for
  :func:`scale_by_kfac`'s other options (``power``, ``stagger_...``).

  Args:
    learning_rate: α, a float or schedule.
    collection: from :func:`kfac_jax_lite.scan`.
    momentum: μ (0 disables momentum).
    weight_decay: η, non-negative.
    damping: λ, a float or schedule (see :func:`scale_by_kfac`).
    cov_ema_decay: EMA decay of the factors (see :func:`scale_by_kfac`).
    cov_update_period: update the statistics every this many steps.
    inverse_update_period: refresh the damped inverses every this many steps.
    inverse_update_warmup: and at each of the first this many steps
      (default 20; 0 for the plain period).
    estimation_mode: how the statistics sample the Fisher (see
      :func:`scale_by_kfac`).
    norm_constraint: ``C`` of KL clipping (default ``1e-3``), or None for
      no clipping.
    axis_name: the ``pmap``/``shard_map`` axis of data parallelism.
    stats_sync: when the factors are averaged over ``axis_name``.
    distributed_inverses: split the refresh across the devices of
      ``axis_name``.
    seed: seed of the sampling key kept in the state.
    estimator: a :class:`~kfac_jax_lite.FisherEstimator` of ``collection``
      for the estimator options without a keyword here.
    mesh: spread the curvature over this ``jax.sharding.Mesh`` (see
      :func:`scale_by_kfac`).
    curvature_axis: the mesh axis name(s) it is spread over.
    param_shardings: the FSDP parameters' shardings (:func:`scale_by_kfac`).
    stats_fraction: ``f ∈ (0, 1]``: the statistics from ``batch=`` use its
      first ``max(⌈f·B⌉, 64)`` examples (all if fewer; example axis first),
      as ``kfac_adamw``'s; None (default): all. ``stats=`` are the caller's.
      Static under ``optax.inject_hyperparams`` (``static_args``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` of descent updates (add
    them with ``optax.apply_updates``), state :class:`SkipNonFiniteState`;
    ``update`` as :func:`scale_by_kfac`'s (``linearized=``: one pass).

  Raises:
    ValueError: for a negative ``momentum``, ``weight_decay`` or
      ``norm_constraint``, an ``inverse_update_warmup`` that is not a
      non-negative int, a ``stats_fraction`` outside ``(0, 1]``, and as
      :func:`scale_by_kfac`.
    TypeError: for a ``norm_constraint`` that is not a number, a scalar
      array or a schedule.

  Example:
    >>> collection = kl.scan(loss_fn, params, batch)
    >>> tx = kl.kfac(1e-2, collection, damping=1e-2)
    >>> opt_state = tx.init(params)
    >>> grads = jax.grad(loss_fn)(params, batch)
    >>> updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
    >>> params = optax.apply_updates(params, updates)

  Works under ``optax.inject_hyperparams`` (``learning_rate``, ``damping``,
  ``momentum``, ``weight_decay`` injectable; name the periods in
  ``static_args`` to keep a period of 1 free of its ``lax.cond``) and
  ``optax.MultiSteps``.
  Steps whose gradients, statistics, damping or learning rate are not
  finite are skipped, counted in ``state.num_skipped`` (:func:`skip_nonfinite`).
  """
  check_hyperparameter("momentum", momentum)
  check_hyperparameter("weight_decay", weight_decay)
  first = scale_by_kfac(
      collection, damping=damping, cov_ema_decay=cov_ema_decay,
      cov_update_period=cov_update_period,
      inverse_update_period=inverse_update_period,
      estimation_mode=estimation_mode, norm_constraint=norm_constraint,
      learning_rate=learning_rate, axis_name=axis_name,
      stats_sync=stats_sync, distributed_inverses=distributed_inverses,
      seed=seed, estimator=estimator, mesh=mesh,
      curvature_axis=curvature_axis,
      inverse_update_warmup=inverse_update_warmup,
      param_shardings=param_shardings)
  parts: list[optax.GradientTransformation] = [
      step_rules.kfac_statistics_share(first, stats_fraction)]
  if not isinstance(weight_decay, (int, float)) or weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay))
  if not isinstance(momentum, (int, float)) or momentum:
    parts.append(optax.trace(decay=momentum))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return _skip_nonfinite_chain(*parts)
