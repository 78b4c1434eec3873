"""Damped matrix functions for curvature factors.

Factors are symmetric PSD matrices estimated from data. Everything here works
in :func:`factor_dtype` (float32, or float64 when ``jax_enable_x64`` is on),
symmetrises its input and clips eigenvalues at zero.

Matmul precision: the matrix functions that form a damped inverse or power
(:func:`damped_power`, :func:`damped_powers`) multiply at
:data:`REFRESH_PRECISION` (``HIGHEST``: true float32) on every platform.
A GPU multiplies float32 at TF32 by default (inputs rounded to 10
mantissa bits, relative error about ``5e-4``), which a factor damped by
``1e-6`` cannot afford: its condition number, up to about ``1e6``,
magnifies that error in ``L⁻ᵀ L⁻¹``. The products that
apply a cached inverse to a gradient (:func:`matmul_left`, :func:`rotate`,
...) follow JAX's default precision, as the user's model does
(docs/performance.md#matmul-precision).

References:
  Martens & Grosse (2015), "Optimizing neural networks with Kronecker-factored
  approximate curvature", sec. 6.3 (factored Tikhonov damping, eq. 13-14:
  the pi-adjustment).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax_lite import _xla_cpu

# The precision of the refresh's matmuls (module docstring).
REFRESH_PRECISION = jax.lax.Precision.HIGHEST


def _mm(a, b):
  """``a @ b`` at :data:`REFRESH_PRECISION`."""
  return jnp.matmul(a, b, precision=REFRESH_PRECISION)


@_xla_cpu.sequential_under_vmap
def cholesky(m):
  """Lower Cholesky factor of a symmetric ``m``; under ``vmap`` one matrix
  at a time on the CPU, one batched call elsewhere
  (:func:`~kfac_jax_lite._xla_cpu.sequential_under_vmap`).

  ``m`` must be exactly symmetric (callers pass ``symmetrize(x) + d I``):
  LAPACK reads one triangle, so ``jnp.linalg.cholesky``'s own
  symmetrisation would be a second pass over ``m``; and LAPACK wants a
  column-major operand, which ``m.T`` of a row-major ``m`` already is,
  where ``m`` itself would be copied into that layout first.
  """
  return jax.lax.linalg.cholesky(m.T, symmetrize_input=False)


@_xla_cpu.sequential_under_vmap
def lower_triangular_solve(chol, b):
  """``L⁻¹ b`` for a lower-triangular ``L`` (``vmap`` as :func:`cholesky`)."""
  return jax.scipy.linalg.solve_triangular(chol, b, lower=True)


@_xla_cpu.sequential_under_vmap
def cholesky_inverse(m):
  """``L⁻¹`` for the lower Cholesky factor ``L`` of a symmetric ``m``.

  :func:`cholesky` and :func:`lower_triangular_solve` in one function,
  so that under ``vmap`` (a group of same-shaped factors) both run in one
  ``lax.map`` on the CPU: one loop instead of two
  (docs/performance.md#lapack-under-vmap).
  """
  return lower_triangular_solve(cholesky(m),
                                jnp.eye(m.shape[0], dtype=m.dtype))


@_xla_cpu.sequential_under_vmap
def eigh(m):
  """``jnp.linalg.eigh`` (``vmap`` as :func:`cholesky`)."""
  return jnp.linalg.eigh(m)


@_xla_cpu.sequential_under_vmap
def qr_q(m):
  """``Q`` of the reduced QR decomposition of ``m`` (``vmap`` as
  :func:`cholesky`)."""
  return jnp.linalg.qr(m)[0]


def power_basis_step(f, q):
  """One step of orthogonal iteration towards the eigenbasis of ``f``.

  The columns of the orthonormal ``q`` are first sorted by their Rayleigh
  quotients :math:`r_i = q_i^T f q_i`, largest first, then
  :math:`q' = \\mathrm{qr}(f q)`: the leading ``k`` columns of ``q'`` span
  ``f``'s ``k``-dimensional power-iteration subspace (Golub & Van Loan,
  "Matrix Computations", sec. 8.2.4; SOAP's basis update, Vyas et al.
  2024, Algorithm 4). From an eigenbasis of ``f`` it returns that basis,
  up to the columns' signs, in descending order.

  Args:
    f: a symmetric PSD ``[d, d]`` factor.
    q: its previous basis, ``[d, d]`` orthonormal.

  Returns:
    ``(q', order, r)``: the new basis, the permutation ``order`` (column
    ``i`` of ``q'`` continues column ``order[i]`` of ``q``) and the sorted
    quotients, clipped at 0 (eigenvalue estimates).
  """
  fq = _mm(symmetrize(f.astype(factor_dtype())), q)
  quotients = jnp.sum(q * fq, axis=0)
  order = jnp.argsort(-quotients)
  return qr_q(fq[:, order]), order, jnp.maximum(quotients[order], 0.0)


@_xla_cpu.sequential_under_vmap
def solve(a, b):
  """``jnp.linalg.solve`` (LU) (``vmap`` as :func:`cholesky`)."""
  return jnp.linalg.solve(a, b)


def factor_dtype():
  """float64 when x64 is enabled, else float32 (whatever the params' dtype)."""
  # The flag is set dynamically on jax.config, which has no type for it.
  x64 = jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]
  return jnp.float64 if x64 else jnp.float32


def symmetrize(m):
  return 0.5 * (m + m.T)


def safe_eigh(m):
  """Eigendecomposition of a symmetric PSD matrix, eigenvalues clipped at 0.

  Returns:
    ``(s, u)`` with ``m ≈ u diag(s) uᵀ`` and ``s >= 0``.
  """
  s, u = eigh(symmetrize(m.astype(factor_dtype())))
  return jnp.maximum(s, 0.0), u


def trace_norm(m):
  """``tr(m) / dim``; ``m`` is a matrix, or a vector holding a diagonal."""
  if m.ndim == 1:
    return jnp.mean(m)
  return jnp.trace(m) / m.shape[0]


def pi_adjusted_damping(a, g, damping):
  """Splits Tikhonov damping between two Kronecker factors.

  .. math::
    \\pi = \\sqrt{\\frac{\\mathrm{tr}(A)/\\dim A}{\\mathrm{tr}(G)/\\dim G}},
    \\qquad (A + \\pi\\sqrt{\\lambda} I) \\otimes
    (G + \\tfrac{\\sqrt{\\lambda}}{\\pi} I)

  (Martens & Grosse 2015, sec. 6.3). ``pi`` is 1 when either trace is 0.

  Args:
    a: input factor (matrix, or vector for a diagonal factor).
    g: output factor (matrix or vector).
    damping: the (already normalised) damping :math:`\\lambda'`.

  Returns:
    ``(damping_a, damping_g)``.
  """
  return pi_split(trace_norm(a), trace_norm(g), damping)


def pi_split(ta, tg, damping):
  """:func:`pi_adjusted_damping` from the normalised traces ``tr/dim``."""
  ok = (ta > 0) & (tg > 0)
  pi = jnp.where(ok, jnp.sqrt(jnp.where(ok, ta / jnp.where(ok, tg, 1.0),
                                        1.0)), 1.0)
  root = jnp.sqrt(damping)
  return pi * root, root / pi


def damped_power(m, damping, exp):
  """``(m + damping I)^exp`` for a symmetric PSD ``m`` (matrix or diagonal).

  ``exp == -1`` on a matrix uses a Cholesky factorisation; other exponents
  an eigendecomposition with clipped eigenvalues. The products run at
  :data:`REFRESH_PRECISION`.
  """
  m = m.astype(factor_dtype())
  if m.ndim == 1:
    return jnp.power(jnp.maximum(m, 0.0) + damping, exp)
  eye = jnp.eye(m.shape[0], dtype=m.dtype)
  if exp == -1:
    # (L Lᵀ)⁻¹ = L⁻ᵀ L⁻¹: one triangular solve and one matmul
    # (docs/performance.md#inverse-from-cholesky).
    chol_inv = cholesky_inverse(symmetrize(m) + damping * eye)
    return _mm(chol_inv.T, chol_inv)
  s, u = safe_eigh(m)
  return _mm(u * jnp.power(s + damping, exp)[None, :], u.T)


def damped_powers(m, damping, exps) -> dict:
  """``{e: (m + damping I)^e}`` for every ``e`` in ``exps``.

  A lone inverse of a matrix uses a Cholesky solve; several powers (or any
  other power) share one eigendecomposition, as TF K-FAC's
  ``DenseSquareMatrixFactor.make_inverse_update_ops``. The products run
  at :data:`REFRESH_PRECISION`.
  """
  exps = tuple(float(e) for e in exps)
  if m.ndim == 1 or exps in ((), (-1.0,)):
    return {e: damped_power(m, damping, e) for e in exps}
  s, u = safe_eigh(m)
  return {e: _mm(u * jnp.power(s + damping, e)[None, :], u.T) for e in exps}


def damped_cholesky(m, damping):
  """Lower Cholesky factor of ``m + damping I`` (diagonal: elementwise sqrt)."""
  m = m.astype(factor_dtype())
  if m.ndim == 1:
    return jnp.sqrt(jnp.maximum(m, 0.0) + damping)
  eye = jnp.eye(m.shape[0], dtype=m.dtype)
  return cholesky(symmetrize(m) + damping * eye)


def lower_triangular_inverse(chol):
  """``L⁻¹`` for a lower-triangular ``L`` (diagonal: reciprocal)."""
  if chol.ndim == 1:
    return 1.0 / chol
  eye = jnp.eye(chol.shape[0], dtype=chol.dtype)
  return lower_triangular_solve(chol, eye)


def damped_factor_cache(m, damping, exps, compute_cholesky=False,
                        compute_cholesky_inverse=False) -> dict:
  """Everything a factor's refresh caches, keyed by suffix.

  ``{"^e": (m + d I)^e for e in exps}`` (:func:`damped_powers`), plus
  ``"_chol"``: the lower Cholesky factor ``L`` of ``m + d I`` and
  ``"_chol_inv"``: ``L⁻¹`` when asked for. ``m`` is a matrix or a vector
  holding a diagonal.
  """
  out = {f"^{e:g}": p for e, p in damped_powers(m, damping, exps).items()}
  if compute_cholesky or compute_cholesky_inverse:
    chol = damped_cholesky(m, damping)
    if compute_cholesky:
      out["_chol"] = chol
    if compute_cholesky_inverse:
      out["_chol_inv"] = lower_triangular_inverse(chol)
  return out


def matmul_left(m, v):
  """``m @ v`` where ``m`` is a matrix or a vector holding a diagonal."""
  return m[:, None] * v if m.ndim == 1 else m @ v


def matmul_right(v, m):
  """``v @ m`` where ``m`` is a matrix or a vector holding a diagonal."""
  return v * m[None, :] if m.ndim == 1 else v @ m


def as_matrix(m):
  """A diagonal stored as a vector becomes a matrix; matrices pass."""
  return jnp.diag(m) if m.ndim == 1 else m


def rotate(v, ua, ug, into: bool):
  """``Uaᵀ V Ug`` (``into`` the eigenbasis) or ``Ua V Ugᵀ``; a ``None``
  basis is the identity."""
  if ua is not None:
    v = (ua.T @ v) if into else (ua @ v)
  if ug is not None:
    v = (v @ ug) if into else (v @ ug.T)
  return v


def eigenbasis_cholesky(m, spectrum, ua, ug, transpose: bool, inverse: bool):
  """``C v`` for ``C = (Ua ⊗ Ug) diag(r)``, ``r = √spectrum``, on the matrix
  form ``m`` of ``v``: ``C v = U (r ⊙ V)``, ``Cᵀ v = r ⊙ (Uᵀ V)``,
  ``C⁻¹ v = r⁻¹ ⊙ (Uᵀ V)``, ``C⁻ᵀ v = U (r⁻¹ ⊙ V)``."""
  r = jnp.sqrt(spectrum)
  r = 1.0 / r if inverse else r
  if transpose != inverse:
    return r * rotate(m, ua, ug, True)
  return rotate(r * m, ua, ug, False)
