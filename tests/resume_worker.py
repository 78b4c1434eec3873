"""Worker for the kill-and-resume test: trains, checkpoints, restores.

  python -m tests.resume_worker OUT_DIR START STOP [--save-at K]

Trains steps [START, STOP) of a fixed, seeded run (restoring the orbax
checkpoint OUT_DIR/ckpt when START > 0), optionally saves an orbax
checkpoint after step K, and writes the final params and optimizer state to
OUT_DIR/final_<STOP>.npz.
"""

import argparse
import os

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


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("start", type=int)
  parser.add_argument("stop", type=int)
  parser.add_argument("--save-at", type=int, default=-1)
  args = parser.parse_args(argv)
  params, tx = setup()
  state = {"params": params, "opt": tx.init(params)}
  ckpt = ocp.StandardCheckpointer()
  path = os.path.join(os.path.abspath(args.out), "ckpt")
  if args.start > 0:
    state = ckpt.restore(path, jax.eval_shape(lambda: state))

  @jax.jit
  def step(state, batch):
    grads = jax.grad(helpers.classifier_loss)(state["params"], batch)
    updates, opt = tx.update(grads, state["opt"], state["params"],
                             batch=batch)
    return {"params": optax.apply_updates(state["params"], updates),
            "opt": opt}

  for i in range(args.start, args.stop):
    state = step(state, batch_at(i))
    if i + 1 == args.save_at:
      ckpt.save(path, state)
      ckpt.wait_until_finished()
  leaves = jax.tree.leaves(state)
  np.savez(os.path.join(args.out, f"final_{args.stop}.npz"),
           *[np.asarray(x) for x in leaves])


if __name__ == "__main__":
  main()
