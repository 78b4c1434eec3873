"""The three predictive distributions: NLL, sampling, Fisher and GGN factors.

Every distribution is parameterised by ``z`` of shape ``[B, *inner]``: axis 0
is the batch, and example ``b``'s negative log-likelihood sums over the
inner positions. With :math:`F_R(z_b)` the Fisher of the distribution with
respect to its parameters, a *factor* :math:`B_b` satisfies
:math:`F_R = B_b B_b^T` (TF K-FAC ``multiply_fisher_factor``). All three
use natural parameters, so their GGN equals their Fisher (Martens 2014,
"New insights and perspectives on the natural gradient method", sec. 9.2).

Categorical (over the last axis): :math:`F_R = \\mathrm{diag}(p) - pp^T`,
:math:`B = \\mathrm{diag}(q) - p q^T` with :math:`q = \\sqrt p`.
Normal (fixed ``var``): :math:`F_R = I/\\mathrm{var}`,
:math:`B = \\mathrm{var}^{-1/2} I`.
Multi-Bernoulli: :math:`F_R = \\mathrm{diag}(p(1-p))`,
:math:`B = \\mathrm{diag}(\\sqrt{p(1-p)})`.
"""

from __future__ import annotations

import dataclasses
import math


import jax
import jax.numpy as jnp

from kfac_jax_lite import keys


def _up(x):
  """At least float32 (bf16/f16 logits are promoted; float64 stays)."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered loss tag (static description).

  Attributes:
    kind: ``categorical``, ``normal`` or ``multi_bernoulli``.
    weight: multiplies this loss's Fisher contribution (TF's ``coeff``).
    var: the Normal's variance (``normal`` only).
    has_targets: whether targets were passed at the tag.
    shape: the shape of ``z`` at scan time.
  """
  kind: str
  weight: float = 1.0
  var: float = 0.5
  has_targets: bool = False
  shape: tuple = ()

  # ---- per-example log-likelihood -------------------------------------
  def nll(self, z, y):
    """Per-example negative log-likelihood ``[B]`` (sums inner positions)."""
    z = _up(z)
    if self.kind == "categorical":
      logp = jax.nn.log_softmax(z, axis=-1)
      y = y.astype(jnp.int32)
      val = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    elif self.kind == "normal":
      val = (0.5 / self.var) * jnp.square(y.astype(z.dtype) - z)
      val = val + 0.5 * math.log(2 * math.pi * self.var)
    elif self.kind == "multi_bernoulli":
      y = y.astype(z.dtype)
      val = jnp.logaddexp(0.0, z) - y * z
    else:
      raise ValueError(f"Unknown loss kind {self.kind!r}.")
    return val.reshape(val.shape[0], -1).sum(axis=1)

  def nll_grad(self, z, y):
    """:math:`\\partial\\, \\mathrm{nll}_b / \\partial z_b`, per example."""
    z32 = _up(z)
    if self.kind == "categorical":
      p = jax.nn.softmax(z32, axis=-1)
      return p - jax.nn.one_hot(y, z.shape[-1], dtype=z32.dtype)
    if self.kind == "normal":
      return (z32 - y.astype(z32.dtype)) / self.var
    if self.kind == "multi_bernoulli":
      return jax.nn.sigmoid(z32) - y.astype(z32.dtype)
    raise ValueError(f"Unknown loss kind {self.kind!r}.")

  def sample(self, key, z):
    """Draws targets ``y ~ p(y | z)`` (same layout as data targets).

    ``key``: a key of :mod:`kfac_jax_lite.keys` (``uint32`` words, or any
    jax.random key); the uniforms come from :func:`keys.uniform`.
    Categorical by the Gumbel-max trick, ``argmax(z - log(-log u))``;
    Normal by the inverse CDF, ``z + sqrt(var) Φ⁻¹(u)``; Bernoulli as
    ``u < sigmoid(z)``.
    """
    z32 = jax.lax.stop_gradient(_up(z))
    u = keys.uniform(key, z.shape, z32.dtype)
    if self.kind == "categorical":
      return jnp.argmax(z32 - jnp.log(-jnp.log(u)), axis=-1)
    if self.kind == "normal":
      return z32 + math.sqrt(self.var) * jax.scipy.special.ndtri(u)
    if self.kind == "multi_bernoulli":
      return (u < jax.nn.sigmoid(z32)).astype(z32.dtype)
    raise ValueError(f"Unknown loss kind {self.kind!r}.")

  # ---- Fisher factor products (per example, per position) --------------
  def fisher_factor(self, z, v):
    """:math:`B v` with ``v`` of z's shape; :math:`F_R = B B^T`."""
    z = _up(z)
    if self.kind == "categorical":
      p = jax.nn.softmax(z, axis=-1)
      q = jnp.sqrt(p)
      return q * v - p * jnp.sum(q * v, axis=-1, keepdims=True)
    if self.kind == "normal":
      return v / math.sqrt(self.var)
    if self.kind == "multi_bernoulli":
      p = jax.nn.sigmoid(z)
      return jnp.sqrt(p * (1 - p)) * v
    raise ValueError(f"Unknown loss kind {self.kind!r}.")

  def fisher_factor_transpose(self, z, u):
    """:math:`B^T u`."""
    z = _up(z)
    if self.kind == "categorical":
      p = jax.nn.softmax(z, axis=-1)
      q = jnp.sqrt(p)
      return q * u - q * jnp.sum(p * u, axis=-1, keepdims=True)
    return self.fisher_factor(z, u)

  def multiply_fisher(self, z, v):
    """:math:`F_R v` per example (exact, no sampling)."""
    return self.fisher_factor(z, self.fisher_factor_transpose(z, v))

  # Natural parameters: GGN == Fisher for all three distributions.
  ggn_factor = fisher_factor
  ggn_factor_transpose = fisher_factor_transpose
  multiply_ggn = multiply_fisher

  def inner_size(self, z) -> int:
    """Number of columns of the per-example factor (inner positions)."""
    return int(math.prod(z.shape[1:]))

  def factor_columns(self, z):
    """All columns :math:`B e_k` replicated over the batch: ``[K, *z.shape]``.

    Used by the ``exact`` modes: summing :math:`(J^T B e_k)(J^T B e_k)^T`
    over ``k`` gives :math:`J^T F_R J` without sampling noise. Built with
    ``vmap`` over ``k``, never a Python loop.
    """
    k = self.inner_size(z)
    inner = z.shape[1:]

    def column(i):
      e = jax.nn.one_hot(i, k, dtype=_up(z).dtype).reshape(inner)
      return self.fisher_factor(z, jnp.broadcast_to(e, z.shape))
    return jax.vmap(column)(jnp.arange(k))


def make_loss_spec(kind: str, meta: dict, shape) -> LossSpec:
  return LossSpec(kind=kind, weight=float(meta.get("weight", 1.0)),
                  var=float(meta.get("var", 0.5)),
                  has_targets=bool(meta.get("has_targets", False)),
                  shape=tuple(shape))


def total_loss(specs, zs, targets) -> jnp.ndarray:
  """Mean over the batch of ``Σ_l weight_l · nll_l`` (for tests/examples)."""
  total = 0.0
  for spec, z, y in zip(specs, zs, targets):
    total = total + spec.weight * jnp.mean(spec.nll(z, y))
  return total


