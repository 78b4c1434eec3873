"""K-FAC inside ``flax.nnx.Optimizer``: an untagged nnx MLP on MNIST.

The model is plain ``nnx.Linear`` layers (no tags). K-FAC needs a pure
``loss_fn(params, batch)``: here it splits the model once into a
``graphdef`` and its ``nnx.Param`` state, and the loss merges the two back
(``nnx.merge(graphdef, params)``). :func:`kfac_jax_lite.scan` traces that
function on ``nnx.as_pure(nnx.state(model, nnx.Param))`` (the arrays
``nnx.Optimizer`` hands to ``tx.update``) and recognises the dense layers
by itself.

Training uses the ordinary nnx API: ``nnx.grad`` of the model, then
``optimizer.update(model, grads, batch=batch)``. ``nnx.Optimizer`` forwards
``batch=`` to :func:`kfac_jax_lite.kfac`, which computes its curvature
statistics from it (a second forward pass inside the same jitted step).
Adam runs through the same code on the same batches.

Run::

  python examples/nnx_mlp.py                 # ~15-30 s on 2 CPUs
  python examples/nnx_mlp.py --steps 1000 --hidden 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Optional, Sequence

from flax import nnx
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


class MLP(nnx.Module):
  """``784 -> hidden -> ... -> 10`` with tanh; plain ``nnx.Linear`` layers."""

  def __init__(self, widths: Sequence[int], *, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                            for a, b in zip(widths[:-1], widths[1:])])

  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for layer in self.layers[:-1]:
      x = jnp.tanh(layer(x))
    return self.layers[-1](x)


def make_loss_fn(graphdef) -> Callable:
  """``loss_fn(params, batch)`` on a pure ``nnx.Param`` state."""
  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch["image"])
    logits = kfac_jax_lite.register_categorical_predictive_distribution(
        logits, batch["label"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["label"]).mean()
  return loss_fn


def make_train_step(loss_fn: Callable) -> Callable:
  """``train_step(model, optimizer, batch) -> loss``, jitted with nnx.jit.

  ``batch=`` reaches K-FAC through ``nnx.Optimizer.update``. A plain optax
  optimizer rejects unknown keyword arguments, so Adam is wrapped in
  ``optax.with_extra_args_support``, which drops them.
  """
  @nnx.jit
  def train_step(model, optimizer, batch):
    def model_loss(m):
      return loss_fn(nnx.state(m, nnx.Param), batch)
    loss, grads = nnx.value_and_grad(model_loss)(model)
    optimizer.update(model, grads, batch=batch)
    return loss
  return train_step


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


def train(name: str, model, optimizer, train_step, data, args) -> dict:
  """Runs ``args.steps`` steps in place on ``model``; returns the losses."""
  losses, t0, first_call = [], time.perf_counter(), None
  for k, batch in enumerate(batches(data, args.steps, args.batch_size,
                                    args.seed)):
    losses.append(float(train_step(model, optimizer, batch)))
    if first_call is None:
      first_call = time.perf_counter() - t0
    if args.log_every and (k + 1) % args.log_every == 0:
      print(f"  [{name}] step {k + 1:5d}/{args.steps}  loss "
            f"{np.mean(losses[-args.log_every:]):.4f}  "
            f"{time.perf_counter() - t0:6.1f}s", flush=True)
  accuracy = float(jnp.mean(jnp.argmax(model(data["x_test"]), -1)
                            == data["y_test"]))
  return {"losses": losses, "final_loss": float(np.mean(losses[-20:])),
          "test_accuracy": accuracy, "first_call_s": first_call,
          "seconds": time.perf_counter() - t0}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description="Train an untagged flax nnx MLP on MNIST with K-FAC "
      "(through nnx.Optimizer) and with Adam.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--data", default=DEFAULT_DATA, help="path to mnist.npz")
  p.add_argument("--steps", type=int, default=300, help="steps per optimizer")
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--hidden", type=int, default=256, help="hidden width")
  p.add_argument("--depth", type=int, default=2, help="hidden layers")
  p.add_argument("--kfac-lr", type=float, default=0.02)
  p.add_argument("--kfac-damping", type=float, default=3e-3)
  p.add_argument("--kfac-momentum", type=float, default=0.5)
  p.add_argument("--adam-lr", type=float, default=1e-3)
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
  for name in ("steps", "batch_size", "hidden", "depth"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains with K-FAC, then Adam, each from the same initialisation.

  Returns:
    ``{"kfac": run, "adam": run}``; a run has ``losses`` (per step),
    ``final_loss`` (mean of the last 20), ``test_accuracy``, ``seconds``
    and ``first_call_s``.
  """
  args = parse_args(argv)
  use_compilation_cache(args.compilation_cache)
  data = load_mnist(args.data)
  widths = [784] + [args.hidden] * args.depth + [10]
  new_model = lambda: MLP(widths, rngs=nnx.Rngs(args.seed))  # noqa: E731
  graphdef, _ = nnx.split(new_model(), nnx.Param)
  loss_fn = make_loss_fn(graphdef)
  example = next(batches(data, 1, args.batch_size, args.seed))
  params = nnx.as_pure(nnx.state(new_model(), nnx.Param))
  collection = kfac_jax_lite.scan(loss_fn, params, example)
  print(collection.describe())
  print(f"\njax {jax.__version__} on {jax.devices()[0].platform}; "
        f"{args.steps} steps at batch {args.batch_size}\n", flush=True)

  txs = {
      "kfac": kfac_jax_lite.kfac(args.kfac_lr, collection,
                                 damping=args.kfac_damping,
                                 momentum=args.kfac_momentum,
                                 inverse_update_period=5),
      "adam": optax.with_extra_args_support(optax.adam(args.adam_lr))}
  train_step = make_train_step(loss_fn)
  results = {}
  for name, tx in txs.items():
    model = new_model()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    run = train(name, model, optimizer, train_step, data, args)
    print(f"{name:>5}: final loss {run['final_loss']:.4f} (mean of last "
          f"20), test accuracy {run['test_accuracy']:.4f}; {args.steps} "
          f"steps in {run['seconds']:.1f}s (first call "
          f"{run['first_call_s']:.1f}s)\n", flush=True)
    results[name] = run
  k, a = results["kfac"], results["adam"]
  print(f"K-FAC: loss {k['final_loss']:.4f}, accuracy "
        f"{k['test_accuracy']:.4f} | Adam: loss {a['final_loss']:.4f}, "
        f"accuracy {a['test_accuracy']:.4f}")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
