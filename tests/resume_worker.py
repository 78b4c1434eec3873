"""Worker for the kill-and-resume test: trains, checkpoints, restores.

  python -m tests.resume_worker OUT_DIR START STOP SAVE_AT [OUT_DIR ...]

Each group of four arguments is one run of steps [START, STOP) of a fixed,
seeded training run: it starts from the initial state (or restores the
orbax checkpoint OUT_DIR/ckpt when START > 0), saves an orbax checkpoint
after step SAVE_AT (none if SAVE_AT is -1), and writes the final params
and optimizer state to OUT_DIR/final_<STOP>.npz. The runs of one process
share one compiled step.
"""

import os
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

import kfac_jax_lite as kl
from tests import helpers


def setup():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [6, 8, 3])
  batch0 = helpers.classification_batch(jax.random.PRNGKey(100), 16, 6, 3)
  collection = kl.scan(helpers.classifier_loss, params, batch0)
  tx = kl.kfac_optimizer(collection, inverse_update_period=3,
                         damping_adaptation_interval=2)
  return params, tx


def batch_at(step):
  return helpers.classification_batch(jax.random.PRNGKey(100 + step), 16, 6,
                                      3)


def run(step, params, tx, out, start, stop, save_at=-1):
  state = {"params": params, "opt": tx.init(params)}
  ckpt = ocp.StandardCheckpointer()
  path = os.path.join(os.path.abspath(out), "ckpt")
  if start > 0:
    state = ckpt.restore(path, jax.eval_shape(lambda: state))
  for i in range(start, stop):
    state = step(state, batch_at(i))
    if i + 1 == save_at:
      ckpt.save(path, state)
      ckpt.wait_until_finished()
  leaves = jax.tree.leaves(state)
  np.savez(os.path.join(out, f"final_{stop}.npz"),
           *[np.asarray(x) for x in leaves])


def main(argv):
  params, tx = setup()

  @jax.jit
  def step(state, batch):
    grads = jax.grad(helpers.classifier_loss)(state["params"], batch)
    updates, opt = tx.update(grads, state["opt"], state["params"],
                             batch=batch)
    return {"params": optax.apply_updates(state["params"], updates),
            "opt": opt}

  if not argv or len(argv) % 4:
    raise SystemExit(__doc__)
  for i in range(0, len(argv), 4):
    out, start, stop, save_at = argv[i:i + 4]
    run(step, params, tx, out, int(start), int(stop), int(save_at))


if __name__ == "__main__":
  main(sys.argv[1:])
