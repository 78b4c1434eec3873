import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import kfac_jax_lite as kl


def loss_fn(params, batch):
  x, labels = batch
  logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
  kl.register_categorical_predictive_distribution(logits, labels)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w1": jax.random.normal(k1, (16, 32)) / 4,
          "w2": jax.random.normal(k2, (32, 4)) / 32 ** 0.5}
batch = (jax.random.normal(k3, (64, 16)), jax.random.randint(k3, (64,), 0, 4))
collection = kl.scan(loss_fn, params, batch)
tx = kl.kfac(1e-2, collection, damping=1e-2)


@jax.jit
def step(params, opt_state, batch):
  grads = jax.grad(loss_fn)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
  return optax.apply_updates(params, updates), opt_state


def run(params, opt_state, steps):
  for _ in range(steps):
    params, opt_state = step(params, opt_state, batch)
  return params, opt_state


params, opt_state = run(params, tx.init(params), 15)
path = os.path.join(os.environ.get("KFAC_DOCS_TMP") or tempfile.mkdtemp(),
                    "step_15")

# --8<-- [start:save]
ckpt = ocp.StandardCheckpointer()
ckpt.save(path, {"params": params, "opt": opt_state})
ckpt.wait_until_finished()
target = jax.eval_shape(lambda: {"params": params, "opt": opt_state})
restored = ckpt.restore(path, target)
# --8<-- [end:save]

# Resuming gives the same parameters, bit for bit, as running on.
straight, _ = run(params, opt_state, 5)
resumed, _ = run(restored["params"], restored["opt"], 5)
for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
  np.testing.assert_array_equal(a, b)
print("resumed run identical:", True)
