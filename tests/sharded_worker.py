"""One process of a multi-process sharded-curvature run (``jax.distributed``).

``python tests/sharded_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR OUT``:
joins the job (gloo on the CPU, 4 CPU devices per process), runs 5 steps of
``kfac(..., mesh=<all global devices>, curvature_axis="d")`` on the MLP of
``tests/test_sharded.py`` with each process feeding its slice of every
batch, and writes the final parameters and this process's curvature bytes
per local device to ``OUT.<process id>.npz``.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after XLA_FLAGS)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

import kfac_jax_lite as kl  # noqa: E402
from tests import problems  # noqa: E402

SIZES = (8, 16, 12, 12, 12, 20, 8, 8, 4)


def main(pid: int, num: int, coordinator: str, out: str):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator,
                             num_processes=num, process_id=pid,
                             initialization_timeout=120)
  try:
    problem = problems.mlp_classifier(SIZES, 32, 5)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    tx = kl.kfac(1e-2, problem.scan(), damping=1e-2,
                 inverse_update_period=3, mesh=mesh, curvature_axis="d")
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    params = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        rep, np.asarray(x)), problem.params)
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, state, batch):
      grads = jax.grad(problem.loss)(params, batch)
      updates, state = tx.update(grads, state, params, batch=batch)
      return jax.tree.map(lambda p, u: p + u, params, updates), state

    for b in problem.batches:
      n = b[0].shape[0] // num
      local = jax.tree.map(lambda x: np.asarray(x)[pid * n:(pid + 1) * n], b)
      batch = jax.tree.map(
          lambda x: jax.make_array_from_process_local_data(split, x), local)
      params, state = step(params, state, batch)
    rows = state.inner[0].estimator.rows
    local_bytes = [sum(s.data.nbytes for x in rows.values()
                       for s in x.addressable_shards if s.device == d)
                   for d in jax.local_devices()]
    leaves = [np.asarray(x.addressable_data(0))
              for x in jax.tree.leaves(params)]
    np.savez(f"{out}.{pid}.npz", *leaves, bytes=np.asarray(local_bytes))
  finally:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
