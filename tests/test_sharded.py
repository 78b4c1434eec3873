"""Sharded curvature: the placement plan and the transforms with ``mesh=``.

4 devices (``helpers.replica_devices``; conftest.py simulates 4 CPU
devices). The reference is always the same transform without a mesh on one
device; the sharded runs jit the step over a mesh with the batch sharded,
the parameters replicated or FSDP-sharded, and the curvature spread over
the mesh by the plan. ``tests/sharded_worker.py`` checks the same on 8
devices in a subprocess.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import placement
from kfac_jax_lite import sharded
from tests import helpers
from tests import problems

R = 4
SIZES = (8, 16, 12, 12, 12, 20, 8, 8, 4)  # 8 layers, 3 of them alike


@pytest.fixture(name="devices", scope="module", autouse=True)
def _devices():
  with helpers.on_replica_devices(R) as devices:
    yield devices


@pytest.fixture(name="problem", scope="module")
def _problem():
  return problems.mlp_classifier(SIZES, 32, 5)


def _mesh(devices, shape=(R,), names=("d",)):
  return Mesh(np.array(devices).reshape(shape), names)


def _fsdp(params, mesh, axis):
  """Each leaf sharded over ``axis`` on its first dimension."""
  return jax.tree.map(lambda x: jax.device_put(
      x, NamedSharding(mesh, P(axis))), params)


MAKERS = {
    "kfac": lambda c, **kw: kl.kfac(
        1e-2, c, damping=1e-2, inverse_update_period=3, **kw),
    "kfac_adamw": lambda c, **kw: kl.kfac_adamw(
        1e-2, c, damping=1e-2, inverse_update_period=3, **kw),
    "kfac_optimizer": lambda c, **kw: kl.kfac_optimizer(
        c, initial_damping=1e-1, inverse_update_period=3,
        damping_adaptation_interval=2, **kw),
}


def _train(problem, make, params, batch_sharding=None, param_shardings=None,
           **kw):
  """5 steps of ``make(collection, **kw)``; the final params and state."""
  c = problem.scan()
  tx = make(c, **kw)
  state = jax.jit(tx.init)(params)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(problem.loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    new = jax.tree.map(lambda p, u: p + u, params, updates)
    if param_shardings is not None:
      new = jax.lax.with_sharding_constraint(new, param_shardings)
    return new, state

  for b in problem.batches:
    if batch_sharding is not None:
      b = jax.device_put(b, batch_sharding)
    params, state = step(params, state, b)
  return params, state, tx


def _curvature(state):
  """The first curvature state (the estimator's) inside an optax state."""
  return [s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, kl.CurvatureState))
          if isinstance(s, kl.CurvatureState)][0].estimator


def _logical_factors(tx_est, state):
  est_state = tx_est.logical(state) if isinstance(
      state, sharded.ShardedState) else state
  return [(b.a, b.g) for b in est_state.blocks]


@pytest.fixture(name="reference", scope="module")
def _reference(problem):
  return {}


@pytest.mark.parametrize("name,layout", [
    ("kfac", "replicated"), ("kfac", "fsdp"), ("kfac_adamw", "fsdp"),
    pytest.param("kfac_adamw", "replicated", marks=pytest.mark.slow),
    pytest.param("kfac_optimizer", "replicated", marks=pytest.mark.slow),
    pytest.param("kfac_optimizer", "fsdp", marks=pytest.mark.slow),
    pytest.param("kfac", "2d", marks=pytest.mark.slow)])
def test_sharded_steps_match_one_device(problem, devices, reference, name,
                                        layout):
  make = MAKERS[name]
  if name not in reference:
    reference[name] = _train(problem, make, problem.params)
  want_params, want_state, _ = reference[name]
  if layout == "2d":  # Batch over "data", params over "model", curvature
    mesh = _mesh(devices, (2, 2), ("data", "model"))  # over both.
    batch, fsdp, axis = P("data"), "model", ("data", "model")
  else:
    mesh = _mesh(devices)
    batch, fsdp, axis = P("d"), "d", "d"
  params, shardings = problem.params, None
  if layout != "replicated":
    params = _fsdp(params, mesh, fsdp)
    shardings = jax.tree.map(lambda x: x.sharding, params)
  got_params, got_state, tx = _train(
      problem, make, params, NamedSharding(mesh, batch), shardings,
      mesh=mesh, curvature_axis=axis)
  helpers.assert_trees_close(got_params, want_params, rtol=1e-5)
  est = _layout_of(problem.scan(), mesh, axis)
  got = _curvature(got_state)
  assert isinstance(got, sharded.ShardedState)
  helpers.assert_trees_close(_logical_factors(est, got),
                             _logical_factors(None, _curvature(want_state)),
                             rtol=1e-5)
  if layout != "replicated":
    for x, s in zip(jax.tree.leaves(got_params), jax.tree.leaves(shardings)):
      assert x.sharding.is_equivalent_to(s, x.ndim)


def _layout_of(collection, mesh, axis):
  """A sharded estimator with the transforms' layout (the plan depends on
  the blocks only), to read their states with."""
  return sharded.place(kl.FisherEstimator(collection), mesh, axis)
