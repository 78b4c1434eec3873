"""A K-FAC training script that ends while its steps are still running.

Run by ``tests/test_exit.py``, one case per process::

  python tests/exit_child.py CASE DEVICES MODE [--adam]

``MODE`` is ``jit`` (one device), ``pmap`` or ``shard_map`` (over all
``DEVICES`` simulated CPU devices); ``--adam`` trains with Adam instead
(the reference a K-FAC script must match). The script compiles the step
(one step, waited for), then queues steps without waiting for them,
prints ``queued`` with whether the last one is still running, and ends as
``CASE`` says:

* ``end``: the end of the file;
* ``exit``: ``sys.exit(3)``;
* ``raise``: an uncaught ``RuntimeError`` (status 1);
* ``signal``: keeps queueing steps until a signal (SIGINT, SIGTERM) ends
  it; ``signal_handler`` first installs a SIGTERM handler that raises
  ``SystemExit(143)``, as training scripts that shut down cleanly do;
* ``thread``: the steps are queued by another thread, which then raises;
  the main thread joins it and ends (status 0: Python's, for an exception
  in a thread that is not the main one);
* ``wait``: the reference: waits for the queued steps and prints how long
  that took (``waited S``), then ends.
"""

import os
import sys

CASE, DEVICES, MODE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ADAM = "--adam" in sys.argv
if DEVICES > 1:
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") +
      f" --xla_force_host_platform_device_count={DEVICES}")

# pylint: disable=g-import-not-at-top,wrong-import-position
import faulthandler  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax_lite as kl  # noqa: E402

# tests/test_exit.py sends SIGUSR1 to a child that does not exit in time:
# every thread's Python stack then goes to stderr, even from a thread
# blocked in C code.
faulthandler.register(signal.SIGUSR1, all_threads=True)
# SIGINT raises KeyboardInterrupt, as in a script started from a terminal,
# also where this process inherited SIGINT ignored (Python then leaves it
# ignored: a command a shell without job control starts with `&`).
signal.signal(signal.SIGINT, signal.default_int_handler)

WIDTHS = (64, 384, 384, 10)
BATCH = 64  # Per device.
AXIS = "data"


def loss_fn(params, batch):
  x, labels = batch
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    if i < len(params) - 1:
      x = jnp.tanh(x)
  kl.register_categorical_predictive_distribution(x, labels)
  return optax.softmax_cross_entropy_with_integer_labels(x, labels).mean()


def problem(n):
  keys = jax.random.split(jax.random.PRNGKey(0), len(WIDTHS))
  params = [(jax.random.normal(k, (a, b)) / a ** 0.5, jnp.zeros(b))
            for k, a, b in zip(keys, WIDTHS[:-1], WIDTHS[1:])]
  x = jax.random.normal(keys[-1], (n * BATCH, WIDTHS[0]))
  return params, (x, jnp.arange(n * BATCH) % WIDTHS[-1])


def make_step(collection, axis):
  """``(tx, step)``: kfac_adamw refreshing every second step (Adam with
  ``--adam``), loss and gradient averaged over ``axis`` if given."""
  if ADAM:
    tx = optax.adam(1e-3)
  else:
    tx = kl.kfac_adamw(1e-3, collection, inverse_update_period=2,
                       **({"estimator": kl.FisherEstimator(
                           collection, axis_name=axis)} if axis else {}))

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    if axis:
      loss, grads = jax.lax.pmean((loss, grads), axis)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss

  return tx, step


def build():
  """``(step, params, state, batch)`` for MODE, compiled and run once."""
  n = 1 if MODE == "jit" else jax.device_count()
  params, batch = problem(n)
  collection = kl.scan(loss_fn, params, problem(1)[1])
  tx, step = make_step(collection, None if MODE == "jit" else AXIS)
  state = tx.init(params)
  if MODE == "jit":
    step = jax.jit(step, donate_argnums=(0, 1))
  elif MODE == "pmap":
    step = jax.pmap(step, axis_name=AXIS, donate_argnums=(0, 1))
    params, state = jax.tree.map(lambda a: jnp.stack([a] * n),
                                 (params, state))
    batch = jax.tree.map(lambda a: a.reshape(n, BATCH, *a.shape[1:]), batch)
  else:
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    step = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), P(AXIS)),
        out_specs=(P(), P(), P())), donate_argnums=(0, 1))
  params, state, loss = step(params, state, batch)
  jax.block_until_ready(loss)
  return step, params, state, batch


def queue(steps, count):
  """Runs ``count`` steps without waiting; True if the last is running."""
  step, params, state, batch = steps
  for _ in range(count):
    params, state, _ = step(params, state, batch)
  steps[1:3] = params, state
  return not jax.tree.leaves(params)[0].is_ready()


def main():
  steps = list(build())
  if CASE == "signal_handler":
    def handler(signum, frame):
      del signum, frame
      raise SystemExit(143)
    signal.signal(signal.SIGTERM, handler)
  if CASE == "thread":
    def train():
      print(f"queued running={queue(steps, 20)}", flush=True)
      raise RuntimeError("an error in the training thread")
    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
    return
  running = queue(steps, 20)
  print(f"queued running={running}", flush=True)
  if CASE == "wait":
    t0 = time.monotonic()
    jax.block_until_ready(steps[1])
    print(f"waited {time.monotonic() - t0:.2f}", flush=True)
  if CASE == "exit":
    sys.exit(3)
  if CASE == "raise":
    raise RuntimeError("an error in the training loop")
  if CASE.startswith("signal"):
    deadline = time.monotonic() + 600  # The test sends the signal.
    while time.monotonic() < deadline:
      queue(steps, 1)


if __name__ == "__main__":
  main()
