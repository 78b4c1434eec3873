"""A tanh RNN on sequential MNIST (28 rows of 28 pixels), K-FAC against Adam.

The cell, ``h_t = tanh(x_t W_in + b_in + h_{t-1} W_rec)``, runs under
``lax.scan`` over the 28 rows; the logits come from the last hidden state.
Both products are tagged with :func:`kfac_jax_lite.register_dense` *inside*
the scanned cell, so :func:`kfac_jax_lite.scan` sees each of ``W_in`` and
``W_rec`` used 28 times per example: a multi-use dense layer. Its
curvature approximation is chosen with ``--approx``:

* ``kron_indep`` (default): uses treated as independent (one Kronecker
  factor pair over all time steps);
* ``kron_series_1`` / ``kron_series_2``: the linear-Gaussian time-series
  models of Martens, Ba & Johnson (2018), options 1 and 2.

The optimizer is :func:`kfac_jax_lite.kfac_optimizer` (adaptive damping,
learning rate and momentum; the same recipe as TF K-FAC's RNN example,
initial damping from ``--kfac-damping``) against ``optax.adam`` on the same
batches.

Run::

  python examples/rnn_sequential_mnist.py                # ~20-40 s on 2 CPUs
  python examples/rnn_sequential_mnist.py --approx kron_series_1
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "data", "mnist.npz")
APPROXES = ("kron_indep", "kron_series_1", "kron_series_2")

# Where JAX keeps compiled programs across runs (XDG cache directory).
DEFAULT_COMPILATION_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
    "kfac_jax_lite", "jax")


def use_compilation_cache(path: Optional[str]) -> None:
  """Turns on JAX's persistent compilation cache in ``path`` (None: off).

  A second run of the script loads its compiled steps from there instead
  of compiling them again (docs/performance.md, *Paying the compile
  once*). Every program is kept, however short its compile
  (``jax_persistent_cache_min_compile_time_secs`` 0). Call it before the
  first computation.
  """
  if path:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# ---------------------------------------------------------------------------
# Model and loss.
# ---------------------------------------------------------------------------


def init_params(key, hidden: int, inputs: int = 28, classes: int = 10
                ) -> dict:
  """LeCun-normal input and output kernels, scaled-orthogonal recurrence."""
  k_in, k_rec, k_out = jax.random.split(key, 3)
  return {
      "w_in": jax.random.normal(k_in, (inputs, hidden)) / math.sqrt(inputs),
      "b_in": jnp.zeros((hidden,)),
      "w_rec": 0.9 * jax.nn.initializers.orthogonal()(k_rec,
                                                      (hidden, hidden)),
      "w_out": jax.random.normal(k_out, (hidden, classes)) / math.sqrt(
          hidden),
      "b_out": jnp.zeros((classes,))}


def logits_fn(params: dict, images: jnp.ndarray) -> jnp.ndarray:
  """Runs the RNN over the rows of ``images [B, 28, 28]``; returns logits.

  Inside ``lax.scan`` each step tags its two products, so the scanner sees
  ``w_in`` and ``w_rec`` used once per step.
  """
  rows = jnp.swapaxes(images, 0, 1)                     # [28, B, 28]
  h0 = jnp.zeros((images.shape[0], params["w_rec"].shape[0]), images.dtype)

  def cell(h, x):
    a_in = kfac_jax_lite.register_dense(x @ params["w_in"] + params["b_in"],
                                        x, params["w_in"], params["b_in"])
    a_rec = kfac_jax_lite.register_dense(h @ params["w_rec"], h,
                                         params["w_rec"])
    h = jnp.tanh(a_in + a_rec)
    return h, None

  h, _ = lax.scan(cell, h0, rows)
  out = h @ params["w_out"] + params["b_out"]
  return kfac_jax_lite.register_dense(out, h, params["w_out"],
                                      params["b_out"])


def loss_fn(params: dict, batch: dict) -> jnp.ndarray:
  """Mean softmax cross-entropy of the RNN's logits (loss tagged)."""
  logits = logits_fn(params, batch["image"])
  logits = kfac_jax_lite.register_categorical_predictive_distribution(
      logits, batch["label"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["label"]).mean()


# ---------------------------------------------------------------------------
# Data and training.
# ---------------------------------------------------------------------------


def load_mnist(path: str) -> dict:
  """Train/test images as float32 ``[N, 28, 28]`` in ``[0, 1]``, labels."""
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"MNIST file {path!r} not found. The repository ships it at "
        f"{DEFAULT_DATA!r}; pass --data PATH to use another copy.")
  with np.load(path) as d:
    return {"x_train": d["x_train"].astype(np.float32) / 255.0,
            "y_train": d["y_train"].astype(np.int32),
            "x_test": d["x_test"].astype(np.float32) / 255.0,
            "y_test": d["y_test"].astype(np.int32)}


def batches(data: dict, steps: int, batch_size: int, seed: int):
  """``steps`` shuffled batches (reshuffled every epoch)."""
  rng = np.random.default_rng(seed)
  n = len(data["x_train"])
  order, pos = rng.permutation(n), 0
  for _ in range(steps):
    if pos + batch_size > n:
      order, pos = rng.permutation(n), 0
    idx = order[pos:pos + batch_size]
    pos += batch_size
    yield {"image": data["x_train"][idx], "label": data["y_train"][idx]}


def make_step(tx, collection=None) -> Callable:
  """Jitted ``step(params, state, batch, rng)``; K-FAC when ``collection``.

  ``kfac_optimizer`` gets the statistics from ``value_grad_and_stats`` and
  the batch for its quadratic model.
  """
  vgs = (kfac_jax_lite.value_grad_and_stats(loss_fn, collection)
         if collection is not None else None)

  def step(params, state, batch, rng):
    if vgs is None:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params)
    else:
      loss, grads, stats = vgs(params, batch, rng)
      updates, state = tx.update(grads, state, params, stats=stats,
                                 batch=batch)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step)


def train(name: str, step: Callable, params, state, data: dict, args,
          describe: Callable = lambda s: "") -> dict:
  """Runs ``args.steps`` steps; returns per-step losses and timings."""
  key = jax.random.PRNGKey(args.seed)
  losses, t0, first_call = [], time.perf_counter(), None
  for k, batch in enumerate(batches(data, args.steps, args.batch_size,
                                    args.seed)):
    params, state, loss = step(params, state, batch,
                               jax.random.fold_in(key, k))
    losses.append(float(loss))
    if first_call is None:
      first_call = time.perf_counter() - t0
    if args.log_every and (k + 1) % args.log_every == 0:
      print(f"  [{name}] step {k + 1:5d}/{args.steps}  loss "
            f"{np.mean(losses[-args.log_every:]):.4f}  "
            f"{time.perf_counter() - t0:6.1f}s{describe(state)}", flush=True)
  predict = jax.jit(lambda p, x: jnp.argmax(logits_fn(p, x), -1))
  n = min(args.eval_examples, len(data["x_test"]))
  accuracy = float(jnp.mean(predict(params, data["x_test"][:n])
                            == data["y_test"][:n]))
  return {"losses": losses, "final_loss": float(np.mean(losses[-20:])),
          "test_accuracy": accuracy, "first_call_s": first_call,
          "seconds": time.perf_counter() - t0}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Train a tanh RNN on sequential MNIST with kfac_optimizer "
      "(multi-use dense layers) and with Adam.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA, help="path to mnist.npz")
  p.add_argument("--approx", choices=APPROXES, default="kron_indep",
                 help="curvature approximation of the recurrent layers")
  p.add_argument("--steps", type=int, default=200, help="steps per optimizer")
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--kfac-damping", type=float, default=1.0,
                 help="kfac_optimizer's initial damping")
  p.add_argument("--adam-lr", type=float, default=1e-3)
  p.add_argument("--eval-examples", type=int, default=10000)
  p.add_argument("--log-every", type=int, default=50,
                 help="progress line every N steps (0: never)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compilation-cache",
                 default=DEFAULT_COMPILATION_CACHE if argv is None else None,
                 help="JAX's persistent compilation cache directory: a "
                 "second run loads its compiled steps from it (on by "
                 "default from the command line; off for main(argv))")
  p.add_argument("--no-compilation-cache", dest="compilation_cache",
                 action="store_const", const=None,
                 help="compile everything afresh, keep nothing")
  args = p.parse_args(argv)
  for name in ("steps", "batch_size", "hidden", "eval_examples"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains with kfac_optimizer, then Adam, from the same initialisation.

  Returns:
    ``{"kfac": run, "adam": run, "layers": [(name, approx, uses)]}``; a
    run has ``losses`` (per step), ``final_loss`` (mean of the last 20),
    ``test_accuracy``, ``seconds`` and ``first_call_s``.
  """
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  data = load_mnist(args.data)
  params = init_params(jax.random.PRNGKey(args.seed), args.hidden)
  example = next(batches(data, 1, args.batch_size, args.seed))
  collection = kfac_jax_lite.scan(
      loss_fn, params, example,
      approximations={"fully_connected_multi": args.approx})
  print(collection.describe())
  print(f"\njax {jax.__version__} on {jax.devices()[0].platform}; "
        f"{args.steps} steps at batch {args.batch_size}\n", flush=True)

  kfac_tx = kfac_jax_lite.kfac_optimizer(collection,
                                         initial_damping=args.kfac_damping)
  adam_tx = optax.adam(args.adam_lr)
  describe = lambda s: (f"  damping {float(s.damping):.3g} lr "  # noqa: E731
                        f"{float(s.learning_rate):.3g} momentum "
                        f"{float(s.momentum):.3g}")
  results: dict[str, Any] = {"layers": [
      (layer.name, layer.approx, layer.num_uses)
      for layer in collection.layers]}
  for name, step, tx, extra in (
      ("kfac", make_step(kfac_tx, collection), kfac_tx,
       {"describe": describe}),
      ("adam", make_step(adam_tx), adam_tx, {})):
    run = train(name, step, params, tx.init(params), data, args, **extra)
    print(f"{name:>5}: final loss {run['final_loss']:.4f} (mean of last "
          f"20), test accuracy {run['test_accuracy']:.4f}; {args.steps} "
          f"steps in {run['seconds']:.1f}s (first call "
          f"{run['first_call_s']:.1f}s)\n", flush=True)
    results[name] = run
  k, a = results["kfac"], results["adam"]
  print(f"K-FAC ({args.approx}): loss {k['final_loss']:.4f}, accuracy "
        f"{k['test_accuracy']:.4f} | Adam: loss {a['final_loss']:.4f}, "
        f"accuracy {a['test_accuracy']:.4f}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
