"""Helpers for the curvature-block tests: layers, data and explicit Fishers."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax_lite import blocks
from kfac_jax_lite.blocks import base
from kfac_jax_lite.collection import Layer


@pytest.fixture
def x64():
  """Runs a test in float64 (factors too), restoring the flag afterwards."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", prev)


@contextlib.contextmanager
def float32():
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", prev)


def make_layer(kind, approx, shapes, num_uses=1, dtype="float64", **meta):
  n = len(shapes)
  return Layer(
      name=f"{kind}_{approx}", kind=kind, approx=approx,
      param_paths=tuple(f"['p{i}']" for i in range(n)),
      param_indices=tuple(range(n)), param_shapes=tuple(map(tuple, shapes)),
      param_dtypes=(dtype,) * n, num_uses=num_uses,
      meta=tuple(sorted(meta.items())))


def make_block(layer, **config):
  return blocks.make_block(layer, blocks.BlockConfig(**config))


def layer_data(inputs, grads, params, param_grads=()):
  """``inputs``/``grads``: one entry per site (``inputs`` entries tuples)."""
  batch = grads[0].shape[1]
  return base.LayerData(inputs=tuple(inputs), grads=tuple(grads),
                        params=tuple(params), param_grads=tuple(param_grads),
                        batch_size=batch)


def fit(block, data, damping=0.1):
  """One zero-debiased update (the state equals this batch's statistic)."""
  state = block.init()
  state = block.update_curvature(state, block.compute_stats(data), 0.95)
  return block.update_cache(state, damping)


def ravel(v):
  return jnp.concatenate([jnp.ravel(x) for x in v])


def random_like(seed, params):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(p.shape), p.dtype)
               for p in params)


def per_example_fisher(grads):
  """``(1/B) Σ_{s,b} ∇∇ᵀ`` from per-example grads ``[S, B, P]``."""
  b = grads.shape[1]
  g = grads.reshape(-1, grads.shape[-1])
  return g.T @ g / b


def per_example_grads(fn, params, inputs, grads):
  """``[S, B, P]``: ∇_θ Σ <fn(θ, x_b), g_{s,b}> per source and example.

  ``fn(params, x)`` maps a batch of one example (leading axis 1) to the
  layer output; ``inputs`` is ``[B, ...]`` and ``grads`` ``[S, B, ...]``.
  """
  def one(params, x, g):
    def inner(p):
      y = fn(p, x[None])
      return jnp.sum(y * g.reshape(y.shape))
    return ravel(jax.grad(inner)(params))
  # One program, not hundreds of eager op-by-op compiles.
  return jax.jit(jax.vmap(jax.vmap(one, (None, 0, 0)), (None, None, 0)))(
      params, inputs, grads)


def all_avals(jaxpr):
  """Every input and output aval of every equation, recursively."""
  for eqn in jaxpr.eqns:
    for v in list(eqn.invars) + list(eqn.outvars):
      if hasattr(v, "aval"):
        yield v.aval
    for p in eqn.params.values():
      subs = p if isinstance(p, (list, tuple)) else (p,)
      for s in subs:
        inner = getattr(s, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          yield from all_avals(inner)
        elif hasattr(s, "eqns"):
          yield from all_avals(s)


def aval_size(aval):
  shape = getattr(aval, "shape", ())
  return int(math.prod(shape))


def kernel_ravel_index(kernel_shape, rhs_spec: str, bias: bool):
  """Ravel index of each ``[(*spatial, I) x O (+bias row)]`` matrix entry."""
  perm = [i for i, ch in enumerate(rhs_spec) if ch not in "IO"]
  perm += [rhs_spec.index("I"), rhs_spec.index("O")]
  n = int(np.prod(kernel_shape))
  c_out = kernel_shape[rhs_spec.index("O")]
  idx = np.arange(n).reshape(kernel_shape).transpose(perm).reshape(-1, c_out)
  if bias:
    idx = np.concatenate([idx, n + np.arange(c_out)[None]], 0)
  return idx.reshape(-1)


def np_matrix(x):
  """A diagonal stored as a vector becomes a matrix (numpy)."""
  x = np.asarray(x)
  return np.diag(x) if x.ndim == 1 else x


def to_ravel(f_mat, index):
  inv = np.argsort(index)
  return f_mat[inv][:, inv]


# ---------------------------------------------------------------------------
# The block protocol, checked on one fitted block.
# ---------------------------------------------------------------------------

PROTOCOL_DAMPING = 0.1


def _run(block, data, v):
  """Every verb once, from a fitted state (one jit)."""
  state0 = block.init()
  stats = block.compute_stats(data)
  state = block.update_curvature(state0, stats, 0.95)
  state = block.update_cache(state, PROTOCOL_DAMPING)
  f = block.factors(state)
  twice = jax.tree.map(lambda x: 2 * x, f)
  out = {"state0": state0, "state": state, "stats": stats, "factors": f,
         "same": block.with_factors(state, f),
         "twice": block.factors(block.with_factors(state, twice)),
         "full": block.full_fisher_block(state),
         "mi": block.multiply_inverse(state, v)}
  if not isinstance(block, base.FusedProduct):
    return out
  raw = block.multiply_matpower_raw(state, block.product_input(v), -1)
  out["fused"] = block.finish_product(raw, v)
  return out


def _close(a, b, rtol=1e-8):
  a, b = (ravel(jax.tree.leaves(x)) for x in (a, b))
  np.testing.assert_allclose(a, b, rtol=rtol,
                             atol=rtol * float(jnp.max(jnp.abs(b))))


def _same_structure(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype


def check_protocol(block, data, params, exp1=True, cholesky=True):
  """What the block protocol promises, for ``block`` fitted on ``data``:
  a stable state structure, statistics shaped like ``factors``, a
  ``factors``/``with_factors`` round trip, products that invert each other
  (``exp1``: the block has products at exp 1; ``cholesky``: it has
  Cholesky products, else they raise), and the optional capabilities
  agreeing with the plain verbs. Returns the jitted outputs."""
  assert isinstance(block, base.Block)
  v = random_like(3, params)
  batch = data.batch_size   # A static int, closed over.
  out = jax.jit(lambda d, x: _run(block, d._replace(batch_size=batch), x))(
      data._replace(batch_size=None), v)
  _same_structure(out["state"], out["state0"])
  stats, factors = out["stats"], out["factors"]
  row_stats = getattr(block, "row_stats", ())
  if row_stats:  # Per-example rows (EK-FAC); the others are factor-shaped.
    stats = {k: v for k, v in stats.items() if k not in row_stats}
    factors = {k: v for k, v in factors.items() if k in stats}
  _same_structure(factors, stats)
  _same_structure(out["same"], out["state"])
  for x, y in zip(jax.tree.leaves(out["same"]),
                  jax.tree.leaves(out["state"])):
    np.testing.assert_array_equal(x, y)
  _close(out["twice"], jax.tree.map(lambda x: 2 * x, out["factors"]))
  p = sum(x.size for x in params)
  full = np.asarray(out["full"])
  assert full.shape == (p, p) and np.all(np.isfinite(full))
  np.testing.assert_allclose(full, full.T, atol=1e-10 * np.abs(full).max())
  _same_structure(out["mi"], v)
  if "fused" in out:
    _close(out["fused"], out["mi"])
  state = out["state"]
  if exp1:
    _close(block.multiply(state, out["mi"]), v, rtol=1e-7)
  if not cholesky:
    with pytest.raises(ValueError, match="supports exp"):
      block.multiply_cholesky(state, v)
  elif isinstance(block, base.CholeskyProducts):
    for t in (False, True):
      _close(block.multiply_cholesky(
          state, block.multiply_cholesky_inverse(state, v, t), t), v,
             rtol=1e-7)
  if isinstance(block, base.FactorBucketed):
    check_bucketed(block, state)
  return out


def check_bucketed(block, state):
  """The factor-by-factor refresh equals ``update_cache``."""
  requests = block.factor_requests(state)
  dampings = block.factor_dampings(state, PROTOCOL_DAMPING, {})
  caches = {n: block.factor_cache(f, dampings[n]) for n, f in requests}
  got = block.with_factor_caches(state, PROTOCOL_DAMPING, caches)
  want = block.update_cache(state, PROTOCOL_DAMPING)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _close(x, y, rtol=1e-10)
