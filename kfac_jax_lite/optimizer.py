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

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from kfac_jax_lite import linalg
from kfac_jax_lite import transform
from kfac_jax_lite.collection import LayerCollection


class KFACOptimizerState(NamedTuple):
  curvature: transform.CurvatureState
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

  .. math:: v_i^T F v_j = \\sum_\\ell \\frac{w_\\ell}{B} \\sum_b
     (J_b v_i)^T F_R(z_b) (J_b v_j)

  ``J_b v`` comes from the JVP of one linearisation (no new forward pass),
  one JVP per vector.

  Args:
    lin: an :class:`~kfac_jax_lite.estimator.Linearized` of the batch.
    vectors: params-shaped vectors.
    axis_name: average over this data-parallel axis.

  Returns:
    The ``[k, k]`` Gram matrix.
  """
  # One JVP per vector, the (small) outputs stacked: a vmap over stacked
  # vectors first copied every parameter leaf of every vector.
  jvs = jax.tree.map(lambda *x: jnp.stack(x),
                     *[lin.output_jvp(v) for v in vectors])
  gram = 0.0
  for spec, z, jv in zip(lin.collection.losses, lin.zs, jvs):
    fjv = jax.vmap(lambda v, z=z, spec=spec: spec.multiply_fisher(z, v))(jv)
    jv = jv.astype(fjv.dtype)
    gram = gram + spec.weight / z.shape[0] * jnp.einsum(
        "i...,j...->ij", jv, fjv)
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
                   **curvature_kwargs: Any
                   ) -> optax.GradientTransformationExtraArgs:
  """The full K-FAC optimizer: adaptive damping, learning rate and momentum.

  Returns descent updates (like ``optax.adam``). See the module docstring
  for the math. ``update(grads, state, params, *, batch, stats=None)``
  needs the batch (the quadratic model and the damping rule evaluate the
  loss on it); statistics may come from ``value_grad_and_stats`` via
  ``stats=`` or are computed from the batch.

  ``grads=None`` is the fastest step: the optimizer then takes the
  gradient from the same single forward pass (one linearisation) that
  gives the statistics and the Fisher-vector products, instead of a
  separate ``jax.grad``; the loss is ``state.loss`` afterwards. Under an
  ``axis_name`` that gradient is averaged over the axis.

  Args:
    collection: from :func:`kfac_jax_lite.scan`.
    initial_damping: λ at step 0.
    adapt_damping: apply the Levenberg–Marquardt rule every
      ``damping_adaptation_interval`` steps (else λ stays fixed).
    adapt_learning_rate, adapt_momentum: choose α / μ with the quadratic
      model; otherwise use the fixed ``learning_rate`` / ``momentum``.
    learning_rate, momentum: the fixed values (and fallbacks).
    damping_adaptation_decay: per-step decay; ω = decay^interval.
    damping_adaptation_interval: T, steps between damping updates.
    min_damping: floor of λ (plus ``l2_reg``).
    l2_reg: the L2 coefficient the loss already contains (its curvature
      enters the model's predicted change).
    **curvature_kwargs: ``cov_ema_decay``, ``cov_update_period``,
      ``inverse_update_period``, ``estimation_mode``, ``axis_name``,
      ``seed``, ``stagger_inverse_updates`` and estimator options, as for
      :func:`kfac_jax_lite.scale_by_kfac`. ``stats_fraction`` defaults to
      ``0.25`` here (1 elsewhere), with ``stats_min_examples=64``: the
      whole curvature side runs on the first ``m = max(⌈B/4⌉, 64)``
      examples of the batch (all of them when ``B ≤ 64``): the factors'
      statistics, and the Fisher products ``M`` of the quadratic model,
      from a second forward pass over those examples only
      (:meth:`FisherEstimator.linearize_head`); the gradient, the loss and
      ``ρ`` stay the whole batch's. On the 784-1000-...-784 autoencoder at
      batch 500 this cuts the XLA flop count of a step without refresh
      from 35 to 22 GFLOP, and the steps needed to reach Adam's losses
      grew by 2-6% (``benchmarks/time_to_loss.py``). ``stats_fraction=1.0``
      is the textbook algorithm (e.g. one exact step on a linear least
      squares problem). ``inverse_update_period`` defaults to ``10`` here
      (5 in ``kfac``/``scale_by_kfac``; Martens & Grosse 2015 refresh the
      inverses every ``T3 = 20`` steps): on that autoencoder it reached
      Adam's 2000-step loss in 0.48x Adam's time against 0.53x with 5, and
      its 600-step loss in the same time (``time_to_loss.py
      --inverse-periods 10,20``; 20 was slower to the 600-step loss).

  Steps with non-finite gradients or statistics leave the parameters and
  the whole state untouched and are counted in ``state.num_skipped``.

  Data parallel (``axis_name=`` under ``pmap``/``shard_map``): the
  statistics, the loss ``h`` and the Fisher Gram ``M`` are averaged over the
  axis, so ``α``, ``μ``, ``ρ`` and ``λ`` are the same on every replica;
  average the gradients yourself (``lax.pmean(grads, axis_name)``) before
  ``update``.

  Example:
    >>> tx = kfac_optimizer(collection, initial_damping=1.0)
    >>> updates, state = tx.update(grads, state, params, batch=batch)
    >>> # or, one forward pass for everything:
    >>> updates, state = tx.update(None, state, params, batch=batch)
    >>> print(state.damping, state.learning_rate, state.momentum, state.rho)
  """
  for name, v in (("initial_damping", initial_damping),
                  ("min_damping", min_damping), ("l2_reg", l2_reg)):
    transform.check_nonnegative(name, v)
  if not 0.0 < damping_adaptation_decay < 1.0:
    raise ValueError(
        f"damping_adaptation_decay={damping_adaptation_decay!r} must be in "
        "(0, 1).")
  transform.check_period("damping_adaptation_interval",
                         damping_adaptation_interval)
  kw = dict(cov_ema_decay=0.95, cov_update_period=1,
            inverse_update_period=10, estimation_mode="gradients",
            axis_name=None, seed=0, stats_fraction=0.25)
  curvature_kwargs = transform.unnest_kwargs(curvature_kwargs,
                                             "curvature_kwargs")
  stagger = curvature_kwargs.pop("stagger_inverse_updates", False)
  kw.update(curvature_kwargs)
  axis_name = kw["axis_name"]
  curvature = transform.make_curvature(collection, power=-1, stagger=stagger,
                                       **kw)
  est = curvature.estimator
  omega = damping_adaptation_decay ** damping_adaptation_interval
  floor = min_damping + l2_reg
  dt = linalg.factor_dtype()

  def init_fn(params):
    z = lambda: jnp.zeros((), dt)  # noqa: E731  (distinct, donatable)
    return KFACOptimizerState(
        curvature=curvature.init(params),
        velocity=jax.tree.map(jnp.zeros_like, params),
        damping=jnp.asarray(max(initial_damping, floor), dt),
        learning_rate=z(), momentum=z(), qmodel_change=z(), rho=z(),
        loss=z(), new_loss=z(), num_skipped=jnp.zeros((), jnp.int32))

  def update_fn(grads, state, params, *, batch, stats, finite, lin):
    lam = state.damping
    count = state.curvature.count
    loss = lin.loss
    if axis_name is not None:
      loss = lax.pmean(loss, axis_name)
    # The curvature (statistics, Fisher products) of the first ⌈f·B⌉
    # examples: lin itself unless stats_fraction < 1.
    head = est.linearize_head(params, batch, lin)
    cstate = curvature.step(state.curvature, params, None, stats, lam,
                            linearized=head, gate=finite)
    # P = F̂⁻¹ g, and Δ = -P enters through signs only: the Grams and c of
    # (Δ, δ) are those of (P, δ) with the cross terms and gᵀΔ negated, and
    # u = -α P + μ δ (no pass over the parameters to negate P).
    pos = est.multiply_inverse(cstate.estimator, grads)
    prev = state.velocity
    m = fisher_gram(head, [pos, prev], axis_name)
    # PᵀP, Pᵀδ, δᵀδ, gᵀP, gᵀδ: one vdot per chunk of leaves each.
    dd, dp, pp, gd, gp = linalg.inner_products(
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
    # The new velocity, already selected: a skipped step keeps δ. The
    # returned updates are it, zeroed unless finite, so the caller's
    # apply_updates reads this buffer and not δ, which it overwrites in
    # place (else XLA copies δ first; see transform.kfac).
    velocity = jax.tree.map(
        lambda d, p: jnp.where(finite, (-alpha * d + mu * p).astype(p.dtype),
                               p), pos, prev)
    updates = transform.zero_unless(finite, velocity)

    def adapt(new_params):
      out = collection.loss_fn(new_params, batch)
      new_loss = (out[0] if collection.has_aux else out).astype(dt)
      if axis_name is not None:
        new_loss = lax.pmean(new_loss, axis_name)
      rho = (new_loss - loss.astype(dt)) / change
      return lm_damping_update(lam, rho, decay=omega, min_damping=floor), (
          rho, new_loss)

    do_adapt = ((count + 1) % damping_adaptation_interval) == 0
    if adapt_damping:
      # θ + u outside the conditional, as the caller's apply_updates
      # writes it (from the returned updates): XLA computes the two
      # identical sums once, and the damping rule's forward pass reads
      # the new parameters instead of adding every W + U inside its
      # branch (on the autoencoder of benchmarks/step_time.py: 220
      # compiled kernels instead of 236, at the same step time). A caller
      # that applies other updates (a later transform in a chain) pays
      # one extra sum per step.
      new_params = optax.apply_updates(params, updates)
      new_lam, (rho, new_loss) = lax.cond(
          do_adapt, adapt, lambda _: (lam, (state.rho, state.new_loss)),
          new_params)
    else:
      new_lam, rho, new_loss = lam, state.rho, state.new_loss
    return updates, KFACOptimizerState(
        curvature=cstate, velocity=velocity, damping=new_lam,
        learning_rate=alpha, momentum=mu, qmodel_change=change, rho=rho,
        loss=loss.astype(dt), new_loss=new_loss,
        num_skipped=state.num_skipped)

  def guarded_update_fn(grads, state, params=None, *, batch=None, stats=None,
                        **extra_args):
    del extra_args
    if params is None or batch is None:
      raise ValueError(
          "kfac_optimizer.update needs params=... and batch=... (the "
          "quadratic model and the damping rule evaluate the loss on the "
          "batch); statistics may still come from stats=....")
    # One forward pass: statistics (transpose), loss and J u (JVP), and
    # with grads=None the gradient too.
    # The whole batch's linearisation needs its JVP only when it is also
    # the curvature's: linearize_head returns it when stats_fraction is 1,
    # and also when the batch has no more than stats_min_examples rows;
    # then its JVP comes from transposing its pullback (Linearized.jvp),
    # the same products at one more trace pass.
    lin = est.linearize(params, batch, with_jvp=est.stats_fraction >= 1.0)
    if grads is None:
      grads = lin.gradient()
      if axis_name is not None:
        grads = lax.pmean(grads, axis_name)
    finite = transform.inputs_finite(grads, stats, axis_name)
    # Everything runs; a skipped step selects the old values. The curvature
    # state guards itself (gate=): no select or conditional copies it.
    updates, new_state = update_fn(grads, state, params, batch=batch,
                                   stats=stats, finite=finite, lin=lin)
    rest = transform.select_tree(
        finite, new_state._replace(curvature=(), velocity=()),
        state._replace(curvature=(), velocity=()))
    return updates, rest._replace(
        curvature=new_state.curvature, velocity=new_state.velocity,
        num_skipped=state.num_skipped + (~finite).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init_fn, guarded_update_fn)


