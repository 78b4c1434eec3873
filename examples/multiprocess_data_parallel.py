"""Multi-process data-parallel K-FAC with ``jax.distributed`` (CPU, gloo).

The launcher starts ``--num-processes`` local Python processes (workers),
each with one CPU device. The workers call ``jax.distributed.initialize``
with a coordinator on ``127.0.0.1`` and use gloo for the CPU collectives, so
``jax.devices()`` lists every process's device and one ``jax.shard_map``
over a mesh of all of them runs K-FAC data-parallel: each process feeds its
own slice of every global batch (``jax.make_array_from_process_local_data``)
and the statistics, gradients and losses are averaged across processes, as
on several devices of one host. On a real cluster, run the worker mode once
per host with the coordinator's address instead of using the launcher.

Run::

  python examples/multiprocess_data_parallel.py                  # 2 processes
  python examples/multiprocess_data_parallel.py --num-processes 4 --steps 20
  # a worker by hand (one per process):
  python examples/multiprocess_data_parallel.py --process-id 0 \\
      --num-processes 2 --coordinator 127.0.0.1:12345

The launcher kills every worker if one fails or the run exceeds
``--timeout`` seconds. Process 0 writes the final parameters and losses to
``--out`` (an ``.npz``); :func:`main` returns them.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax

import kfac_jax_lite as kl

AXIS = "data"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# Model and data (deterministic: every process builds the same global data).
# ---------------------------------------------------------------------------


def init_mlp(key, sizes: Sequence[int]) -> list:
  """``[{"w": [m, n], "b": [n]}, ...]`` with LeCun-normal kernels."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def loss_fn(params: list, batch: dict):
  """Mean softmax cross-entropy of a tanh MLP; layers and loss tagged."""
  x = batch["x"]
  for i, layer in enumerate(params):
    y = kl.register_dense(x @ layer["w"] + layer["b"], x, layer["w"],
                          layer["b"])
    x = jnp.tanh(y) if i < len(params) - 1 else y
  kl.register_categorical_predictive_distribution(x, batch["y"])
  return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()


def synthetic_batches(seed: int, steps: int, batch_size: int, dim: int,
                      classes: int) -> list:
  """``steps`` global batches labelled by a random linear teacher."""
  rng = np.random.default_rng(seed)
  teacher = rng.normal(size=(dim, classes)).astype(np.float32)
  out = []
  for _ in range(steps):
    x = rng.normal(size=(batch_size, dim)).astype(np.float32)
    out.append({"x": x, "y": np.argmax(x @ teacher, -1).astype(np.int32)})
  return out


def local_slice(batch: dict, process_id: int, num_processes: int) -> dict:
  """This process's contiguous share of a global batch."""
  n = len(batch["y"]) // num_processes
  return {k: v[process_id * n:(process_id + 1) * n] for k, v in batch.items()}


# ---------------------------------------------------------------------------
# Training: the same function for one process or many.
# ---------------------------------------------------------------------------


def train(mesh: Mesh, batches: list, *, process_id: int = 0,
          num_processes: int = 1, hidden: int = 16, lr: float = 0.05,
          damping: float = 1e-2, estimation_mode: str = "gradients",
          seed: int = 0) -> dict:
  """K-FAC over ``mesh`` (all global devices), one step per global batch.

  Each process passes the global batches and feeds only its
  :func:`local_slice`; with one process and a one-device mesh this is
  plain single-device training on the whole batch.

  Returns:
    ``{"params": [...] (numpy), "losses": [...]}``.
  """
  dim, classes = batches[0]["x"].shape[1], int(batches[0]["y"].max()) + 1
  params = init_mlp(jax.random.PRNGKey(seed), [dim, hidden, classes])
  collection = kl.scan(loss_fn, params, batches[0])
  tx = kl.kfac(lr, collection, damping=damping, momentum=0.0,
               inverse_update_period=2, estimation_mode=estimation_mode,
               axis_name=AXIS)
  vgs = kl.value_grad_and_stats(loss_fn, collection, axis_name=AXIS,
                                estimation_mode=estimation_mode)

  def step(params, opt_state, batch, rng):
    loss, grads, stats = vgs(params, batch, rng)
    loss, grads = lax.pmean((loss, grads), AXIS)
    updates, opt_state = tx.update(grads, opt_state, params, stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(jax.shard_map(step, mesh=mesh,
                               in_specs=(P(), P(), P(AXIS), P()),
                               out_specs=(P(), P(), P())))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

  def put(tree):  # Replicated values: every process holds the same copy.
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        replicated, np.asarray(x)), tree)

  params, opt_state = put(params), put(tx.init(params))
  key, losses = jax.random.PRNGKey(seed + 1), []
  for i, b in enumerate(batches):
    local = local_slice(b, process_id, num_processes)
    batch = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(split, x), local)
    params, opt_state, loss = step(params, opt_state, batch,
                                   put(jax.random.fold_in(key, i)))
    losses.append(float(np.asarray(loss.addressable_data(0))))
  params = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)
  return {"params": params, "losses": losses}


# ---------------------------------------------------------------------------
# Worker and launcher.
# ---------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> dict:
  """One process: joins the job, trains, process 0 writes ``args.out``."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes,
                             process_id=args.process_id,
                             initialization_timeout=args.timeout)
  try:
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    batches = synthetic_batches(args.seed, args.steps, args.batch_size,
                                args.dim, args.classes)
    out = train(mesh, batches, process_id=args.process_id,
                num_processes=args.num_processes, hidden=args.hidden,
                lr=args.lr, damping=args.damping,
                estimation_mode=args.estimation_mode, seed=args.seed)
    print(f"[process {args.process_id}/{args.num_processes}] "
          f"{len(jax.devices())} global devices; losses "
          + " ".join(f"{x:.4f}" for x in out["losses"]), flush=True)
    if args.process_id == 0 and args.out:
      save(args.out, out)
    return out
  finally:
    jax.distributed.shutdown()


def save(path: str, out: dict):
  flat = {f"param_{i}_{k}": v for i, layer in enumerate(out["params"])
          for k, v in layer.items()}
  np.savez(path, losses=np.asarray(out["losses"]), **flat)


def load(path: str) -> dict:
  with np.load(path) as d:
    layers = {}
    for name in d.files:
      if name.startswith("param_"):
        _, i, k = name.split("_", 2)
        layers.setdefault(int(i), {})[k] = d[name]
    return {"params": [layers[i] for i in sorted(layers)],
            "losses": list(d["losses"])}


class LaunchError(RuntimeError):
  """A worker failed or the run timed out; ``pids`` were all killed."""

  def __init__(self, message: str, pids: Sequence[int]):
    super().__init__(message)
    self.pids = tuple(pids)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict:
  """The environment of a worker: one CPU device, this repository importable.

  A forced host device count (tests set 4) is removed from ``XLA_FLAGS``.
  """
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                 env.get("XLA_FLAGS", "")).strip()
  env["XLA_FLAGS"] = flags
  env["PYTHONPATH"] = os.pathsep.join(
      [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  env["JAX_PLATFORMS"] = "cpu"
  return env


def launch(args: argparse.Namespace, forward: Sequence[str]) -> dict:
  """Starts the workers, waits (at most ``args.timeout`` s), returns
  process 0's results; kills every worker on failure or timeout.

  Raises:
    LaunchError: a worker failed or the run timed out (with its output).
  """
  coordinator = f"127.0.0.1:{free_port()}"
  out = args.out or os.path.join(tempfile.mkdtemp(), "result.npz")
  procs, logs = [], []
  try:
    for pid in range(args.num_processes):
      log = tempfile.TemporaryFile(mode="w+")
      cmd = [sys.executable, os.path.abspath(__file__), *forward,
             "--process-id", str(pid), "--coordinator", coordinator,
             "--out", out]
      procs.append(subprocess.Popen(cmd, env=worker_env(), stdout=log,
                                    stderr=subprocess.STDOUT))
      logs.append(log)
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0)]
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.1)
    codes = [p.poll() for p in procs]
    if any(c != 0 for c in codes):
      failed = any(c not in (None, 0) for c in codes)
      why = (f"exit codes {codes}; None: still running, killed" if failed
             else f"timed out after {args.timeout} s; killed")
      text = []
      for pid, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- process {pid} ---\n{log.read()[-3000:]}")
      raise LaunchError(f"multi-process run failed ({why}):\n"
                        + "\n".join(text), [p.pid for p in procs])
    logs[0].seek(0)
    print(logs[0].read().strip().splitlines()[-1], flush=True)
    return load(out)
  finally:
    for p in procs:  # Only our own children, by handle.
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Multi-process data-parallel K-FAC (jax.distributed, gloo)",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--num-processes", type=int, default=2)
  p.add_argument("--process-id", type=int, default=None,
                 help="worker mode: this process's id (else: launch all)")
  p.add_argument("--coordinator", default=None,
                 help="worker mode: HOST:PORT of process 0's coordinator")
  p.add_argument("--out", default=None, help="results .npz (process 0)")
  p.add_argument("--timeout", type=int, default=300,
                 help="seconds before the launcher kills the workers")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--batch-size", type=int, default=64, help="global batch")
  p.add_argument("--dim", type=int, default=8)
  p.add_argument("--classes", type=int, default=4)
  p.add_argument("--hidden", type=int, default=16)
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--damping", type=float, default=1e-2)
  p.add_argument("--estimation-mode", default="gradients")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.batch_size % args.num_processes:
    p.error(f"--batch-size {args.batch_size} is not divisible by "
            f"--num-processes {args.num_processes}.")
  if args.process_id is not None and args.coordinator is None:
    p.error("--process-id needs --coordinator HOST:PORT.")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Launcher (default) or worker (``--process-id``); returns the results."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.process_id is not None:
    return worker(args)
  forward = list(argv)
  for flag in ("--out", "--process-id", "--coordinator"):
    while flag in forward:
      i = forward.index(flag)
      del forward[i:i + 2]
  t0 = time.perf_counter()
  out = launch(args, forward)
  print(f"{args.num_processes} processes, {args.steps} steps in "
        f"{time.perf_counter() - t0:.1f}s; final loss {out['losses'][-1]:.4f}")
  return out


if __name__ == "__main__":
  main()
