"""An untagged flax linen CNN on MNIST, trained with K-FAC and with Adam.

The model is plain linen (``nn.Conv``, ``nn.Dense``, ``nn.avg_pool``): no
layer tags. :func:`kfac_jax_lite.scan` recognises the convolutions and the
dense layers by itself (``auto_register=True``, the default) and
``collection.describe()`` prints what it found. Only the loss is tagged, as
a categorical predictive distribution over the logits.

Both optimizers see the same batches. K-FAC is :func:`kfac_jax_lite.kfac`
(fixed learning rate, damping and momentum; inverses refreshed every 5
steps) fed by :func:`kfac_jax_lite.value_grad_and_stats`.

Defaults: ``kfac`` learning rate 0.01, damping 0.01, momentum 0.5, picked
on 100 steps (seed 0) from learning rates ``{0.01, 0.02, 0.03, 0.05, 0.1}``
and dampings ``{0.01, 0.03, 0.1, 1}`` (not the full grid): 0.02 with damping
0.01 and 0.05 with 0.01 diverged; 0.01/0.01 reached the lowest loss.

Run::

  python examples/flax_cnn_classifier.py               # ~30-60 s on 2 CPUs
  python examples/flax_cnn_classifier.py --steps 500 --channels 32
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax_lite

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "data", "mnist.npz")

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
# Model and loss: no layer tags.
# ---------------------------------------------------------------------------


class CNN(nn.Module):
  """``conv3x3(c) - relu - pool - conv3x3(2c) - relu - pool - dense - dense``.

  Attributes:
    channels: filters of the first convolution (the second has twice as
      many).
    hidden: width of the dense hidden layer.
    num_classes: number of logits.
  """
  channels: int = 16
  hidden: int = 128
  num_classes: int = 10

  @nn.compact
  def __call__(self, images):
    x = images[..., None]                                  # [B, 28, 28, 1]
    for c in (self.channels, 2 * self.channels):
      x = nn.relu(nn.Conv(c, (3, 3), padding="SAME")(x))
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


def make_loss_fn(model: nn.Module) -> Callable:
  """Mean softmax cross-entropy; only the loss is tagged."""
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["image"])
    logits = kfac_jax_lite.register_categorical_predictive_distribution(
        logits, batch["label"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["label"]).mean()
  return loss_fn


# ---------------------------------------------------------------------------
# Data and training.
# ---------------------------------------------------------------------------


def load_mnist(path: str) -> dict:
  """Train/test images as float32 in ``[0, 1]`` and int32 labels."""
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


def make_step(loss_fn: Callable, tx, collection=None) -> Callable:
  """Jitted ``step(params, state, batch, rng)``; K-FAC when ``collection``."""
  vgs = (kfac_jax_lite.value_grad_and_stats(loss_fn, collection)
         if collection is not None else None)

  def step(params, state, batch, rng):
    if vgs is None:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params)
    else:
      loss, grads, stats = vgs(params, batch, rng)
      updates, state = tx.update(grads, state, params, stats=stats)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step)


def accuracy(model: nn.Module, params, images, labels,
             chunk: int = 2000) -> float:
  """Fraction of correct predictions, evaluated in chunks."""
  # apply returns the output alone (no mutable collections asked for).
  predict = jax.jit(lambda p, x: jnp.argmax(
      cast(jax.Array, model.apply({"params": p}, x)), axis=-1))
  correct = sum(int(jnp.sum(predict(params, images[i:i + chunk])
                            == labels[i:i + chunk]))
                for i in range(0, len(images), chunk))
  return correct / len(images)


def train(name: str, step: Callable, params, state, data: dict,
          args) -> dict:
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
            f"{time.perf_counter() - t0:6.1f}s", flush=True)
  return {"params": params, "losses": losses, "first_call_s": first_call,
          "seconds": time.perf_counter() - t0}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Train an untagged flax linen CNN on MNIST with K-FAC "
      "(automatic layer registration) and with Adam.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA, help="path to mnist.npz")
  p.add_argument("--steps", type=int, default=200, help="steps per optimizer")
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--channels", type=int, default=16,
                 help="filters of the first convolution")
  p.add_argument("--hidden", type=int, default=128,
                 help="width of the dense hidden layer")
  p.add_argument("--kfac-lr", type=float, default=0.01)
  p.add_argument("--kfac-damping", type=float, default=1e-2)
  p.add_argument("--kfac-momentum", type=float, default=0.5)
  p.add_argument("--adam-lr", type=float, default=1e-3)
  p.add_argument("--eval-examples", type=int, default=10000,
                 help="test images used for the accuracy")
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
  for name in ("steps", "batch_size", "channels", "hidden", "eval_examples"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains with K-FAC, then Adam; returns losses and test accuracies.

  Returns:
    ``{"kfac": run, "adam": run, "layers": [...]}``; a
    run has ``losses`` (per step), ``final_loss`` (mean of the last 20),
    ``test_accuracy``, ``seconds`` and ``first_call_s``; ``layers`` lists
    ``(name, kind, approx)`` of the collection K-FAC used.
  """
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  data = load_mnist(args.data)
  model = CNN(channels=args.channels, hidden=args.hidden)
  loss_fn = make_loss_fn(model)
  example = {"image": data["x_train"][:args.batch_size],
             "label": data["y_train"][:args.batch_size]}
  params = model.init(jax.random.PRNGKey(args.seed),
                      example["image"])["params"]
  collection = kfac_jax_lite.scan(loss_fn, params, example)  # auto_register
  print(collection.describe())
  print(f"\njax {jax.__version__} on {jax.devices()[0].platform}; "
        f"{args.steps} steps at batch {args.batch_size}\n", flush=True)

  kfac_tx = kfac_jax_lite.kfac(args.kfac_lr, collection,
                               damping=args.kfac_damping,
                               momentum=args.kfac_momentum,
                               inverse_update_period=5)
  adam_tx = optax.adam(args.adam_lr)
  results: dict[str, Any] = {"layers": [
      (layer.name, layer.kind, layer.approx) for layer in collection.layers]}
  n_eval = min(args.eval_examples, len(data["x_test"]))
  for name, step, tx in (
      ("kfac", make_step(loss_fn, kfac_tx, collection), kfac_tx),
      ("adam", make_step(loss_fn, adam_tx), adam_tx)):
    run = train(name, step, params, tx.init(params), data, args)
    run["final_loss"] = float(np.mean(run["losses"][-20:]))
    run["test_accuracy"] = accuracy(model, run.pop("params"),
                                    data["x_test"][:n_eval],
                                    data["y_test"][:n_eval])
    print(f"{name:>5}: final loss {run['final_loss']:.4f} (mean of last "
          f"20), test accuracy {run['test_accuracy']:.4f}; {args.steps} "
          f"steps in {run['seconds']:.1f}s (first call "
          f"{run['first_call_s']:.1f}s)\n", flush=True)
    results[name] = run
  k, a = results["kfac"], results["adam"]
  if not all(math.isfinite(x) for x in k["losses"]):
    print("WARNING: K-FAC's loss went non-finite; lower --kfac-lr or raise "
          "--kfac-damping.")
  print(f"K-FAC: loss "
        f"{k['final_loss']:.4f}, accuracy {k['test_accuracy']:.4f} | Adam: "
        f"loss {a['final_loss']:.4f}, accuracy {a['test_accuracy']:.4f}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
