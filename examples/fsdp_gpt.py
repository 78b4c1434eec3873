"""A GPT trained with FSDP parameters and sharded K-FAC curvature.

One mesh axis, ``data``, carries everything: the batch is split over it
(data parallelism), every parameter is split over it on one of its axes
(FSDP / ZeRO-3), and K-FAC's curvature (each layer's Kronecker factors
and cached inverses) is spread over it by a placement plan, so each device
holds about ``1/R`` of the factors (``kfac(..., mesh=mesh,
curvature_axis="data", param_shardings=shardings)``; with the parameters'
shardings the preconditioned update is laid out as the parameters, never
whole on one device). The step is one ``jax.jit``; JAX inserts the
collectives. It runs the model's forward pass once: the gradient and
K-FAC's statistics come from one linearisation (``update(...,
linearized=lin)``).

On the CPU the devices are simulated (``--devices 8`` sets
``--xla_force_host_platform_device_count``); ``--real-devices`` uses the
accelerators JAX finds instead. ``--compare`` also trains without a mesh
on one device and prints the largest relative difference of the
parameters.

Run::

  python examples/fsdp_gpt.py                         # 8 simulated devices
  python examples/fsdp_gpt.py --width 256 --blocks 4 --steps 20
  python examples/fsdp_gpt.py --real-devices          # e.g. 8 GPUs
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--devices", type=int, default=8,
                 help="simulated CPU devices (ignored with --real-devices)")
  p.add_argument("--real-devices", action="store_true",
                 help="use JAX's default devices instead of simulated ones")
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--blocks", type=int, default=2)
  p.add_argument("--context", type=int, default=16)
  p.add_argument("--vocab", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--inverse-period", type=int, default=3)
  p.add_argument("--compare", action="store_true",
                 help="also train on one device without a mesh")
  return p.parse_args(argv)


def setup_devices(args: argparse.Namespace) -> None:
  """Asks XLA for ``--devices`` CPU devices (before jax starts)."""
  if args.real_devices or "jax" in sys.modules:
    return
  flag = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def init_gpt(key, vocab: int, width: int, blocks: int, context: int) -> dict:
  """The parameters of a pre-LayerNorm GPT (MLP 4 × width)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  keys = iter(jax.random.split(key, 4 + 4 * blocks))

  def dense(a, b):
    return {"w": jax.random.normal(next(keys), (a, b)) / a ** 0.5,
            "b": jnp.zeros((b,))}

  def norm():
    return {"scale": jnp.ones((width,)), "bias": jnp.zeros((width,))}

  return {
      "wte": 0.02 * jax.random.normal(next(keys), (vocab, width)),
      "wpe": 0.02 * jax.random.normal(next(keys), (context, width)),
      "blocks": [{"ln1": norm(), "qkv": dense(width, 3 * width),
                  "proj": dense(width, width), "ln2": norm(),
                  "up": dense(width, 4 * width),
                  "down": dense(4 * width, width)} for _ in range(blocks)],
      "ln_f": norm(), "head": dense(width, vocab)}


def make_loss(heads: int):
  """``loss(params, batch)``: next-token cross-entropy, the predictive
  distribution registered for K-FAC (the layers are found by ``scan``)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import kfac_jax_lite as kl  # pylint: disable=g-import-not-at-top

  def norm(p, x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

  def attend(p, x):
    b, t, d = x.shape
    q, k, v = jnp.split(x @ p["w"] + p["b"], 3, axis=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v).reshape(
        b, t, d)

  def loss(params, batch):
    x = params["wte"][batch["x"]] + params["wpe"][:batch["x"].shape[1]]
    for blk in params["blocks"]:
      h = attend(blk["qkv"], norm(blk["ln1"], x))
      x = x + h @ blk["proj"]["w"] + blk["proj"]["b"]
      h = jax.nn.gelu(norm(blk["ln2"], x) @ blk["up"]["w"] + blk["up"]["b"])
      x = x + h @ blk["down"]["w"] + blk["down"]["b"]
    logits = norm(params["ln_f"], x) @ params["head"]["w"] + (
        params["head"]["b"])
    logits = logits.reshape(-1, logits.shape[-1])
    y = batch["y"].reshape(-1)
    kl.register_categorical_predictive_distribution(logits, y)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return loss


def batches(seed: int, steps: int, batch_size: int, context: int,
            vocab: int) -> list:
  """Synthetic token windows (a repeating pattern plus noise)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    start = rng.integers(0, vocab, (batch_size, 1))
    ids = (start + np.arange(context + 1)[None] * 3) % vocab
    noise = rng.random(ids.shape) < 0.1
    ids = np.where(noise, rng.integers(0, vocab, ids.shape), ids)
    out.append({"x": ids[:, :-1].astype(np.int32),
                "y": ids[:, 1:].astype(np.int32)})
  return out


def fsdp_shardings(params, mesh, axis: str):
  """Each leaf split over ``axis`` on its first axis the axis size
  divides (replicated where none does)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  size = mesh.shape[axis]

  def one(x):
    for i, n in enumerate(x.shape):
      if n % size == 0:
        return NamedSharding(mesh, P(*([None] * i + [axis])))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, params)


def train(args: argparse.Namespace, mesh=None) -> dict:
  """``--steps`` steps of ``kfac`` (FSDP and sharded curvature over
  ``mesh``'s ``data`` axis; without a mesh, one device)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import kfac_jax_lite as kl  # pylint: disable=g-import-not-at-top

  params = init_gpt(jax.random.PRNGKey(0), args.vocab, args.width,
                    args.blocks, args.context)
  data = batches(1, args.steps, args.batch_size, args.context, args.vocab)
  loss_fn = make_loss(args.heads)
  collection = kl.scan(loss_fn, params, data[0])
  kw, shardings = {}, None
  if mesh is not None:
    shardings = fsdp_shardings(params, mesh, "data")
    params = jax.device_put(params, shardings)
    kw = {"mesh": mesh, "curvature_axis": "data",
          "param_shardings": shardings}
  tx = kl.kfac(args.lr, collection, damping=1e-2,
               inverse_update_period=args.inverse_period, **kw)

  est = kl.FisherEstimator(collection)

  @jax.jit
  def step(params, state, batch):
    # One forward pass for the gradient and K-FAC's statistics: with
    # batch= K-FAC would run a second one, and hold its activations too.
    lin = est.linearize(params, batch)
    loss, grads = lin.loss, lin.gradient()
    updates, state = tx.update(grads, state, params, linearized=lin)
    params = optax.apply_updates(params, updates)
    if shardings is not None:
      params = jax.lax.with_sharding_constraint(params, shardings)
    return params, state, loss

  state = jax.jit(tx.init)(params)
  losses = []
  for b in data:
    if mesh is not None:
      b = jax.device_put(b, NamedSharding(mesh, P("data")))
    params, state, loss = step(params, state, b)
    losses.append(float(loss))
  out = {"params": params, "losses": losses, "state": state}
  if mesh is not None and isinstance(state.inner[0].estimator,
                                     kl.ShardedState):
    rows = state.inner[0].estimator.rows.values()
    out["curvature_bytes_per_device"] = max(
        sum(s.data.nbytes for x in rows for s in x.addressable_shards
            if s.device == d) for d in mesh.devices.flat)
    plan = kl.curvature_plan(kl.FisherEstimator(collection), mesh, "data")
    out["curvature_bytes"] = sum(u.nbytes for u in plan.units)
    out["plan"] = plan.describe()
  out["params"] = jax.tree.map(np.asarray, out["params"])
  return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
  args = parse_args(argv)
  setup_devices(args)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("data",))
  print(f"{len(devices)} {devices[0].platform} devices; GPT width "
        f"{args.width}, {args.blocks} blocks, batch {args.batch_size}")
  out = train(args, mesh)
  print(out["plan"])
  total, mine = out["curvature_bytes"], out["curvature_bytes_per_device"]
  print(f"curvature: {total / 2**20:.2f} MiB in all, at most "
        f"{mine / 2**20:.2f} MiB per device ({mine * mesh.size / total:.3f}"
        " x total / devices)")
  print("losses: " + " ".join(f"{x:.4f}" for x in out["losses"]))
  if args.compare:
    with jax.default_device(devices[0]):
      ref = train(args)
    err = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
              for a, b in zip(jax.tree.leaves(out["params"]),
                              jax.tree.leaves(ref["params"])))
    out["max_relative_difference"] = err
    print(f"one device, no mesh: largest relative difference {err:.2e}")
  return out


if __name__ == "__main__":
  main()
