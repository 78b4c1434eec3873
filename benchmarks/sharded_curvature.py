"""Sharded curvature against replicated, on simulated CPU devices.

The GPT of ``examples/fsdp_gpt.py`` (FSDP parameters, the batch split over
the same ``data`` axis) at ``--width`` (default GPT-2-medium: 1024, 16
heads, MLP 4096, 4 blocks, context 128), three programs compiled for
``--devices`` devices:

* ``adamw``: ``optax.adamw`` on the FSDP parameters;
* ``replicated``: ``kfac`` with every device holding all the curvature;
* ``sharded``: ``kfac(..., mesh=mesh, curvature_axis="data",
  param_shardings=<the FSDP shardings>)``, its statistics from
  ``update(..., batch=batch)`` (a second forward pass over the batch);
* ``sharded-1pass``: the same transform given the gradient's own
  linearisation, ``update(lin.gradient(), ..., linearized=lin)`` (one
  forward pass; the step ``examples/fsdp_gpt.py`` runs).

It prints, per device: the curvature bytes (the sharded state's from its
addressable shards; the replicated state's from its shapes, as every
device holds all of it), the compiled step's peak from
``compiled.memory_analysis()`` (arguments + outputs + temporaries -
aliased), and the refresh's flops from the compiled refresh program's
``cost_analysis()`` and its peak (the state donated, as in a step).
Nothing at ``--width`` is run (only compiled and the sharded state
initialised); the wall-clock of a step with a refresh is
measured at ``--run-width`` (default 256), sharded and replicated
alternating in one process, median of ``--repeats``.

Run::

  python benchmarks/sharded_curvature.py
  python benchmarks/sharded_curvature.py --width 256 --blocks 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--width", type=int, default=1024)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--blocks", type=int, default=4)
  p.add_argument("--context", type=int, default=128)
  p.add_argument("--vocab", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--run-width", type=int, default=256)
  p.add_argument("--repeats", type=int, default=5)
  return p.parse_args(argv)


def setup(gpt, args, width, mesh):
  """Abstract FSDP params, a batch, the collection and the loss."""
  import jax  # pylint: disable=g-import-not-at-top
  import kfac_jax_lite as kl  # pylint: disable=g-import-not-at-top
  params = jax.eval_shape(lambda: gpt.init_gpt(
      jax.random.PRNGKey(0), args.vocab, width, args.blocks, args.context))
  batch = gpt.batches(0, 1, args.batch_size, args.context, args.vocab)[0]
  loss = gpt.make_loss(args.heads)
  collection = kl.scan(loss, params, batch)
  shardings = gpt.fsdp_shardings(params, mesh, "data")
  return params, batch, loss, collection, shardings


def programs(args, gpt, width, mesh):
  """``{name: (tx, step, abstract args)}`` and the shared setup."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import kfac_jax_lite as kl  # pylint: disable=g-import-not-at-top
  params, batch, loss, c, shardings = setup(gpt, args, width, mesh)
  sharded = kl.kfac(1e-3, c, inverse_update_period=1, mesh=mesh,
                    curvature_axis="data", param_shardings=shardings)
  txs = {"adamw": optax.adamw(1e-3),
         "replicated": kl.kfac(1e-3, c, inverse_update_period=1),
         "sharded": sharded, "sharded-1pass": sharded}
  est = kl.FisherEstimator(c)
  out = {}
  for name, tx in txs.items():
    def step(params, state, batch, tx=tx, name=name):
      if name == "sharded-1pass":
        lin = est.linearize(params, batch)
        grads, kw = lin.gradient(), {"linearized": lin}
      else:
        grads = jax.grad(loss)(params, batch)
        kw = {} if name == "adamw" else {"batch": batch}
      updates, state = tx.update(grads, state, params, **kw)
      return jax.lax.with_sharding_constraint(
          optax.apply_updates(params, updates), shardings), state
    out[name] = (tx, jax.jit(step, donate_argnums=(0, 1)))
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=s), params, shardings)
  batch_sharding = NamedSharding(mesh, P("data"))
  return out, abstract, batch, batch_sharding, c


def peak(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes
          + m.temp_size_in_bytes - m.alias_size_in_bytes)


def measure_memory(args, gpt, mesh):
  """Per device: curvature bytes, step peak, refresh flops."""
  import jax  # pylint: disable=g-import-not-at-top
  import kfac_jax_lite as kl  # pylint: disable=g-import-not-at-top
  from kfac_jax_lite import sharded  # pylint: disable=g-import-not-at-top
  progs, params, batch, bs, c = programs(args, gpt, args.width, mesh)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=bs), batch)
  rows = {}
  for name, (tx, step) in progs.items():
    state = jax.eval_shape(tx.init, params)
    rows[name] = {"peak": peak(step.lower(params, state, batch).compile())}
  est = kl.FisherEstimator(c)
  sh = sharded.place(est, mesh, "data")
  total = sum(u.nbytes for u in sh.plan.units)
  rows["replicated"]["curvature"] = total
  state = jax.jit(sh.init)(params)  # Allocated: each device its row.
  rows["sharded"]["curvature"] = max(
      sum(s.data.nbytes for x in state.rows.values()
          for s in x.addressable_shards if s.device == d)
      for d in mesh.devices.flat)
  del state
  for name, e in (("replicated", est), ("sharded", sh)):
    s = jax.eval_shape(e.init, params)
    # One compile for both figures: donating the state changes the
    # buffers' aliasing, not the flops.
    refresh = jax.jit(e.update_cache, donate_argnums=0).lower(s).compile()
    cost = refresh.cost_analysis()
    if cost is None:
      raise RuntimeError(f"{name}: XLA gave no cost analysis on "
                         f"{jax.default_backend()}.")
    rows[name]["refresh_flops"] = float(cost.get("flops", 0.0))
    rows[name]["refresh_peak"] = peak(refresh)
  # The one-pass step holds the same state and runs the same refresh.
  rows["sharded-1pass"].update(
      {k: v for k, v in rows["sharded"].items() if k != "peak"})
  return rows, total, sh.describe()


def measure_time(args, gpt, mesh):
  """Median seconds of a step with a refresh, sharded and replicated."""
  import jax  # pylint: disable=g-import-not-at-top
  progs, abstract, batch, bs, _ = programs(args, gpt, args.run_width, mesh)
  params = jax.jit(lambda: gpt.init_gpt(
      jax.random.PRNGKey(0), args.vocab, args.run_width, args.blocks,
      args.context), out_shardings=jax.tree.map(lambda a: a.sharding,
                                                abstract))()
  batch = jax.device_put(batch, bs)
  runs = {}
  for name in ("replicated", "sharded", "sharded-1pass"):
    tx, step = progs[name]
    p = jax.tree.map(lambda x: x.copy(), params)
    runs[name] = [step, p, jax.jit(tx.init)(p), []]
  for i in range(args.repeats + 2):
    for run in runs.values():
      step, p, s, times = run
      t = time.perf_counter()
      p, s = step(p, s, batch)
      jax.block_until_ready((p, s))
      if i > 1:  # The first calls compile (init's and the step's layout).
        times.append(time.perf_counter() - t)
      run[1], run[2] = p, s
  return {name: statistics.median(r[3]) for name, r in runs.items()}


def main(argv=None):
  args = parse_args(argv)
  if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_"
                               f"force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  # benchmarks/ is this script's path; step_time imports jax.
  from step_time import load_example  # pylint: disable=g-import-not-at-top
  gpt = load_example("fsdp_gpt")
  mesh = Mesh(np.array(jax.devices()[:args.devices]), ("data",))
  r = args.devices
  rows, total, plan = measure_memory(args, gpt, mesh)
  print(plan)
  mib = lambda n: f"{n / 2**20:9.1f}"  # noqa: E731
  print(f"\nGPT width {args.width}, {args.blocks} blocks, context "
        f"{args.context}, batch {args.batch_size}, {r} devices; per device "
        f"(MiB); total curvature {total / 2**20:.1f} MiB, total/{r} = "
        f"{total / r / 2**20:.1f}")
  print(f"{'program':<14}{'curvature':>10}{'step peak':>10}"
        f"{'refresh GFLOP':>15}{'refresh peak':>14}")
  for name, row in rows.items():
    print(f"{name:<14}{mib(row['curvature']) if 'curvature' in row else '-':>10}"
          f"{mib(row['peak']):>10}"
          f"{row.get('refresh_flops', 0) / 1e9 if 'refresh_flops' in row else 0:>15.3f}"
          f"{mib(row['refresh_peak']) if 'refresh_peak' in row else '-':>14}")
  sh, rep, adam = rows["sharded"], rows["replicated"], rows["adamw"]
  print(f"sharded curvature / (total/{r}): "
        f"{sh['curvature'] * r / total:.3f}")
  for name in ("sharded", "sharded-1pass"):
    over = rows[name]["peak"] - adam["peak"]
    print(f"{name} peak - adamw peak: {over / 2**20:.1f} MiB = "
          f"{over * r / total:.3f} x total/{r}")
  print(f"sharded refresh flops / (replicated/{r}): "
        f"{sh['refresh_flops'] * r / rep['refresh_flops']:.3f}")
  times = measure_time(args, gpt, mesh)
  print(f"step with refresh at width {args.run_width}: replicated "
        f"{times['replicated']:.3f} s, sharded {times['sharded']:.3f} s "
        f"(ratio {times['sharded'] / times['replicated']:.3f}), one pass "
        f"{times['sharded-1pass']:.3f} s (ratio "
        f"{times['sharded-1pass'] / times['replicated']:.3f})")
  return rows, times


if __name__ == "__main__":
  main()
