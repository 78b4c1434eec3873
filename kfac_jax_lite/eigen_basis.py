"""How :func:`~kfac_jax_lite.scale_by_kfac_eigen_adam` moves its
Kronecker eigenbases at a refresh after the first.

With ``basis_update="qr"`` it does as SOAP (Vyas et al. 2024, "SOAP:
Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321,
Algorithm 4): instead of eigendecomposing its factors again at each
refresh, it takes one step of orthogonal (subspace) iteration from the
basis it has. For a factor ``F`` and the basis ``Q``
(orthonormal columns),

.. math::
  r_i = q_i^T F q_i,\\quad \\pi = \\mathrm{argsort}(-r),\\quad
  Q' = \\mathrm{qr}(F\\,Q_{:,\\pi})_Q,

:func:`kfac_jax_lite.linalg.power_basis_step`: one ``d × d`` product and
one QR, a few ``d³`` flops, against an ``eigh``'s iterations
(docs/kfac_soap.md measures both). The first refresh (step 0) is the
estimator's ``eigh``; Adam's second moments follow the sort:
``V ← V_{π_A, π_G}``.

The default, ``basis_update="eigh"``, eigendecomposes the factors again
at every refresh.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from kfac_jax_lite import _blas_threads
from kfac_jax_lite import linalg


# An inverse_update_period whose multiples an int32 count reaches at 0 only.
ONCE = 2 ** 31 - 1


def check_basis_update(value):
  if value not in ("qr", "eigh"):
    raise ValueError(
        f"basis_update={value!r} must be 'qr' (one orthogonal-iteration "
        "step per refresh, as SOAP) or 'eigh' (a new eigendecomposition).")


def _power_bases(est, groups, stacked) -> dict:
  """Group name -> ``{side: (Q', order, r)}``: one step of
  :func:`~kfac_jax_lite.linalg.power_basis_step` per rotated factor."""
  out = {}
  for j, name in groups:
    s, many = stacked[name], len(est.groups[j]) > 1
    step = jax.vmap(linalg.power_basis_step) if many else (
        linalg.power_basis_step)
    out[name] = {side: step(getattr(s, side), s.cache[f"{side}_eigvec"])
                 for side in ("a", "g") if f"{side}_eigvec" in s.cache}
  return out


def _kept_bases(groups, stacked) -> dict:
  """:func:`_power_bases`' structure for the bases left as they are."""
  out = {}
  for _, name in groups:
    c, out[name] = stacked[name].cache, {}
    for side in ("a", "g"):
      if f"{side}_eigvec" in c:
        q = c[f"{side}_eigvec"]
        order = jnp.broadcast_to(jnp.arange(q.shape[-1]), q.shape[:-1])
        out[name][side] = (q, order, c[f"{side}_eigval"])
  return out


def _with_bases(est_state, bases):
  """``(est_state, orders)``: ``bases`` written into the caches, and group
  name -> ``(order_A, order_G)``."""
  stacked, orders = dict(est_state.stacked), {}
  for name, sides in bases.items():
    cache = dict(stacked[name].cache)
    for side, (q, _, r) in sides.items():
      cache[f"{side}_eigvec"], cache[f"{side}_eigval"] = q, r
    stacked[name] = stacked[name]._replace(cache=cache)
    orders[name] = tuple(sides[k][1] if k in sides else None
                         for k in ("a", "g"))
  return est_state._replace(stacked=stacked), orders


@_blas_threads.limited  # One LAPACK thread: docs/performance.md.
def power_update(est, groups, count, cstate, period):
  """Moves the rotated bases one orthogonal-iteration step at each applied
  step ``count`` that is a positive multiple of ``period`` (the first
  refresh, at step 0, is the estimator's ``eigh``).

  With ``stats_sync="before_refresh"`` the factors are first averaged over
  the estimator's axis, as its own refresh does, so every replica moves
  the same bases.

  Returns:
    ``(cstate, moved, orders)``: the new curvature state, whether the
    bases moved, and group name -> ``(order_A, order_G)``.
  """
  due = cstate.last_finite & (count > 0) & (count % period == 0)

  def move(s):
    if est.stats_sync == "before_refresh":
      s = est.sync_factors(s)
    return _with_bases(s, _power_bases(est, groups, s.stacked))

  with jax.named_scope("kfac_refresh"):
    est_state, orders = lax.cond(
        due, move, lambda s: _with_bases(s, _kept_bases(groups, s.stacked)),
        cstate.estimator)
  return cstate._replace(
      estimator=est_state, num_inverse_updates=(
          cstate.num_inverse_updates + due.astype(jnp.int32))), due, orders
