"""The full K-FAC optimizer of Martens & Grosse (2015) as an optax transform.

Each step, with :math:`\\Delta = -\\hat F^{-1} g` the preconditioned descent
direction and :math:`\\delta` the previous update:

1. **Quadratic model** (sec. 7): the update :math:`u = \\alpha\\Delta +
   \\mu\\delta` minimises :math:`q(u) = g^T u + \\tfrac12 u^T (F + \\lambda I) u`
   with the *exact* minibatch Fisher (GGN) :math:`F`, whose products
   :math:`(J u)^T F_R (J u)` come from ``jax.jvp``:

   .. math::
     \\begin{bmatrix}\\alpha\\\\ \\mu\\end{bmatrix} = -M^{-1} c,\\quad
     M_{ij} = u_i^T (F + \\lambda I) u_j,\\quad c = [g^T\\Delta, g^T\\delta].

   On the first step (:math:`\\delta = 0`) :math:`\\mu = 0` and
   :math:`\\alpha = -c_1 / M_{11}`.

2. **Levenberg–Marquardt damping** (sec. 6.5): every ``T`` steps,
   :math:`\\rho = (h(\\theta + u) - h(\\theta)) / q_0(u)` on the same batch
   (:math:`q_0` the model without the damping term, keeping ``l2_reg``);
   :math:`\\lambda \\leftarrow \\omega\\lambda` if :math:`\\rho > 3/4`,
   :math:`\\lambda \\leftarrow \\lambda/\\omega` if :math:`\\rho < 1/4`, with
   :math:`\\omega = \\text{decay}^T` and :math:`\\lambda \\ge` ``min_damping +
   l2_reg``.

Everything is traced (``lax.cond``): turning adaptation on adds no second
compiled program.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, cast

import jax
from jax import lax
import jax.numpy as jnp
import optax

from kfac_jax_lite import curvature as curvature_lib
from kfac_jax_lite import estimator as estimator_lib
from kfac_jax_lite import evaluation
from kfac_jax_lite import linalg
from kfac_jax_lite import linearization
from kfac_jax_lite import sharded
from kfac_jax_lite import transform
from kfac_jax_lite import trees
from kfac_jax_lite.collection import LayerCollection


class KFACOptimizerState(NamedTuple):
  """State of :func:`kfac_optimizer`: the curvature and the adapted scalars.

  Attributes:
    curvature: the :class:`~kfac_jax_lite.CurvatureState` (factors, cached
      inverses, counters, sampling key).
    velocity: params-like, the previous update δ (the momentum direction).
    damping: ``[]``, the λ used by this and the next step.
    learning_rate: ``[]``, the α of the last step.
    momentum: ``[]``, the μ of the last step.
    qmodel_change: ``[]``, the quadratic model's predicted change
      ``q₀(u)`` of the last step.
    rho: ``[]``, the reduction ratio ρ at the last damping adaptation.
    loss: ``[]``, the loss ``h(θ)`` on the last batch.
    new_loss: ``[]``, ``h(θ + u)`` at the last damping adaptation.
    num_skipped: ``[]`` int32, the steps skipped for non-finite inputs.

  Example:
    >>> updates, state = tx.update(None, state, params, batch=batch)
    >>> print(state.damping, state.learning_rate, state.rho, state.loss)
  """
  curvature: curvature_lib.CurvatureState
  velocity: Any                # params-like: the previous update δ
  damping: jnp.ndarray         # [] λ used by this and the next step
  learning_rate: jnp.ndarray   # [] α of the last step
  momentum: jnp.ndarray        # [] μ of the last step
  qmodel_change: jnp.ndarray   # [] q₀(u) of the last step
  rho: jnp.ndarray             # [] reduction ratio at the last adaptation
  loss: jnp.ndarray            # [] h(θ) on the last batch
  new_loss: jnp.ndarray        # [] h(θ + u) at the last adaptation
  num_skipped: jnp.ndarray     # [] int32, steps skipped (non-finite input)


def fisher_gram(lin, vectors, axis_name=None):
  """``[vᵢᵀ F vⱼ]`` with ``F`` the exact minibatch Fisher (GGN) of the loss.

  .. math:: v_i^T F v_j = \\sum_\\ell \\frac{w_\\ell}{N_\\ell} \\sum_n
     m_{\\ell,n} (J_n v_i)^T F_R(z_n) (J_n v_j)

  over the ``N_ℓ`` kept leading positions of each loss tag ``ℓ`` (its mask
  ``m``; :func:`~kfac_jax_lite.linearization.output_fisher_gram`). ``J_n v``
  comes from the JVP of one linearisation (no new forward pass), one JVP
  per vector.

  Args:
    lin: an :class:`~kfac_jax_lite.estimator.Linearized` of the batch.
    vectors: params-shaped vectors.
    axis_name: average over this data-parallel axis.

  Returns:
    The ``[k, k]`` Gram matrix.
  """
  # One JVP per vector, the (small) outputs stacked
  # (docs/performance.md#one-jvp-per-vector).
  jvs = jax.tree.map(lambda *x: jnp.stack(x),
                     *[lin.output_jvp(v) for v in vectors])
  gram = linearization.output_fisher_gram(lin, jvs)
  if axis_name is not None:
    gram = lax.pmean(gram, axis_name)
  return gram


def quadratic_model_step(m, gram, c, damping, *, adapt_learning_rate,
                         adapt_momentum, learning_rate, momentum):
  """Minimises the 2-D quadratic model over ``(α, μ)``.

  Args:
    m: ``[2, 2]`` Fisher Gram ``[uᵢᵀ F uⱼ]`` of ``(Δ, δ)``.
    gram: ``[2, 2]`` Euclidean Gram ``[uᵢᵀ uⱼ]``.
    c: ``[2]``, ``[gᵀΔ, gᵀδ]``.
    damping: λ.
    adapt_learning_rate, adapt_momentum: which coefficients to optimise;
      the others take the fixed ``learning_rate`` / ``momentum``.

  Returns:
    ``(alpha, mu)``. Non-finite solutions fall back to the fixed values.
  """
  a = m + damping * gram
  first = gram[1, 1] == 0          # no previous update yet: δ = 0
  safe = lambda x: jnp.where(x != 0, x, 1.0)  # noqa: E731
  if adapt_learning_rate and adapt_momentum:
    det = a[0, 0] * a[1, 1] - a[0, 1] * a[1, 0]
    alpha = -(a[1, 1] * c[0] - a[0, 1] * c[1]) / safe(det)
    mu = -(a[0, 0] * c[1] - a[1, 0] * c[0]) / safe(det)
    alpha = jnp.where(first, -c[0] / safe(a[0, 0]), alpha)
    mu = jnp.where(first, 0.0, mu)
  elif adapt_learning_rate:
    mu = jnp.asarray(momentum, a.dtype)
    alpha = -(mu * a[0, 1] + c[0]) / safe(a[0, 0])
  elif adapt_momentum:
    alpha = jnp.asarray(learning_rate, a.dtype)
    mu = jnp.where(first, 0.0, -(alpha * a[1, 0] + c[1]) / safe(a[1, 1]))
  else:
    alpha = jnp.asarray(learning_rate, a.dtype)
    mu = jnp.asarray(momentum, a.dtype)
  ok = jnp.isfinite(alpha) & jnp.isfinite(mu)
  alpha = jnp.where(ok, alpha, learning_rate)
  mu = jnp.where(ok, mu, momentum)
  return alpha, mu


def lm_damping_update(damping, rho, *, decay, min_damping):
  """Levenberg–Marquardt rule (Martens & Grosse 2015, sec. 6.5).

  ``ω = decay`` here is already ``decay^interval``. A non-finite ``ρ``
  counts as a bad step (damping grows).
  """
  bad = ~jnp.isfinite(rho) | (rho < 0.25)
  new = jnp.where(rho > 0.75, damping * decay, damping)
  new = jnp.where(bad, damping / decay, new)
  return jnp.maximum(new, min_damping)


def kfac_optimizer(collection: LayerCollection, *,
                   initial_damping: float = 1.0, adapt_damping: bool = True,
                   adapt_learning_rate: bool = True,
                   adapt_momentum: bool = True, learning_rate: float = 1.0,
                   momentum: float = 0.0,
                   damping_adaptation_decay: float = 0.95,
                   damping_adaptation_interval: int = 5,
                   min_damping: float = 1e-8, l2_reg: float = 0.0,
                   inverse_update_period: int = 10,
                   estimation_mode: Optional[str] = None,
                   axis_name: Any = None,
                   estimator: Optional[estimator_lib.FisherEstimator] = None,
                   mesh: Any = None, curvature_axis: Any = None,
                   param_shardings: Any = None,
                   ) -> optax.GradientTransformationExtraArgs:
  """The full K-FAC optimizer: adaptive damping, learning rate and momentum.

  Returns descent updates (like ``optax.adam``). See the module docstring
  for the math. ``update(grads, state, params, *, batch, stats=None)``
  needs the batch (the quadratic model and the damping rule evaluate the
  loss on it); statistics may come from ``value_grad_and_stats`` via
  ``stats=`` or are computed from the batch. The curvature is kept by
  :func:`~kfac_jax_lite.update_curvature` (``state.curvature``), run with
  the adapted damping and this batch's linearisation.

  ``grads=None`` is the fastest step: the optimizer then takes the
  gradient from the same single forward pass (one linearisation) that
  gives the statistics and the Fisher-vector products, instead of a
  separate ``jax.grad``; the loss is ``state.loss`` afterwards. Under an
  ``axis_name`` that gradient is averaged over the axis.

  The estimator built here has ``stats_fraction=0.25`` (1 elsewhere), with
  ``stats_min_examples=64``: the whole curvature side runs on the first
  ``m = max(⌈B/4⌉, 64)`` examples of the batch (all of them when ``B ≤
  64``): the factors' statistics, and the Fisher products ``M`` of the
  quadratic model, from a second forward pass over those examples only
  (:meth:`FisherEstimator.linearize_head`); the gradient, the loss and
  ``ρ`` stay the whole batch's. ``estimator=FisherEstimator(collection,
  stats_fraction=1.0)`` is the textbook algorithm (e.g. one exact step on
  a linear least squares problem). Why these defaults:
  docs/performance.md#kfac-optimizer-defaults.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    initial_damping: λ at step 0.
    adapt_damping: apply the Levenberg–Marquardt rule every
      ``damping_adaptation_interval`` steps (else λ stays fixed).
    adapt_learning_rate: choose α with the quadratic model; otherwise use
      the fixed ``learning_rate``.
    adapt_momentum: choose μ with the quadratic model; otherwise use the
      fixed ``momentum``.
    learning_rate: the fixed α (and the fallback).
    momentum: the fixed μ (and the fallback).
    damping_adaptation_decay: per-step decay; ω = decay^interval.
    damping_adaptation_interval: T, steps between damping updates.
    min_damping: floor of λ (plus ``l2_reg``).
    l2_reg: the L2 coefficient the loss already contains (its curvature
      enters the model's predicted change).
    inverse_update_period: refresh the damped inverses every this many
      steps (Martens & Grosse 2015 refresh them every ``T3 = 20``).
    estimation_mode: an option of the estimator built here, as for
      :func:`kfac_jax_lite.scale_by_kfac` (None: its default).
    axis_name: the ``pmap``/``shard_map`` axis of data parallelism, as for
      :func:`kfac_jax_lite.scale_by_kfac`.
    estimator: a :class:`~kfac_jax_lite.FisherEstimator` of ``collection``
      to use instead (then leave ``estimation_mode`` and ``axis_name``
      unset); its ``exps`` must contain -1.
    mesh: spread the curvature over this ``jax.sharding.Mesh``, with
      ``curvature_axis`` the axis name(s), as for
      :func:`kfac_jax_lite.scale_by_kfac`.
    curvature_axis: see ``mesh``.
    param_shardings: the parameters' shardings when they are sharded
      (FSDP), as for :func:`~kfac_jax_lite.scale_by_kfac`.

  Steps whose gradients, statistics, learning rate or momentum are not
  finite leave the parameters and the whole state untouched (the factors
  fold in only finite statistics) and are counted in ``state.num_skipped``.

  Data parallel (``axis_name=`` under ``pmap``/``shard_map``): the
  statistics, the loss ``h`` and the Fisher Gram ``M`` are averaged over the
  axis, so ``α``, ``μ``, ``ρ`` and ``λ`` are the same on every replica;
  average the gradients yourself (``lax.pmean(grads, axis_name)``) before
  ``update``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` of descent updates with
    state :class:`KFACOptimizerState`; its ``update`` needs ``batch=``
    (and ``params``), takes ``stats=`` optionally, and accepts
    ``grads=None``.

  Raises:
    ValueError: for a negative damping, ``l2_reg``, learning rate or
      momentum, a ``damping_adaptation_decay`` outside ``(0, 1)``, a period
      below 1, or an ``estimator`` whose ``exps`` lack -1; at ``update``,
      without ``batch=``.

  Example:
    >>> tx = kfac_optimizer(collection, initial_damping=1.0)
    >>> updates, state = tx.update(grads, state, params, batch=batch)
    >>> # or, one forward pass for everything:
    >>> updates, state = tx.update(None, state, params, batch=batch)
    >>> print(state.damping, state.learning_rate, state.momentum, state.rho)
  """
  for name, v in (("initial_damping", initial_damping),
                  ("min_damping", min_damping), ("l2_reg", l2_reg),
                  ("learning_rate", learning_rate), ("momentum", momentum)):
    if v is not None:
      transform.check_hyperparameter(name, v)
  if not 0.0 < damping_adaptation_decay < 1.0:
    raise ValueError(
        f"damping_adaptation_decay={damping_adaptation_decay!r} must be in "
        "(0, 1).")
  curvature_lib.check_period("damping_adaptation_interval",
                             damping_adaptation_interval)
  est = transform.make_estimator(
      collection, estimator, -1, estimation_mode=estimation_mode,
      axis_name=axis_name,
      stats_fraction=0.25 if estimator is None else None)
  axis_name = est.axis_name
  est = sharded.place(est, mesh, curvature_axis, param_shardings)

  def curvature(damping):
    return curvature_lib.update_curvature(
        est, damping=damping, inverse_update_period=inverse_update_period)

  omega = damping_adaptation_decay ** damping_adaptation_interval
  floor = min_damping + l2_reg
  dt = linalg.factor_dtype()
  fixed = curvature_lib.dynamic(learning_rate, momentum)

  def init_fn(params):
    z = lambda: jnp.zeros((), dt)  # noqa: E731  (distinct, donatable)
    return KFACOptimizerState(
        # update_curvature's state is a CurvatureState (optax types it
        # as any pytree).
        curvature=cast(curvature_lib.CurvatureState,
                       curvature(initial_damping).init(params)),
        velocity=jax.tree.map(jnp.zeros_like, params),
        damping=jnp.asarray(max(initial_damping, floor), dt),
        learning_rate=z(), momentum=z(), qmodel_change=z(), rho=z(),
        loss=z(), new_loss=z(), num_skipped=jnp.zeros((), jnp.int32))

  def update_fn(grads, state, params, *, batch, stats, lin):
    lam = state.damping
    count = state.curvature.count
    loss = lin.loss
    if axis_name is not None:
      loss = lax.pmean(loss, axis_name)
    # The curvature (statistics, Fisher products) of the first ⌈f·B⌉
    # examples: lin itself unless stats_fraction < 1.
    head = est.linearize_head(params, batch, lin)
    _, cstate = curvature(lam).update((grads, fixed), state.curvature,
                                      params, stats=stats, linearized=head)
    # update_curvature's state is a CurvatureState (optax types it as any
    # pytree).
    cstate = cast(curvature_lib.CurvatureState, cstate)
    finite = cstate.last_finite
    # P = F̂⁻¹ g, and Δ = -P enters through signs only: the Grams and c of
    # (Δ, δ) are those of (P, δ) with the cross terms and gᵀΔ negated, and
    # u = -α P + μ δ (no pass over the parameters to negate P).
    pos = est.multiply_inverse(cstate.estimator, grads)
    prev = state.velocity
    m = fisher_gram(head, [pos, prev], axis_name)
    # PᵀP, Pᵀδ, δᵀδ, gᵀP, gᵀδ: one vdot per chunk of leaves each.
    dd, dp, pp, gd, gp = trees.inner_products(
        (pos, prev, grads), ((0, 0), (0, 1), (1, 1), (2, 0), (2, 1)))
    gram = jnp.array([[dd, dp], [dp, pp]])
    c = jnp.array([gd, gp])
    flip = jnp.array([-1.0, 1.0], dt)
    m, gram = (x.astype(dt) * flip[:, None] * flip[None, :] for x in (m, gram))
    c = c.astype(dt) * flip
    alpha, mu = quadratic_model_step(
        m, gram, c, lam, adapt_learning_rate=adapt_learning_rate,
        adapt_momentum=adapt_momentum, learning_rate=learning_rate,
        momentum=momentum)
    coeffs = jnp.stack([alpha, mu])
    change = 0.5 * coeffs @ (m + l2_reg * gram) @ coeffs + c @ coeffs
    # The new velocity, already selected (a skipped step keeps δ); the
    # updates are read from it
    # (docs/performance.md#update-from-the-new-velocity).
    velocity = jax.tree.map(
        lambda d, p: jnp.where(finite, (-alpha * d + mu * p).astype(p.dtype),
                               p), pos, prev)
    updates = transform.zero_unless(finite, velocity)

    def adapt(new_params):
      new_loss = evaluation.loss_value(collection, new_params, batch,
                                       axis_name=axis_name, dtype=dt)
      rho = (new_loss - loss.astype(dt)) / change
      return lm_damping_update(lam, rho, decay=omega, min_damping=floor), (
          rho, new_loss)

    do_adapt = ((count + 1) % damping_adaptation_interval) == 0
    if adapt_damping:
      # θ + u outside the conditional, as the caller's apply_updates
      # writes it (docs/performance.md#damping-rule-reads-the-new-params).
      new_params = optax.apply_updates(params, updates)
      new_lam, (rho, new_loss) = lax.cond(
          do_adapt, adapt, lambda _: (lam, (state.rho, state.new_loss)),
          new_params)
    else:
      new_lam, rho, new_loss = lam, state.rho, state.new_loss
    new_state = KFACOptimizerState(
        curvature=cstate, velocity=velocity, damping=new_lam,
        learning_rate=alpha, momentum=mu, qmodel_change=change, rho=rho,
        loss=loss.astype(dt), new_loss=new_loss,
        num_skipped=state.num_skipped + (~finite).astype(jnp.int32))
    # A skipped step selects the old scalars; the curvature state and the
    # velocity already kept themselves.
    rest = transform.select_tree(
        finite, new_state._replace(curvature=(), velocity=(), num_skipped=()),
        state._replace(curvature=(), velocity=(), num_skipped=()))
    return updates, rest._replace(curvature=cstate, velocity=velocity,
                                  num_skipped=new_state.num_skipped)

  def guarded_update_fn(updates, state, params=None, *, batch=None,
                        stats=None, **extra_args):
    del extra_args
    grads = updates  # optax's name for the first argument; None is allowed
    transform.check_state(state, KFACOptimizerState._fields,
                          "kfac_optimizer")
    if params is None or batch is None:
      raise ValueError(
          "kfac_optimizer.update needs params=... and batch=... (the "
          "quadratic model and the damping rule evaluate the loss on the "
          "batch); statistics may still come from stats=....")
    # One forward pass: statistics (transpose), loss and J u (JVP), and
    # with grads=None the gradient too. Its JVP is built only when it is
    # also the curvature's (docs/performance.md#one-forward-pass).
    lin = est.linearize(params, batch, with_jvp=est.stats_fraction >= 1.0)
    if grads is None:
      grads = lin.gradient()
      if axis_name is not None:
        grads = lax.pmean(grads, axis_name)
    return update_fn(grads, state, params, batch=batch, stats=stats,
                     lin=lin)

  return optax.GradientTransformationExtraArgs(init_fn, guarded_update_fn)
