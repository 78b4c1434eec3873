"""K-FAC against Adam on MNIST with a flax linen MLP.

The model is a ``784-H-...-H-10`` tanh MLP built from :class:`TaggedDense`, a
small linen module that owns a kernel and a bias and registers its output
with :func:`kfac_jax_lite.register_dense`. The logits are registered as a
categorical predictive distribution, so :func:`kfac_jax_lite.scan` finds
every layer and the loss.

Both optimizers see the same batches in the same order. K-FAC uses the
one-pass path: :func:`kfac_jax_lite.value_grad_and_stats` returns the loss,
the gradient and the curvature statistics from one forward pass, and
``tx.update(grads, state, params, stats=stats)`` consumes them, all inside
one jitted step.

Run::

  python examples/mnist_mlp.py                 # defaults: ~1-2 minutes on CPU
  python examples/mnist_mlp.py --epochs 3 --hidden 512
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Iterator, Optional, Sequence, cast

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
# Model.
# ---------------------------------------------------------------------------


class TaggedDense(nn.Module):
  """``y = x @ kernel + bias``, registered for K-FAC.

  Same parameter names, layout (``kernel: [d_in, d_out]``) and default
  initialisation as ``flax.linen.Dense``; the only difference is the
  :func:`kfac_jax_lite.register_dense` call on the output, which is a no-op
  in value and gradient.

  Attributes:
    features: the output width ``d_out``.
  """
  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
    y = x @ kernel + bias
    return kfac_jax_lite.register_dense(y, x, kernel, bias)


class MLP(nn.Module):
  """A tanh MLP on flattened images: ``784 -> hidden... -> num_classes``.

  Attributes:
    hidden: widths of the hidden layers.
    num_classes: number of output logits.
  """
  hidden: Sequence[int]
  num_classes: int = 10

  @nn.compact
  def __call__(self, images):
    x = images.reshape(images.shape[0], -1)
    for width in self.hidden:
      x = jnp.tanh(TaggedDense(width)(x))
    return TaggedDense(self.num_classes)(x)


def make_loss_fn(model: nn.Module) -> Callable:
  """``loss_fn(params, batch)``: mean softmax cross-entropy, loss tagged.

  ``params`` is the linen ``"params"`` collection; ``batch`` is a dict with
  ``"image"`` (``[B, 28, 28]`` float) and ``"label"`` (``[B]`` int).
  """
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["image"])
    logits = kfac_jax_lite.register_categorical_predictive_distribution(
        logits, batch["label"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["label"]).mean()
  return loss_fn


# ---------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------


def load_mnist(path: str) -> dict:
  """Loads the bundled MNIST ``.npz``: uint8 images, int32 labels.

  Raises:
    FileNotFoundError: with a hint if ``path`` does not exist.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"MNIST file {path!r} not found. The repository ships it at "
        f"{DEFAULT_DATA!r}; pass --data PATH to use another copy.")
  with np.load(path) as d:
    return {k: d[k] if k.startswith("x") else d[k].astype(np.int32)
            for k in ("x_train", "y_train", "x_test", "y_test")}


def to_float(images: np.ndarray) -> np.ndarray:
  """uint8 pixels to float32 in ``[0, 1]``."""
  return images.astype(np.float32) / 255.0


def epoch_batches(images: np.ndarray, labels: np.ndarray, batch_size: int,
                  seed: int) -> Iterator[dict]:
  """Shuffled full batches of one epoch (the remainder is dropped)."""
  order = np.random.default_rng(seed).permutation(len(images))
  for start in range(0, len(images) - batch_size + 1, batch_size):
    idx = order[start:start + batch_size]
    yield {"image": to_float(images[idx]), "label": labels[idx]}


# ---------------------------------------------------------------------------
# Training steps: one jitted function per optimizer, same structure.
# ---------------------------------------------------------------------------


def make_kfac_step(loss_fn: Callable, collection, tx) -> Callable:
  """A jitted ``step(params, opt_state, batch, rng) -> (params, state, loss)``.

  Loss, gradient and curvature statistics come from one forward pass
  (:func:`kfac_jax_lite.value_grad_and_stats`); ``rng`` draws the sampled
  targets of the Fisher estimate and should differ per step.
  """
  value_grad_and_stats = kfac_jax_lite.value_grad_and_stats(loss_fn,
                                                            collection)

  def step(params, opt_state, batch, rng):
    loss, grads, stats = value_grad_and_stats(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params, stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step)


def make_optax_step(loss_fn: Callable, tx) -> Callable:
  """The same step for a plain optax optimizer (``rng`` is unused)."""
  def step(params, opt_state, batch, rng):
    del rng
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step)


def make_accuracy_fn(model: nn.Module) -> Callable:
  """A jitted ``accuracy(params, images, labels) -> fraction correct``."""
  @jax.jit
  def accuracy(params, images, labels):
    # apply returns the output alone (no mutable collections asked for).
    logits = cast(jax.Array, model.apply({"params": params}, images))
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)
  return accuracy


def train(name: str, step: Callable, params, opt_state, data: dict, *,
          epochs: int, batch_size: int, max_steps: Optional[int],
          log_every: int, seed: int) -> dict:
  """Runs ``step`` over the epochs; returns per-epoch mean losses and times.

  Every optimizer gets the same batches: epoch ``e`` is shuffled with seed
  ``seed + e``. The loss of a step is the loss of its batch *before* the
  update, so an epoch's loss is the mean training loss over its batches.
  """
  total = epochs * (len(data["x_train"]) // batch_size)
  total = total if max_steps is None else min(total, max_steps)
  key = jax.random.PRNGKey(seed)
  epoch_losses, t0, done = [], time.perf_counter(), 0
  first_step_s = None
  for epoch in range(epochs):
    losses = []
    for batch in epoch_batches(data["x_train"], data["y_train"], batch_size,
                               seed + epoch):
      if max_steps is not None and done >= max_steps:
        break
      t_step = time.perf_counter()
      params, opt_state, loss = step(params, opt_state, batch,
                                     jax.random.fold_in(key, done))
      if first_step_s is None:
        loss.block_until_ready()
        first_step_s = time.perf_counter() - t_step
      losses.append(loss)
      done += 1
      if log_every and done % log_every == 0:
        print(f"  [{name}] epoch {epoch + 1} step {done:5d}/{total}  "
              f"loss {float(loss):.4f}  "
              f"{time.perf_counter() - t0:6.1f}s", flush=True)
    if not losses:
      break
    mean = float(np.mean(jax.device_get(losses)))
    epoch_losses.append(mean)
    print(f"{name:>5} epoch {epoch + 1}: mean train loss {mean:.4f} "
          f"({len(losses)} steps, {time.perf_counter() - t0:.1f}s)",
          flush=True)
  return {"params": params, "epoch_losses": epoch_losses, "steps": done,
          "seconds": time.perf_counter() - t0, "first_step_s": first_step_s}


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  """Parses and checks the command-line flags (see ``--help``)."""
  p = argparse.ArgumentParser(
      description="Train a tanh MLP on MNIST with K-FAC and with Adam on the "
      "same batches, and compare their training losses.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA,
                 help="path to mnist.npz")
  p.add_argument("--epochs", type=int, default=2, help="passes over the data")
  p.add_argument("--batch-size", type=int, default=256,
                 help="examples per step (the same for both optimizers)")
  p.add_argument("--hidden", type=int, default=256,
                 help="width of each hidden layer")
  p.add_argument("--depth", type=int, default=2,
                 help="number of hidden layers")
  p.add_argument("--max-steps", type=int, default=None,
                 help="stop each optimizer after this many steps in total")
  p.add_argument("--log-every", type=int, default=50,
                 help="print a progress line every N steps (0: never)")
  p.add_argument("--seed", type=int, default=0,
                 help="seeds the initialisation, the shuffles and sampling")
  p.add_argument("--kfac-lr", type=float, default=0.02,
                 help="K-FAC learning rate")
  p.add_argument("--kfac-damping", type=float, default=3e-3,
                 help="K-FAC Tikhonov damping")
  p.add_argument("--kfac-momentum", type=float, default=0.5,
                 help="K-FAC momentum (0 disables it)")
  p.add_argument("--kfac-inverse-period", type=int, default=5,
                 help="refresh the factor inverses every N steps")
  p.add_argument("--adam-lr", type=float, default=1e-3,
                 help="Adam learning rate")
  p.add_argument("--compilation-cache",
                 default=DEFAULT_COMPILATION_CACHE if argv is None else None,
                 help="JAX's persistent compilation cache directory: a "
                 "second run loads its compiled steps from it (on by "
                 "default from the command line; off for main(argv))")
  p.add_argument("--no-compilation-cache", dest="compilation_cache",
                 action="store_const", const=None,
                 help="compile everything afresh, keep nothing")
  args = p.parse_args(argv)
  for name in ("epochs", "batch_size", "hidden", "depth"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, "
              f"got {getattr(args, name)}")
  if args.max_steps is not None and args.max_steps < 1:
    p.error(f"--max-steps must be >= 1, got {args.max_steps}")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains with K-FAC, then Adam; prints losses and returns the results.

  Args:
    argv: command-line arguments (default ``sys.argv[1:]``).

  Returns:
    ``{"kfac": {...}, "adam": {...}}``, each with ``epoch_losses`` (mean
    training loss per epoch), ``test_accuracy``, ``steps``, ``seconds`` and
    ``first_step_s`` (compile plus first step).
  """
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  data = load_mnist(args.data)
  model = MLP(hidden=(args.hidden,) * args.depth)
  loss_fn = make_loss_fn(model)
  example = {"image": to_float(data["x_train"][:args.batch_size]),
             "label": data["y_train"][:args.batch_size]}
  init_params = model.init(jax.random.PRNGKey(args.seed),
                           example["image"])["params"]
  collection = kfac_jax_lite.scan(loss_fn, init_params, example)
  print(collection.describe())
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"{len(data['x_train']) // args.batch_size} steps per epoch "
        f"at batch {args.batch_size}\n", flush=True)

  kfac_tx = kfac_jax_lite.kfac(
      args.kfac_lr, collection, momentum=args.kfac_momentum,
      damping=args.kfac_damping,
      inverse_update_period=args.kfac_inverse_period)
  adam_tx = optax.adam(args.adam_lr)
  runs = {
      "kfac": (make_kfac_step(loss_fn, collection, kfac_tx), kfac_tx),
      "adam": (make_optax_step(loss_fn, adam_tx), adam_tx),
  }
  accuracy = make_accuracy_fn(model)
  results = {}
  for name, (step, tx) in runs.items():
    out = train(name, step, init_params, tx.init(init_params), data,
                epochs=args.epochs, batch_size=args.batch_size,
                max_steps=args.max_steps, log_every=args.log_every,
                seed=args.seed)
    out["test_accuracy"] = float(accuracy(
        out.pop("params"), to_float(data["x_test"]), data["y_test"]))
    print(f"{name:>5} test accuracy {out['test_accuracy']:.4f}; "
          f"{out['steps']} steps in {out['seconds']:.1f}s "
          f"(first step incl. compile {out['first_step_s']:.2f}s)\n",
          flush=True)
    results[name] = out

  k, a = results["kfac"], results["adam"]
  finite = all(math.isfinite(x) for r in (k, a) for x in r["epoch_losses"])
  print("epoch  kfac loss  adam loss")
  for e, (lk, la) in enumerate(zip(k["epoch_losses"], a["epoch_losses"])):
    print(f"{e + 1:5d}  {lk:9.4f}  {la:9.4f}")
  if not finite:
    print("WARNING: a non-finite loss; lower --kfac-lr or raise "
          "--kfac-damping.")
  better = "K-FAC" if k["epoch_losses"][-1] < a["epoch_losses"][-1] else "Adam"
  print(f"final: K-FAC loss {k['epoch_losses'][-1]:.4f}, test acc "
        f"{k['test_accuracy']:.4f}, {k['seconds']:.1f}s | Adam loss "
        f"{a['epoch_losses'][-1]:.4f}, test acc {a['test_accuracy']:.4f}, "
        f"{a['seconds']:.1f}s -> lower training loss: {better}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
