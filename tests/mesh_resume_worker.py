"""A sharded-curvature checkpoint resumed on another mesh shape.

:func:`check_resume` saves a run on ``big`` devices with orbax, restores
it, checks that resuming on the same mesh is bitwise, then moves the
curvature onto ``small`` devices (``kl.relayout_curvature``) and checks the
blocks bitwise and the following steps against continuing on ``big``.
``tests/test_sharded.py`` calls it in-process (4 devices to 2) and runs
this file in a subprocess of 8 simulated CPU devices (8 to 4)::

  python tests/mesh_resume_worker.py BIG SMALL DIR
"""

import os
import sys

if __name__ == "__main__":  # Before jax initialises its backends.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{sys.argv[1]}")
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after XLA_FLAGS)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

import kfac_jax_lite as kl  # noqa: E402
from kfac_jax_lite import placement  # noqa: E402
from tests import helpers  # noqa: E402

SIZES = (8, 16, 12, 12, 12, 20, 8, 8, 4)  # tests/test_sharded.py's MLP


def _stepper(problem, tx, mesh):
  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(problem.loss)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return jax.tree.map(lambda p, u: p + u, params, updates), state

  def run(params, state, batches):
    for b in batches:
      params, state = step(params, state, jax.device_put(
          b, NamedSharding(mesh, P("d"))))
    return params, state
  return run


def _target(tree, sharding=None):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding or x.sharding), tree)


def _curvature(opt_state):
  """The sharded curvature state inside ``kfac``'s optax state."""
  return [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, kl.ShardedState))
          if isinstance(s, kl.ShardedState)][0]


def _logical(collection, mesh, state):
  est = kl.sharded.place(kl.FisherEstimator(collection), mesh, "d")
  return jax.tree.leaves(est.logical(_curvature(state)))


def check_resume(problem, big, small, path, rtol=1e-5):
  """Raises AssertionError unless the checkpoint of a run on the devices
  ``big`` resumes bitwise on them, and onto ``small`` with its blocks
  bitwise and the parameters and blocks of the next steps within ``rtol``
  (``‖a − b‖ ≤ rtol‖b‖`` per leaf) of continuing on ``big``."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  c = problem.scan()
  mesh = Mesh(np.array(big), ("d",))
  onto_mesh = Mesh(np.array(small), ("d",))
  make = lambda m: kl.kfac(  # noqa: E731
      1e-2, c, damping=1e-2, inverse_update_period=2, mesh=m,
      curvature_axis="d")
  tx = make(mesh)
  run = _stepper(problem, tx, mesh)
  params, state = run(problem.params, jax.jit(tx.init)(problem.params),
                      problem.batches[:2])
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, {"params": params, "opt": state})
  ckpt.wait_until_finished()
  want = run(params, state, problem.batches[2:])
  back = ckpt.restore(path, _target({"params": params, "opt": state}))
  for x, y in zip(jax.tree.leaves(back["opt"]), jax.tree.leaves(state)):
    assert x.sharding == y.sharding
    np.testing.assert_array_equal(x, y)
  got = run(back["params"], back["opt"], problem.batches[2:])
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(x, y)
  # The same checkpoint on the small mesh: rows restored onto it, then each
  # block moved to its owner under the small mesh's plan.
  onto = ckpt.restore(path, _target({"params": params, "opt": state},
                                    NamedSharding(onto_mesh, P())))
  opt = kl.relayout_curvature(onto["opt"], kl.FisherEstimator(c),
                              onto_mesh, "d")
  rows = _curvature(opt).rows["float32"]
  assert rows.shape[0] == len(small), rows.shape
  assert rows.sharding.spec == P("d"), rows.sharding
  for x, y in zip(_logical(c, onto_mesh, opt), _logical(c, mesh, state)):
    np.testing.assert_array_equal(x, y)  # The blocks moved bit for bit.
  moved = _stepper(problem, make(onto_mesh), onto_mesh)(
      onto["params"], opt, problem.batches[2:])
  helpers.assert_trees_close(moved[0], want[0], rtol)  # The parameters,
  helpers.assert_trees_close(_logical(c, onto_mesh, moved[1]),  # the blocks.
                             _logical(c, mesh, want[1]), rtol)


def main(big: int, small: int, directory: str):
  from tests import problems  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  assert len(devices) == big, devices
  plan = placement.make_plan(kl.FisherEstimator(
      problems.mlp_classifier(SIZES, 32, 5).scan()), big)
  print(plan.describe())
  check_resume(problems.mlp_classifier(SIZES, 32, 5), devices,
               devices[:small], os.path.join(directory, "ckpt"))
  print(f"resumed {big} -> {small} devices: blocks bitwise, steps within "
        "1e-5")


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
