"""K-FAC as optax transforms: ``scale_by_kfac`` and ``kfac``.

All curvature state (factors, cached inverses, counters, the sampling key)
lives in the optax state; every decision (update the statistics? refresh
the inverses?) is traced with ``lax.cond``, so one jitted step is one
compiled program.

Example:
  >>> collection = kfac_jax_lite.scan(loss_fn, params, batch)
  >>> tx = kfac_jax_lite.kfac(1e-3, collection, damping=1e-3)
  >>> state = tx.init(params)
  >>> grads = jax.grad(loss_fn)(params, batch)
  >>> updates, state = tx.update(grads, state, params, batch=batch)
  >>> params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Union

import jax
from jax import lax
import jax.numpy as jnp
import optax

from kfac_jax_lite import distributed
from kfac_jax_lite import estimator as estimator_lib
from kfac_jax_lite import keys as keys_lib
from kfac_jax_lite import linalg
from kfac_jax_lite.collection import LayerCollection

ScalarOrSchedule = Union[float, optax.Schedule]


def check_period(name, value):
  """A period is a positive int, or an integer scalar array (injected)."""
  if isinstance(value, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(
      value.dtype, jnp.integer) and value.shape == ():
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(
        f"{name}={value!r} must be a positive int (a number of steps).")


def check_nonnegative(name, value):
  """Validates Python numbers; arrays (e.g. injected) are checked by users."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if value < 0:
      raise ValueError(f"{name}={value!r} must be >= 0.")


def unnest_kwargs(kwargs: dict, name: str) -> dict:
  """``optax.inject_hyperparams`` re-calls a factory with its bound
  signature, passing a ``**kwargs`` catch-all as one keyword ``name=dict``;
  this flattens it back."""
  kwargs = dict(kwargs)
  kwargs.update(kwargs.pop(name, None) or {})
  return kwargs


def value_at(x, count):
  """A hyperparameter's value at step ``count`` (float, array or schedule)."""
  return x(count) if callable(x) else x


def check_batch_and_stats(batch, stats):
  if (batch is None) == (stats is None):
    which = "both batch and stats" if batch is not None else (
        "neither batch nor stats")
    raise ValueError(
        "update() needs exactly one of batch=... (K-FAC computes its "
        "statistics from the batch) or stats=... (from "
        f"value_grad_and_stats); got {which}.")


class CurvatureState(NamedTuple):
  count: jnp.ndarray                # [] int32, updates done
  rng: jnp.ndarray                  # [2] uint32, key for sampled targets
  num_cov_updates: jnp.ndarray      # [] int32, statistics updates done
  num_inverse_updates: jnp.ndarray  # [] int32, steps that refreshed a cache
  estimator: estimator_lib.GroupedState  # same-shaped blocks stacked


@dataclasses.dataclass(frozen=True)
class Curvature:
  """Periodic statistics and cache refreshes (shared by the transforms).

  Statistics are folded in at steps ``0, k, 2k, ...`` (``k =
  cov_update_period``) and the damped powers refreshed at steps ``0, p,
  2p, ...`` (``p = inverse_update_period``). With ``stagger=True`` every
  block is refreshed at step 0, then a ``1/p`` slice of the blocks at every
  step (round robin), so no step pays for all inverses at once.
  """
  estimator: estimator_lib.FisherEstimator
  cov_update_period: int = 1
  inverse_update_period: int = 5
  stagger: bool = False
  axis_name: Optional[str] = None
  seed: int = 0

  def __post_init__(self):
    check_period("cov_update_period", self.cov_update_period)
    check_period("inverse_update_period", self.inverse_update_period)

  def init(self, params) -> CurvatureState:
    # Distinct arrays per field: a shared buffer cannot be donated twice.
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    return CurvatureState(count=zero(), rng=jax.random.PRNGKey(self.seed),
                          num_cov_updates=zero(), num_inverse_updates=zero(),
                          estimator=self.estimator.group_state(
                              self.estimator.init(params)))

  def _static_every_step(self, period) -> bool:
    return isinstance(period, int) and period == 1

  def _refresh(self, count, est_state, damping, gate):
    """Refreshes the caches as scheduled (and only where ``gate`` holds)."""
    est, period = self.estimator, self.inverse_update_period
    if self.stagger and not isinstance(period, int):
      raise ValueError(
          "stagger_inverse_updates=True needs a static inverse_update_period;"
          " mark it static (e.g. inject_hyperparams(..., static_args=...)).")
    refresh = lambda s, layers=None: est.update_cache(s, damping, layers)  # noqa: E731
    if not self.stagger or self._static_every_step(period):
      if self._static_every_step(period) and gate is None:
        return refresh(est_state), jnp.asarray(True)
      do = (count % period) == 0
      do = do if gate is None else do & gate
      return lax.cond(do, refresh, lambda s: s, est_state), do
    gate = jnp.asarray(True) if gate is None else gate
    n = len(est.blocks)
    new = lax.cond((count == 0) & gate, refresh, lambda s: s, est_state)
    for j in range(period):
      layers = tuple(range(j, n, period))
      if layers:
        new = lax.cond((count > 0) & (count % period == j) & gate,
                       lambda s, l=layers: refresh(s, l), lambda s: s, new)
    return new, gate

  def step(self, state: CurvatureState, params, batch, stats, damping,
           linearized=None, gate=None):
    """Updates statistics and caches as scheduled; returns the new state.

    ``linearized`` (an :class:`~kfac_jax_lite.estimator.Linearized` of this
    batch) replaces ``batch`` when the caller already ran the forward pass.
    ``gate`` (a scalar bool, "the gradients are finite"): where it is False
    the counters, the key and the caches stay as they are (it joins the
    predicate of the refresh's ``lax.cond``); the factors fold in only
    finite statistics whatever the gate. There is no conditional around
    the whole state: on XLA:CPU one copies every factor and cache each
    step and doubles the compile time.

    Static periods of 1 trace no conditional (the refresh's, without a
    gate).
    """
    if linearized is not None:
      if stats is None:
        stats = lambda key: self.estimator.stats_from(linearized, key)  # noqa: E731
      batch = None
    check_batch_and_stats(batch, stats)
    # The estimator hashes the key with the axis index (per-replica draws).
    key, next_rng = keys_lib.step_keys(state.rng)
    count = state.count
    # Same-shaped blocks stay stacked in the state (one array per group
    # and leaf through the EMA, the refresh's conditional and the
    # products; see estimator.GroupedState). A per-layer state (from an
    # older checkpoint or FisherEstimator.init) is stacked here.
    est = self.estimator
    grouped = est.group_state(state.estimator)

    def cov_update(s):
      st = stats(key) if callable(stats) else stats
      return self.estimator.update_curvature(s, params, batch, key, stats=st)

    if self._static_every_step(self.cov_update_period):
      do_cov = jnp.asarray(True)
      est_state = cov_update(grouped)
    else:
      do_cov = (count % self.cov_update_period) == 0
      est_state = lax.cond(do_cov, cov_update, lambda s: s, grouped)
    if gate is not None:
      # The factors are not selected: every block already folds in only
      # finite statistics (blocks.base.ema_update). A select of every
      # factor on one global predicate doubles XLA's compile time (all
      # factors then stay live until the last gradient is checked).
      do_cov = do_cov & gate
    lam = jnp.asarray(damping, linalg.factor_dtype())
    est_state, do_inv = self._refresh(count, est_state, lam, gate)
    one = lambda b: b.astype(jnp.int32)  # noqa: E731
    if gate is not None:
      next_rng = jnp.where(gate, next_rng, state.rng)
    return CurvatureState(
        count=count + (1 if gate is None else one(gate)), rng=next_rng,
        num_cov_updates=state.num_cov_updates + one(do_cov),
        num_inverse_updates=state.num_inverse_updates + one(do_inv),
        estimator=est_state)


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


def make_curvature(collection, *, cov_ema_decay, cov_update_period,
                   inverse_update_period, estimation_mode, power, axis_name,
                   seed, stagger=False, **estimator_kwargs) -> Curvature:
  if not isinstance(power, (int, float)) or power >= 0:
    raise ValueError(f"power={power!r} must be a negative number (-1, -0.5).")
  exps = tuple(estimator_kwargs.pop("exps", (power,)))
  if power not in exps:
    exps = exps + (power,)
  est = estimator_lib.FisherEstimator(
      collection, cov_ema_decay=cov_ema_decay, damping=0.0, exps=exps,
      estimation_mode=estimation_mode, axis_name=axis_name,
      **estimator_kwargs)
  return Curvature(est, cov_update_period, inverse_update_period, stagger,
                   axis_name, seed)


def kl_clip_coefficient(direction, grads, learning_rate, norm_constraint):
  """KL clipping (Ba, Grosse & Martens 2017, sec. 5).

  .. math:: \\nu = \\min\\left(1, \\sqrt{\\frac{C}{\\alpha^2\\, g^T \\hat F^{-1} g}}
    \\right)

  Returns ``ν`` (1 when the constraint is inactive or ``gᵀF̂⁻¹g <= 0``).
  """
  sq = linalg.inner_products((direction, grads), ((0, 1),))[0]
  sq = learning_rate ** 2 * sq
  return jnp.where(sq > 0, jnp.minimum(1.0, jnp.sqrt(
      norm_constraint / jnp.where(sq > 0, sq, 1.0))), 1.0)


def scale_by_kfac(collection: LayerCollection, *,
                  damping: ScalarOrSchedule = 1e-3,
                  cov_ema_decay: float = 0.95, cov_update_period: int = 1,
                  inverse_update_period: int = 5,
                  estimation_mode: str = "gradients", power: float = -1,
                  norm_constraint: Optional[float] = None,
                  learning_rate: ScalarOrSchedule = 1.0,
                  axis_name: Optional[str] = None, seed: int = 0,
                  stagger_inverse_updates: bool = False,
                  **estimator_kwargs: Any
                  ) -> optax.GradientTransformationExtraArgs:
  """Preconditions gradients with the K-FAC curvature: ``F̂^power g``.

  .. math::
    u = \\nu\\, (\\hat F + \\lambda I)^{p} g,\\qquad \\hat F =
    \\mathrm{diag}_\\ell (c_\\ell A_\\ell \\otimes G_\\ell)

  with factors refreshed every ``cov_update_period`` steps and their damped
  powers every ``inverse_update_period`` steps (Martens & Grosse 2015), and
  ``ν`` the KL-clipping coefficient when ``norm_constraint`` is set. Returns
  a *direction*, like ``optax.scale_by_adam``.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    damping: λ, a float or an ``optax.Schedule`` of the step count.
    cov_ema_decay: EMA decay of the factors, in ``[0, 1)``.
    cov_update_period: update the statistics every this many steps.
    inverse_update_period: refresh the damped powers every this many steps
      (at steps 0, k, 2k, ...), under ``lax.cond``.
    estimation_mode: ``gradients``, ``empirical``, ``curvature_prop``,
      ``curvature_prop_GGN``, ``exact``, ``exact_GGN``.
    power: the exponent ``p`` (``-1`` natural gradient, ``-0.5``).
    norm_constraint: ``C`` of KL clipping, or None.
    learning_rate: the learning rate the direction will be scaled by, used
      only by KL clipping (``kfac`` passes its own).
    axis_name: ``pmap``/``shard_map`` axis of data parallelism: the
      statistics describe the global batch and every replica keeps the same
      state. Average the gradients yourself first (``lax.pmean(grads,
      axis_name)``): ``update`` preconditions the gradient it is given.
      With ``stats_sync`` and ``distributed_inverses`` (estimator options,
      below) the statistics are averaged only before each refresh and the
      inverses split across the axis' devices.
    seed: seed of the sampling key kept in the state.
    stagger_inverse_updates: refresh a slice of the blocks every step
      instead of all blocks every ``inverse_update_period`` steps.
    **estimator_kwargs: more :class:`FisherEstimator` options
      (``num_samples``, ``damping_type``, ``exps``, ``stats_sync``,
      ``distributed_inverses``, ``stats_fraction``, ...).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``params`` and exactly one of ``batch=`` or ``stats=``.
  """
  check_nonnegative("damping", damping)
  if norm_constraint is not None:
    check_nonnegative("norm_constraint", norm_constraint)
  curvature = make_curvature(
      collection, cov_ema_decay=cov_ema_decay,
      cov_update_period=cov_update_period,
      inverse_update_period=inverse_update_period,
      estimation_mode=estimation_mode, power=power, axis_name=axis_name,
      seed=seed, stagger=stagger_inverse_updates, **estimator_kwargs)
  est = curvature.estimator

  def update_checked(updates, state, params=None, *, batch=None,
                     stats=None, **extra_args):
    """``(direction, state, finite)``: the update and :func:`inputs_finite`
    of ``updates`` and ``stats`` (for :func:`kfac`, which selects its
    momentum on it).

    The check reads ``updates`` as the product does
    (:meth:`FisherEstimator.product_inputs`: ``[W; b]`` per dense layer),
    so each gradient leaf is read once, where the matrices are built, and
    whatever computed it (an L2 term's ``2λW``, say) fuses into that
    kernel instead of being materialised for the check.
    """
    del extra_args  # Unknown extra args are ignored (optax.chain forwards).
    if params is None:
      raise ValueError("scale_by_kfac.update needs params=... (the current "
                       "parameters), as optax.adamw does.")
    # curvature.step checks params too, but after product_inputs has
    # checked the updates: checked here first, a tree that matches neither
    # is reported as params, the argument a caller most likely got wrong.
    est.collection.check_params(params)
    count = state.count
    inputs = est.product_inputs(state.estimator, updates, "updates")
    finite = inputs_finite(inputs.checked(), stats, axis_name)
    # Non-finite gradients or statistics never reach the factors.
    state = curvature.step(state, params, batch, stats,
                           value_at(damping, count), gate=finite)
    direction = est.multiply_matpower(state.estimator, updates, power,
                                      inputs=inputs)
    if norm_constraint is not None:
      nu = kl_clip_coefficient(direction, updates,
                               value_at(learning_rate, count),
                               norm_constraint)
      direction = jax.tree.map(lambda d: (nu * d).astype(d.dtype), direction)
    return direction, state, finite

  def update_fn(updates, state, params=None, **extra_args):
    return update_checked(updates, state, params, **extra_args)[:2]

  tx = _ScaleByKFAC(curvature.init, update_fn)
  tx.update_checked = update_checked
  return tx


class _ScaleByKFAC(optax.GradientTransformationExtraArgs):
  """``scale_by_kfac``'s transformation; also carries ``update_checked``
  (the update with its finiteness check), for :func:`kfac`. No
  ``__slots__``, so instances take that attribute."""


class SkipNonFiniteState(NamedTuple):
  num_skipped: jnp.ndarray  # [] int32, steps skipped (non-finite input)
  inner: Any                # the wrapped transformation's state


def _is_curvature(x) -> bool:
  return isinstance(x, CurvatureState)


def skip_nonfinite(inner: optax.GradientTransformationExtraArgs,
                   axis_name=None) -> optax.GradientTransformationExtraArgs:
  """Skips steps whose gradients or ``stats=`` are not all finite.

  On such a step the update is zero and the inner state (momentum, damping,
  counters, the sampling key, cached inverses) is returned unchanged;
  K-FAC factors fold in only finite statistics (finite statistics that came
  with non-finite gradients still count); ``num_skipped`` counts the
  event. Unlike
  ``optax.apply_if_finite`` it also checks curvature statistics passed as
  ``stats=``, and never gives up skipping. A NaN in a batch given as
  ``batch=`` shows up in the gradients of that batch.

  The inner update always runs and its results are selected with
  ``jnp.where``. The K-FAC states inside (:class:`CurvatureState`) guard
  themselves (``scale_by_kfac`` gates its counters, key and refreshes on the
  same check and folds only finite statistics into its factors), so their
  large factors and caches are never copied through a select or a
  conditional. With ``axis_name`` a step is skipped on every replica when
  any replica's inputs are not finite.
  """

  def init_fn(params):
    return SkipNonFiniteState(jnp.zeros((), jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    finite = inputs_finite(updates, extra_args.get("stats"), axis_name)
    new_updates, new_inner = inner.update(updates, state.inner, params,
                                          **extra_args)
    new_updates = zero_unless(finite, new_updates)
    new_inner = jax.tree.map(
        lambda n, o: n if _is_curvature(n) else select_tree(finite, n, o),
        new_inner, state.inner, is_leaf=_is_curvature)
    return new_updates, SkipNonFiniteState(
        state.num_skipped + (~finite).astype(jnp.int32), new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def inputs_finite(updates, stats=None, axis_name=None) -> jnp.ndarray:
  """True when the gradients (and ``stats``, if given) are all finite.

  With ``axis_name``: on every replica of the axis (the replicas' inputs
  may differ, e.g. statistics under ``stats_sync="before_refresh"``), so
  every replica takes the same decision and their states never drift.

  Statistics from :func:`~kfac_jax_lite.value_grad_and_stats` carry
  ``"finite_marker"`` (:func:`kfac_jax_lite.linalg.finite_marker` of
  them, taken on the stacked groups before they were split per layer);
  it stands for their leaves here. Other ``stats`` are checked leaf by
  leaf.
  """
  check = [updates]
  marker = getattr(stats, "finite_marker", None)  # MERGE: Stats attribute.
  if marker is not None:
    check.append(marker)
  elif stats is not None:
    check.append(stats)
  finite = linalg.all_finite(check)
  if axis_name is not None:
    distributed.axis_size(axis_name)  # A clear error if it is not bound.
    finite = lax.pmin(finite.astype(jnp.int32), axis_name) > 0
  return finite


def kfac(learning_rate: ScalarOrSchedule, collection: LayerCollection, *,
         momentum: float = 0.9, weight_decay: float = 0.0,
         damping: ScalarOrSchedule = 1e-3, cov_ema_decay: float = 0.95,
         inverse_update_period: int = 5, estimation_mode: str = "gradients",
         norm_constraint: Optional[float] = None,
         **scale_by_kfac_kwargs: Any) -> optax.GradientTransformationExtraArgs:
  """K-FAC with momentum and a learning rate: descent updates like adam.

  .. math::
    v \\leftarrow \\mu v + \\nu\\hat F^{-1} g + \\eta\\,\\theta,\\qquad
    \\Delta\\theta = -\\alpha\\, v

  (decoupled weight decay ``η`` after preconditioning, as TF K-FAC's
  ``use_weight_decay``; ``ν`` the KL-clipping coefficient).

  Args:
    learning_rate: α, a float or schedule.
    collection: from :func:`kfac_jax_lite.scan`.
    momentum: μ (0 disables momentum).
    weight_decay: η.
    damping, cov_ema_decay, inverse_update_period, estimation_mode,
      norm_constraint: see :func:`scale_by_kfac`.
    **scale_by_kfac_kwargs: more :func:`scale_by_kfac` options.

  Works under ``optax.inject_hyperparams`` (``learning_rate``, ``damping``,
  ``momentum``, ``weight_decay`` injectable) and ``optax.MultiSteps``.
  Steps with non-finite gradients or statistics are skipped and counted
  (:func:`skip_nonfinite`): ``state.num_skipped``.
  """
  check_nonnegative("learning_rate", learning_rate)
  check_nonnegative("momentum", momentum)
  scale_by_kfac_kwargs = unnest_kwargs(scale_by_kfac_kwargs,
                                       "scale_by_kfac_kwargs")
  precondition = scale_by_kfac(
      collection, damping=damping, cov_ema_decay=cov_ema_decay,
      inverse_update_period=inverse_update_period,
      estimation_mode=estimation_mode, norm_constraint=norm_constraint,
      learning_rate=learning_rate, **scale_by_kfac_kwargs)
  parts = []
  if not isinstance(weight_decay, (int, float)) or weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay))
  with_trace = not isinstance(momentum, (int, float)) or bool(momentum)
  if with_trace:
    parts.append(optax.trace(decay=momentum))
  scale = optax.scale_by_learning_rate(learning_rate)

  # The state is that of skip_nonfinite(chain(precondition, *parts, scale)).
  # The curvature guards itself (gate); the small rest of the chain runs
  # unconditionally and its results are selected.
  def init_fn(params):
    return SkipNonFiniteState(jnp.zeros((), jnp.int32),
                              (precondition.init(params),)
                              + tuple(p.init(params) for p in parts)
                              + (scale.init(params),))

  def update_fn(updates, state, params=None, **extra_args):
    # Selects, not a lax.cond: the momentum update and the select of the
    # new velocity are one kernel per parameter, and the select of the
    # update fuses into the caller's apply_updates; a conditional must
    # materialise both (one more kernel per parameter: on the autoencoder
    # of benchmarks/step_time.py, 411 fused instructions instead of 449
    # and about 0.15 s less compile).
    direction, curvature, finite = precondition.update_checked(
        updates, state.inner[0], params, **extra_args)
    old = tuple(state.inner[1:-1])
    new = []
    for part, s in zip(parts, old):
      direction, s = part.update(direction, s, params)
      new.append(s)
    new = select_tree(finite, tuple(new), old)
    if with_trace:
      # The step is scaled from the *selected* velocity (equal to the new
      # one when it is applied; a skipped step's is zeroed below): the
      # caller's apply_updates then reads the velocity this step wrote,
      # not the old one, which that write overwrites in place. Scaled from
      # the unselected one, XLA recomputed μv + d inside apply_updates'
      # kernel, which then read the old velocity after its buffer was
      # reused, and XLA copied every velocity leaf first (the whole
      # parameter size, every step).
      direction = new[-1].trace
    new_updates, scale_state = scale.update(direction, state.inner[-1],
                                            params)
    scale_state = select_tree(finite, scale_state, state.inner[-1])
    return zero_unless(finite, new_updates), SkipNonFiniteState(
        state.num_skipped + (~finite).astype(jnp.int32),
        (curvature,) + new + (scale_state,))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Backwards-compatible name for the state of scale_by_kfac.
ScaleByKFACState = CurvatureState
