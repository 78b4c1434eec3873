"""Data-parallel K-FAC with ``jax.pmap`` on MNIST.

Each of ``--devices`` devices gets ``batch_size / devices`` examples of
every global batch (the batch is reshaped to ``[devices, per_device,
...]``); parameters and the optimizer state carry a leading device axis,
one copy per replica. Inside the mapped step (axis ``"data"``):

* ``jax.value_and_grad`` gives this replica's loss and gradient, averaged
  with ``lax.pmean`` (the user's job: K-FAC preconditions the gradient it
  is given);
* ``kfac(..., axis_name="data")`` computes the curvature statistics from
  the replica's examples (``batch=``), with targets sampled from a key
  folded with the replica index, and averages them over the axis, so every
  replica holds the factors of the global batch and the same state.

``--distributed-inverses`` splits the inverse refresh across the devices
(each computes a share, one ``psum`` shares the results);
``--stats-sync before_refresh`` averages the factors only before each
refresh (fewer all-reduces; the replicas' factors differ in between, which
pmap's per-replica state allows).

Run::

  python examples/pmap_data_parallel.py                 # 4 simulated CPU devices
  python examples/pmap_data_parallel.py --devices 2 --steps 200

The devices are the default backend's where it has ``--devices`` of them,
else the CPU's (on a machine with one GPU, the simulated CPU devices);
``--platform`` picks the platform. The first line printed names it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Optional, Sequence


def _force_host_devices(argv: Sequence[str]):
  """Simulated CPU devices must be requested before jax is imported."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--devices", type=int, default=4)
    n = pre.parse_known_args(argv)[0].devices
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={n}").strip()


if __name__ == "__main__":
  _force_host_devices(sys.argv[1:])

import jax  # noqa: E402
from jax import lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax_lite as kl  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "data", "mnist.npz")
AXIS = "data"


def select_devices(n: int, platform: Optional[str] = None) -> list:
  """The first ``n`` devices of ``platform`` (``"cpu"``, ``"gpu"``, ...).

  By default those of JAX's default backend, or, where it has fewer than
  ``n`` (a machine with one GPU), of the CPU (simulated devices, requested
  before jax is imported). Raises ``ValueError`` naming both counts where
  neither has ``n``.
  """
  default = jax.devices()
  if platform is None and len(default) >= n:
    return default[:n]
  devices = jax.devices(platform or "cpu")
  if len(devices) < n:
    also = ("" if devices[0].platform == default[0].platform else
            f" (the default backend, {default[0].platform}, has "
            f"{len(default)})")
    raise ValueError(
        f"--devices {n} > the {len(devices)} {devices[0].platform} devices "
        f"jax sees{also}: set XLA_FLAGS=--xla_force_host_platform_device"
        f"_count={n} before starting Python for {n} CPU devices.")
  return devices[:n]


# ---------------------------------------------------------------------------
# Model and data.
# ---------------------------------------------------------------------------


def init_mlp(key, sizes: Sequence[int]) -> list:
  """``[{"w": [m, n], "b": [n]}, ...]`` with LeCun-normal kernels."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def loss_fn(params: list, batch: dict):
  """Mean softmax cross-entropy of a tanh MLP; layers and loss tagged."""
  x = batch["image"].reshape(batch["image"].shape[0], -1)
  for i, layer in enumerate(params):
    y = x @ layer["w"] + layer["b"]
    y = kl.register_dense(y, x, layer["w"], layer["b"])
    x = jnp.tanh(y) if i < len(params) - 1 else y
  kl.register_categorical_predictive_distribution(x, batch["label"])
  return optax.softmax_cross_entropy_with_integer_labels(
      x, batch["label"]).mean()


def accuracy(params: list, images, labels):
  x = images.reshape(images.shape[0], -1)
  for i, layer in enumerate(params):
    x = x @ layer["w"] + layer["b"]
    x = jnp.tanh(x) if i < len(params) - 1 else x
  return jnp.mean(jnp.argmax(x, -1) == labels)


def load_mnist(path: str, train_size: int) -> dict:
  """The bundled MNIST as float32 images in ``[0, 1]`` and int32 labels."""
  with np.load(path) as d:
    return {"x_train": d["x_train"][:train_size].astype(np.float32) / 255.0,
            "y_train": d["y_train"][:train_size].astype(np.int32),
            "x_test": d["x_test"].astype(np.float32) / 255.0,
            "y_test": d["y_test"].astype(np.int32)}


def batches(data: dict, batch_size: int, seed: int):
  """Endless shuffled global batches (epoch ``e`` uses seed ``seed + e``)."""
  n, epoch = len(data["x_train"]), 0
  while True:
    order = np.random.default_rng(seed + epoch).permutation(n)
    for s in range(0, n - batch_size + 1, batch_size):
      idx = order[s:s + batch_size]
      yield {"image": data["x_train"][idx], "label": data["y_train"][idx]}
    epoch += 1


# ---------------------------------------------------------------------------
# The data-parallel step.
# ---------------------------------------------------------------------------


def make_step(tx, devices: Sequence) -> Callable:
  """``step(params, opt_state, batch) -> (params, opt_state, loss)``, pmapped.

  Every argument and result has a leading axis of ``len(devices)``.
  """
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    loss, grads = lax.pmean((loss, grads), AXIS)
    updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.pmap(step, axis_name=AXIS, devices=devices)


def replicate(tree, n: int):
  """A leading axis of ``n`` identical copies."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


def split(batch: dict, n: int) -> dict:
  """``[B, ...]`` -> ``[n, B / n, ...]``."""
  return jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), batch)


def train(args: argparse.Namespace, data: dict) -> dict:
  """Trains ``args.steps`` steps; returns losses, accuracy and timings."""
  devices = select_devices(args.devices, args.platform)
  # New arrays, eager ops and jit on the mapped devices' platform too.
  with jax.default_device(devices[0]):
    return _train(args, data, devices)


def _train(args: argparse.Namespace, data: dict, devices: list) -> dict:
  n = len(devices)
  sizes = [784] + [args.hidden] * args.depth + [10]
  params = init_mlp(jax.random.PRNGKey(args.seed), sizes)
  stream = batches(data, args.batch_size, args.seed)
  example = next(stream)
  collection = kl.scan(loss_fn, params, example)
  tx = kl.kfac(args.lr, collection, damping=args.damping,
               momentum=args.momentum,
               inverse_update_period=args.inverse_period, axis_name=AXIS,
               stats_sync=args.stats_sync,
               distributed_inverses=args.distributed_inverses,
               seed=args.seed)
  step = make_step(tx, devices)
  params, opt_state = replicate((params, tx.init(params)), n)
  losses, t0, first = [], time.perf_counter(), None
  for i in range(args.steps):
    batch = split(example if i == 0 else next(stream), n)
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss[0]))
    if first is None:
      first = time.perf_counter() - t0
    if args.log_every and (i + 1) % args.log_every == 0:
      print(f"step {i + 1:5d}  loss {losses[-1]:.4f}  "
            f"{time.perf_counter() - t0:6.1f}s", flush=True)
  seconds = time.perf_counter() - t0
  params = jax.tree.map(lambda x: x[0], params)
  acc = float(jax.jit(accuracy)(params, data["x_test"], data["y_test"]))
  return {"devices": n, "steps": args.steps, "losses": losses,
          "test_accuracy": acc, "seconds": seconds, "first_step_s": first,
          "params": params}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Data-parallel K-FAC with jax.pmap on MNIST.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", type=int, default=4,
                 help="mesh size (simulated CPU devices when run directly)")
  p.add_argument("--platform", default=None,
                 help="the devices' platform (cpu, gpu, tpu); by default "
                 "the default backend's, or the CPU's where it has fewer "
                 "than --devices")
  p.add_argument("--data", default=DEFAULT_DATA, help="MNIST .npz")
  p.add_argument("--train-size", type=int, default=20000,
                 help="training examples used")
  p.add_argument("--steps", type=int, default=100, help="training steps")
  p.add_argument("--batch-size", type=int, default=256,
                 help="global batch (divisible by --devices)")
  p.add_argument("--hidden", type=int, default=128, help="hidden width")
  p.add_argument("--depth", type=int, default=2, help="hidden layers")
  p.add_argument("--lr", type=float, default=0.02, help="K-FAC lr")
  p.add_argument("--damping", type=float, default=3e-3)
  p.add_argument("--momentum", type=float, default=0.5)
  p.add_argument("--inverse-period", type=int, default=5)
  p.add_argument("--stats-sync", default="every_update",
                 choices=["every_update", "before_refresh"])
  p.add_argument("--distributed-inverses", action="store_true",
                 help="split the inverse refresh across the devices")
  p.add_argument("--log-every", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  try:
    select_devices(args.devices, args.platform)
  except (ValueError, RuntimeError) as e:  # RuntimeError: unknown platform.
    p.error(str(e))
  if args.batch_size % args.devices:
    p.error(f"--batch-size {args.batch_size} is not divisible by --devices "
            f"{args.devices}.")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Parses flags, trains, prints a summary, returns the results dict."""
  args = parse_args(argv)
  data = load_mnist(args.data, args.train_size)
  platform = select_devices(args.devices, args.platform)[0].platform
  print(f"jax {jax.__version__}: {args.devices} of "
        f"{len(jax.devices(platform))} {platform} devices (default backend "
        f"{jax.default_backend()}), global batch {args.batch_size} "
        f"({args.batch_size // args.devices} per device)", flush=True)
  results = train(args, data)
  results.pop("params")
  print(f"final loss {results['losses'][-1]:.4f} (first "
        f"{results['losses'][0]:.4f}), test accuracy "
        f"{results['test_accuracy']:.4f}, {results['steps']} steps in "
        f"{results['seconds']:.1f}s (first step incl. compile "
        f"{results['first_step_s']:.1f}s)")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
