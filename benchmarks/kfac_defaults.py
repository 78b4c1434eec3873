"""``kl.kfac(lr, collection)`` at its defaults against the best ``optax.adam``.

On three example models, with the examples' own model, data and step:

* ``equinox_cnn``: the Equinox convolutional autoencoder of
  ``examples/equinox_cnn.py`` (batch 1024, Equinox's ``filter_jit`` step,
  K-FAC given ``batch=``);
* ``mnist_autoencoder``: the deep autoencoder of the README
  (``examples/mnist_autoencoder.py``, batch 500, L2 1e-5 in the loss);
* ``flax_cnn``: the flax linen CNN classifier of
  ``examples/flax_cnn_classifier.py`` (batch 128).

Adam runs at each of ``--adam-lrs`` (3e-3, 1e-2, 3e-2), the best one (the
lowest final loss) sets the target: its loss after ``--steps`` (400) steps
and its seconds. ``kl.kfac(lr, collection)``, nothing else set, then runs
at each of ``--kfac-lrs`` (1e-3, 1e-2, 1e-1) on the same batches. The loss
of a step is its batch's loss before the update, smoothed over the last
``--window`` (25) steps; seconds run from the first call, compilation
included. Per K-FAC run the table gives the final loss, the first step
whose smoothed loss reaches Adam's final loss and the seconds to it, and
whether the run diverged (a non-finite loss, or a final loss above the
first step's). Every run of a model happens in this one process, one after
the other, so load from other processes shifts their seconds: compare the
seconds of a row with those of Adam printed beside it, and repeat.

``--approx kind=name`` passes ``approximations={kind: name}`` to
``kl.scan`` (e.g. ``--approx conv=kron_reduce``, KFC-reduce for every
convolution). ``--option name=value`` passes a keyword to ``kl.kfac`` (e.g.
``--option norm_constraint=none`` or ``--option damping=0.01``) to see
what a default is worth; ``--stats-fraction f`` is ``--option
stats_fraction=f``, for the Equinox autoencoder only (the other two steps
give ``kl.kfac`` the statistics of ``value_grad_and_stats``, which take
their own ``stats_fraction``).

  python benchmarks/kfac_defaults.py                    # all three models
  python benchmarks/kfac_defaults.py --models equinox_cnn --steps 100
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import time

import jax
import numpy as np
import optax

import kfac_jax_lite as kl
# benchmarks/ is this script's path (tests/test_kfac_defaults.py puts it
# there too):
from step_time import load_example

MODELS = ("equinox_cnn", "mnist_autoencoder", "flax_cnn")
BATCH_SIZES = {"equinox_cnn": 1024, "mnist_autoencoder": 500,
               "flax_cnn": 128}


def equinox_cnn(batch_size, steps, seed, approximations=None):
  """The Equinox autoencoder: its model, data, batches and step."""
  import equinox as eqx  # pylint: disable=import-outside-toplevel
  ex = load_example("equinox_cnn")
  data = ex.load_mnist(ex.DEFAULT_DATA)
  model = ex.ConvAutoencoder(jax.random.PRNGKey(seed))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  stream = ex.batches(data, batch_size, seed)
  batches = [next(stream) for _ in range(steps)]
  collection = kl.scan(ex.make_loss_fn(static), params, batches[0],
                       approximations=approximations)

  def make_step(tx, kfac):
    del kfac  # The example's step gives K-FAC the batch, Adam ignores it.
    step = ex.make_step(optax.with_extra_args_support(tx))
    return lambda m, s, b, k: step(m, s, b)

  return model, lambda m: eqx.filter(m, eqx.is_inexact_array), collection, (
      make_step, batches)


def mnist_autoencoder(batch_size, steps, seed, approximations=None):
  """The README's deep autoencoder; K-FAC's statistics from the pass
  that gives the gradient (``value_grad_and_stats``)."""
  ae = load_example("mnist_autoencoder")
  images = ae.load_images(ae.DEFAULT_DATA)
  params = ae.init_params(jax.random.PRNGKey(seed), ae.layer_sizes(1.0))
  batches = list(ae.batch_stream(images, steps, batch_size, seed))
  collection = kl.scan(ae.loss_fn, params, batches[0],
                       approximations=approximations)
  vgs = kl.value_grad_and_stats(ae.loss_fn, collection)

  def make_step(tx, kfac):
    def step(params, state, batch, rng):
      if kfac:
        loss, grads, stats = vgs(params, batch, rng)
        updates, state = tx.update(grads, state, params, stats=stats)
      else:
        loss, grads = jax.value_and_grad(ae.loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss
    return jax.jit(step)

  return params, lambda p: p, collection, (make_step, batches)


def flax_cnn(batch_size, steps, seed, approximations=None):
  """The flax CNN classifier: its model, data, batches and step."""
  cnn = load_example("flax_cnn_classifier")
  data = cnn.load_mnist(cnn.DEFAULT_DATA)
  model = cnn.CNN()
  loss_fn = cnn.make_loss_fn(model)
  batches = list(cnn.batches(data, steps, batch_size, seed))
  params = model.init(jax.random.PRNGKey(seed),
                      batches[0]["image"])["params"]
  collection = kl.scan(loss_fn, params, batches[0],
                       approximations=approximations)

  def make_step(tx, kfac):
    return cnn.make_step(loss_fn, tx, collection if kfac else None)

  return params, lambda p: p, collection, (make_step, batches)


def smoothed(losses, window):
  """Trailing mean over ``window`` steps (shorter at the start)."""
  c = np.cumsum(np.concatenate([[0.0], losses]))
  idx = np.arange(1, len(losses) + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def train(step, model, tx, to_params, batches, seed):
  """Losses and seconds since the first call (included) per step."""
  state = tx.init(to_params(model))
  key = jax.random.PRNGKey(seed)
  losses, times = [], []
  t0 = time.perf_counter()
  for k, batch in enumerate(batches):
    model, state, loss = step(model, state, batch, jax.random.fold_in(key, k))
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    if not math.isfinite(losses[-1]):
      break
  return np.array(losses), np.array(times)


def summary(losses, times, window, target=None):
  """Final smoothed loss, divergence, and when ``target`` was reached."""
  s = smoothed(losses, window)
  final = float(s[-1]) if np.all(np.isfinite(losses)) else math.inf
  diverged = not math.isfinite(final) or final > losses[0]
  out = {"final": final, "first": float(losses[0]), "diverged": diverged,
         "seconds": float(times[-1]), "step": None, "at_s": None}
  if target is not None:
    hit = np.nonzero(s <= target)[0]
    if len(hit):
      out["step"], out["at_s"] = int(hit[0]) + 1, float(times[hit[0]])
  return out


def run_model(name, args, options):
  """Adam over its grid, then ``kl.kfac`` over its grid; the rows."""
  bs = args.batch_size or BATCH_SIZES[name]
  model, to_params, collection, (make_step, batches) = globals()[name](
      bs, args.steps, args.seed, args.approx or None)
  adam = {}
  for lr in args.adam_lrs:
    tx = optax.adam(lr)
    adam[lr] = summary(*train(make_step(tx, False), model, tx, to_params,
                              batches, args.seed), args.window)
    print(f"  [{name}] adam {lr:g}: {adam[lr]['final']:.4g} in "
          f"{adam[lr]['seconds']:.1f}s", flush=True)
  best = min(adam, key=lambda lr: adam[lr]["final"])
  target = adam[best]["final"]
  fraction = getattr(args, "stats_fraction", None)  # Checked in parse_args.
  if fraction is not None:
    options = {**options, "stats_fraction": fraction}
  kfac = {}
  for lr in args.kfac_lrs:
    tx = kl.kfac(lr, collection, **options)
    kfac[lr] = summary(*train(make_step(tx, True), model, tx, to_params,
                              batches, args.seed), args.window, target)
    print(f"  [{name}] kfac {lr:g}: {kfac[lr]['final']:.4g}, reached at "
          f"step {kfac[lr]['step']} ({kfac[lr]['at_s']}s) of "
          f"{kfac[lr]['seconds']:.1f}s", flush=True)
  return bs, best, adam, kfac


def print_table(name, bs, best, adam, kfac, args):
  a = adam[best]
  print(f"\n{name} (batch {bs}, {args.steps} steps, loss = mean of the "
        f"last {args.window} batch losses; load {os.getloadavg()[0]:.1f})")
  print(f"  adam: best lr {best:g} of {', '.join(f'{x:g}' for x in adam)}"
        f" -> loss {a['final']:.4g} in {a['seconds']:.1f}s")
  print(f"  {'kfac lr':>9} {'final loss':>11} {'diverged':>9} "
        f"{'reached at':>11} {'seconds':>8} {'/ adam s':>9}")
  for lr, r in kfac.items():
    at = "-" if r["step"] is None else f"step {r['step']}"
    sec = "-" if r["at_s"] is None else f"{r['at_s']:.1f}"
    ratio = "-" if r["at_s"] is None else f"{r['at_s'] / a['seconds']:.2f}"
    print(f"  {lr:>9g} {r['final']:>11.4g} {str(r['diverged']):>9} "
          f"{at:>11} {sec:>8} {ratio:>9}")


def parse_option(text):
  name, _, value = text.partition("=")
  if not name or not value:
    raise argparse.ArgumentTypeError(
        f"--option {text!r}: expected name=value, e.g. damping=0.01")
  if value.lower() == "none":
    return name, None
  return name, ast.literal_eval(value)


def parse_approx(text):
  kind, _, approx = text.partition("=")
  if not kind or not approx:
    raise argparse.ArgumentTypeError(
        f"--approx {text!r}: expected kind=approximation, e.g. "
        "conv=kron_reduce")
  return kind, approx


def parse_args(argv):
  p = argparse.ArgumentParser(
      description=(__doc__ or "").split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
  p.add_argument("--models", default=",".join(MODELS),
                 help=f"comma-separated subset of {', '.join(MODELS)}")
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--batch-size", type=int, default=None,
                 help="override every model's batch size")
  p.add_argument("--adam-lrs", type=floats, default=[3e-3, 1e-2, 3e-2])
  p.add_argument("--kfac-lrs", type=floats, default=[1e-3, 1e-2, 1e-1])
  p.add_argument("--window", type=int, default=25)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--option", type=parse_option, action="append",
                 default=[], help="name=value keyword for kl.kfac")
  p.add_argument("--approx", type=parse_approx, action="append",
                 default=[], help="kind=approximation for kl.scan's "
                 "approximations (e.g. conv=kron_reduce)")
  p.add_argument("--stats-fraction", type=float, default=None,
                 help="kl.kfac's stats_fraction (equinox_cnn only: the "
                 "other steps take their statistics from "
                 "value_grad_and_stats)")
  args = p.parse_args(argv)
  args.models = args.models.split(",")
  args.approx = dict(args.approx)
  if args.stats_fraction is not None and args.models != ["equinox_cnn"]:
    p.error(f"--stats-fraction {args.stats_fraction}: only with --models "
            "equinox_cnn, whose step gives kl.kfac the batch")
  bad = [m for m in args.models if m not in MODELS]
  if bad:
    p.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
  return args


def main(argv=None):
  args = parse_args(argv)
  options = dict(args.option)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs; kl.kfac options: {options or 'defaults'}"
        f"; approximations: {args.approx or 'defaults'}",
        flush=True)
  results = {}
  for name in args.models:
    results[name] = bs, best, adam, kfac = run_model(name, args, options)
    print_table(name, bs, best, adam, kfac, args)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
