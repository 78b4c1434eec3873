"""kfac_optimizer against optax.adam on the bundled MNIST.

A 3-layer tanh MLP (784-256-256-10), batch 500, 200 steps. Adam runs at each
learning rate of {1e-4, 3e-4, 1e-3, 3e-3}; the best (lowest final training
loss) is compared with kfac_optimizer at its defaults. Training loss is the
loss on each step's batch, smoothed over the last 20 steps; both optimizers
see the same batches. Writes a PNG of both curves when matplotlib exists.

  python benchmarks/optimizer_vs_adam.py [--steps 200] [--out curves.png]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite as kl
# benchmarks/ is this script's path.
from step_time import blas_environment  # isort: skip

DATA = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data" / (
    "mnist.npz")


def init_params(key, sizes):
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, k = jax.random.split(key)
    params[f"dense{i}"] = {"w": jax.random.normal(k, (a, b)) / np.sqrt(a),
                           "b": jnp.zeros(b)}
  return params


def loss_fn(params, batch):
  x, y = batch
  n = len(params)
  for i in range(n):
    p = params[f"dense{i}"]
    s = kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])
    x = jnp.tanh(s) if i < n - 1 else s
  kl.register_categorical_predictive_distribution(x, y)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, y))


def batches(steps, batch_size, seed=0):
  data = np.load(DATA)
  x = data["x_train"].reshape(-1, 784).astype(np.float32) / 255.0
  y = data["y_train"].astype(np.int32)
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    idx = rng.choice(len(x), batch_size, replace=False)
    out.append((jnp.asarray(x[idx]), jnp.asarray(y[idx])))
  return out


def train(tx, params, data, needs_batch):
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    kw = {"batch": batch} if needs_batch else {}
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  start = time.perf_counter()
  for i, batch in enumerate(data):
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
    if (i + 1) % 50 == 0:
      print(f"    step {i + 1:4d}  loss {np.mean(losses[-20:]):.4f}",
            flush=True)
  return np.array(losses), time.perf_counter() - start, state


def smooth(losses, window=20):
  return float(np.mean(losses[-window:]))


def main(argv=None):
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch-size", type=int, default=500)
  parser.add_argument("--out", default="optimizer_vs_adam.png")
  args = parser.parse_args(argv)

  data = batches(args.steps, args.batch_size)
  params = init_params(jax.random.PRNGKey(0), [784, 256, 256, 10])
  curves = {}
  for lr in (1e-4, 3e-4, 1e-3, 3e-3):
    print(f"adam lr={lr:g}", flush=True)
    curves[f"adam {lr:g}"] = train(optax.adam(lr), params, data, False)
  collection = kl.scan(loss_fn, params, data[0])
  print("kfac_optimizer (defaults)", flush=True)
  curves["kfac_optimizer"] = train(kl.kfac_optimizer(collection), params,
                                   data, True)

  best = min((k for k in curves if k.startswith("adam")),
             key=lambda k: smooth(curves[k][0]))
  print(f"\n{blas_environment()}")
  print(f"\n{'optimizer':<16} {'final loss (last 20)':>21} {'seconds':>8}")
  for name, (losses, secs, _) in curves.items():
    mark = "  <- best adam" if name == best else ""
    print(f"{name:<16} {smooth(losses):>21.4f} {secs:>8.1f}{mark}")
  k_loss, a_loss = smooth(curves["kfac_optimizer"][0]), smooth(
      curves[best][0])
  state = curves["kfac_optimizer"][2]
  if not isinstance(state, kl.KFACOptimizerState):
    raise TypeError(f"kfac_optimizer's state is a {type(state).__name__}, "
                    "not a KFACOptimizerState")
  print(f"\nkfac_optimizer final damping {float(state.damping):.3g}, "
        f"lr {float(state.learning_rate):.3g}, momentum "
        f"{float(state.momentum):.3g}")
  print(f"kfac_optimizer {k_loss:.4f} vs best adam ({best}) {a_loss:.4f}: "
        f"{'K-FAC lower' if k_loss < a_loss else 'Adam lower'}")
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return curves
  fig, ax = plt.subplots(figsize=(7, 4))
  for name in ("kfac_optimizer", best):
    ax.plot(curves[name][0], label=name)
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (batch)")
  ax.set_title("MNIST MLP 784-256-256-10, batch 500")
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  print(f"wrote {args.out}")
  return curves


if __name__ == "__main__":
  main()
