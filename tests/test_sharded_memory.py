"""Sharded curvature: what the compiled EMA holds besides the row.

4 simulated CPU devices (conftest.py). One block dominates (a 16 -> 96
dense layer: a 17 x 17 and a 96 x 96 factor); the EMA of the sharded
estimator (``update_curvature`` from a linearisation, the state donated as
in a step) writes each device's largest block's factors into its row one
at a time, each computed from the window it overwrites
(:func:`kfac_jax_lite.row_writes.in_turn`); written with the block's other
leaves in one concatenation, XLA first copies the old factors out of the
row.
"""

import math

import jax
from jax.sharding import Mesh
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import row_writes
from kfac_jax_lite import sharded
from kfac_jax_lite.scanner import deps
from tests import helpers
from tests import problems

R = 4


@pytest.fixture(name="devices", scope="module", autouse=True)
def _devices():
  with helpers.on_replica_devices(R) as devices:
    yield devices


@pytest.fixture(name="problem", scope="module")
def _problem():
  return problems.mlp_classifier((8, 16, 96), 32, 1)


def _ema(problem, devices):
  """``(sharded estimator, jitted EMA, its initial state)``."""
  est = kl.FisherEstimator(problem.scan())
  sh = sharded.place(est, Mesh(np.array(devices), ("d",)), "d")

  def ema(state, params, batch):
    lin = est.linearize(params, batch)
    return sh.update_curvature(state, stats=sh.stats_from(
        lin, jax.random.PRNGKey(0)))

  return sh, jax.jit(ema, donate_argnums=0), jax.jit(sh.init)(problem.params)


def _all_at_once(rows, layout, r, i, fn):
  """The write ``in_turn`` replaces: every changed leaf in one."""
  old = layout.unpack(r, rows)[i]
  return row_writes.write(rows, layout, {i: old}, {i: fn(old)})


def test_the_ema_makes_no_copy_of_the_largest_factor(problem, devices,
                                                     monkeypatch):
  """The compiled EMA's temporaries are smaller than with the factors
  written in one concatenation by at least the largest factor (the copy
  of it that XLA makes there), and the rows it writes are the same."""
  sh, ema, state = _ema(problem, devices)
  p, batch = problem.params, problem.batches[0]
  temp = ema.lower(state, p, batch).compile().memory_analysis(
      ).temp_size_in_bytes
  rows = jax.tree.map(np.asarray, ema(state, p, batch).rows)
  with monkeypatch.context() as m:
    m.setattr(row_writes, "in_turn", _all_at_once)
    sh, ema, state = _ema(problem, devices)
    temp_once = ema.lower(state, p, batch).compile().memory_analysis(
        ).temp_size_in_bytes
    rows_once = jax.tree.map(np.asarray, ema(state, p, batch).rows)
  largest = max(math.prod(x.shape) * x.dtype.itemsize
                for b in sh.estimator.blocks
                for x in jax.tree.leaves(jax.eval_shape(b.init))
                if x.ndim == 2)
  assert temp + largest <= temp_once, (temp, largest, temp_once)
  for dt in rows:
    np.testing.assert_allclose(rows[dt], rows_once[dt], rtol=1e-6,
                               atol=0)


def test_the_write_order_puts_the_factors_before_their_weight():
  """An EMA's factors read the EMA weight: they are written first, the
  weight last; a cycle of reads has no order."""
  jnp = jax.numpy
  state = {"a": jnp.ones((3, 3)), "g": jnp.ones((2, 2)),
           "w": jnp.ones(()), "c": jnp.ones((2,))}

  def ema(s):
    return {**s, "a": s["a"] * s["w"], "g": s["g"] + s["w"],
            "w": s["w"] * 2}

  # Leaves in key order: a, c, g, w.
  assert deps.leaf_dependencies(ema, state) == [
      {0, 3}, {1}, {2, 3}, {3}]
  assert row_writes.write_order(ema, state) == [0, 2, 3]

  def swap(s):
    return {**s, "a": s["a"] + s["g"].sum(), "g": s["g"] + s["a"].sum()}

  assert row_writes.write_order(swap, state) is None
