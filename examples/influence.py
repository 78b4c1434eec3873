"""Influence functions on MNIST with EK-FAC (and K-FAC) curvature.

The influence of a training example ``z`` on the loss of a test example
(Koh & Liang 2017) is

.. math::
  I(z, z_{test}) = -\\nabla\\ell(z_{test})^T (F + \\lambda I)^{-1}
  \\nabla\\ell(z),

the change of the test loss per unit of up-weighting ``z`` in the training
loss: removing ``z`` from ``n`` examples changes the test loss by about
``-I/n``. Positive ``I``: ``z`` hurts the test example (removing it helps);
negative: ``z`` supports it. ``F`` is the Fisher (the Gauss-Newton matrix of
the cross-entropy) of the trained model, approximated by the EK-FAC or the
K-FAC blocks of :class:`kfac_jax_lite.FisherEstimator`; ``λ`` is the L2
coefficient of the training loss.

The script

1. trains a ``784-H-10`` tanh MLP with :func:`kfac_jax_lite.kfac` (L2
   ``λ/2 ||θ||²``);
2. estimates the curvature over the training set, K-FAC's factors in a
   first pass, then (for EK-FAC) the scalings in the eigenbasis of those
   factors in a second pass (``update_curvature`` with ``ema_decay=0``
   then ``1``: a plain average over the batches);
3. computes ``(F + λ)⁻¹ ∇ℓ_test`` once per test image and the influences
   of every training image as one inner product each, the per-example
   training gradients batched with ``jax.vmap``;
4. draws, per test image, the training images of largest negative and
   positive influence (``--plot``, a PNG grid);
5. checks the predictions on a tiny model (logistic regression on 7x7
   images, float64): each of the most influential training images is
   removed and the model retrained to its optimum (Newton's method on the
   exact Hessian); the Pearson correlation of the predicted and actual test
   loss changes is printed, for EK-FAC, K-FAC and the exact Hessian.

Run::

  python examples/influence.py                          # ~1-2 min on CPU
  python examples/influence.py --train-size 20000 --hidden 128 --steps 600
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import numpy as np
import optax

import kfac_jax_lite as kl

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "data", "mnist.npz")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--data", default=DEFAULT_DATA)
  p.add_argument("--train-size", type=int, default=5000)
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--learning-rate", type=float, default=0.01)
  p.add_argument("--train-damping", type=float, default=1e-2)
  p.add_argument("--l2", type=float, default=1e-3,
                 help="λ: the L2 coefficient, and the damping")
  p.add_argument("--curvature-batch", type=int, default=500)
  p.add_argument("--num-test", type=int, default=3)
  p.add_argument("--top", type=int, default=5)
  p.add_argument("--plot", default="influence.png",
                 help="PNG path ('' for none)")
  p.add_argument("--tiny-train-size", type=int, default=500)
  p.add_argument("--tiny-removals", type=int, default=10,
                 help="retrainings in the sanity check (0 skips it)")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


# ---------------------------------------------------------------------------
# Data and models.
# ---------------------------------------------------------------------------


def load(path: str, train_size: int, seed: int):
  with np.load(path) as d:
    x, y = d["x_train"], d["y_train"]
    xt, yt = d["x_test"], d["y_test"]
  pick = np.random.default_rng(seed).permutation(len(x))[:train_size]
  to = lambda a: (a.reshape(len(a), -1) / 255.0).astype(np.float32)  # noqa
  return (to(x[pick]), y[pick].astype(np.int32),
          to(xt), yt.astype(np.int32))


def mlp_init(key, sizes):
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, k = jax.random.split(key)
    params[f"layer{i}"] = {"w": jax.random.normal(k, (a, b)) / np.sqrt(a),
                           "b": jnp.zeros((b,))}
  return params


def logits_fn(params, x):
  n = len(params)
  for i in range(n):
    p = params[f"layer{i}"]
    y = kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])
    x = jnp.tanh(y) if i < n - 1 else y
  return x


def per_example_loss(params, x, y):
  """``ℓ(z)`` of one example (no L2)."""
  logits = logits_fn(params, x[None])
  return optax.softmax_cross_entropy_with_integer_labels(logits, y[None])[0]


def make_loss(l2: float):
  def loss_fn(params, batch):
    x, y = batch
    logits = kl.register_categorical_predictive_distribution(
        logits_fn(params, x), y)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    sq = sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params))
    return ce + 0.5 * l2 * sq
  return loss_fn


def train(loss_fn, params, x, y, steps, batch_size, learning_rate, damping,
          seed):
  collection = kl.scan(loss_fn, params, (x[:batch_size], y[:batch_size]))
  tx = kl.kfac(learning_rate, collection, damping=damping)
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, loss

  rng = np.random.default_rng(seed)
  loss = float("nan")
  for _ in range(steps):
    idx = rng.integers(0, len(x), batch_size)
    params, state, loss = step(params, state, (x[idx], y[idx]))
  return params, float(loss)


# ---------------------------------------------------------------------------
# Curvature and influences.
# ---------------------------------------------------------------------------


def curvature(loss_fn, params, x, y, approx, damping, batch):
  """``(estimator, state)``: the curvature of the training set, damped by
  ``damping`` (``F + λ I``, ``damping_type="exact"``)."""
  approximations = {"fully_connected": approx}
  collection = kl.scan(loss_fn, params, (x[:batch], y[:batch]),
                       approximations=approximations)
  est = kl.FisherEstimator(collection, estimation_mode="exact",
                           damping=damping, damping_type="exact")
  update = jax.jit(lambda s, b, d: est.update_curvature(
      s, params, b, ema_decay=d))
  batches = [(x[i:i + batch], y[i:i + batch])
             for i in range(0, len(x) - batch + 1, batch)]

  def average(state):
    # ema_decay 0 restarts the zero-debiased average, 1 keeps it plain.
    for k, b in enumerate(batches):
      state = update(state, b, 0.0 if k == 0 else 1.0)
    return state

  state = jax.jit(est.update_cache)(average(est.init(params)))
  if approx == "ekfac":  # The scalings, in the basis of those factors.
    state = average(state)
  return est, state


def influences(est, state, params, x_test, y_test, x, y, chunk=500):
  """``I[t, i] = -∇ℓ(z_test_t)ᵀ (F + λ)⁻¹ ∇ℓ(z_i)``: ``[T, N]``."""
  grad = jax.grad(per_example_loss)
  flat = lambda t: ravel_pytree(t)[0]  # noqa: E731
  solve = jax.jit(jax.vmap(lambda a, b: flat(est.multiply_inverse(
      state, grad(params, a, b)))))
  solved = solve(jnp.asarray(x_test), jnp.asarray(y_test))

  @jax.jit
  def scores(xs, ys):
    g = jax.vmap(lambda a, b: flat(grad(params, a, b)))(xs, ys)
    return -solved @ g.T

  return np.concatenate([np.asarray(scores(x[i:i + chunk], y[i:i + chunk]))
                         for i in range(0, len(x), chunk)], axis=1)


def plot(path, x_test, y_test, x, y, scores, top):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows, cols = len(x_test), 1 + 2 * top
  fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.5 * rows),
                           squeeze=False)
  for t in range(rows):
    order = np.argsort(scores[t])
    picks = list(order[:top]) + list(order[::-1][:top])
    cells = [(x_test[t], f"test: {y_test[t]}")] + [
        (x[i], f"{y[i]}  {scores[t, i]:+.2g}") for i in picks]
    for ax, (img, title) in zip(axes[t], cells):
      ax.imshow(img.reshape(28, 28), cmap="gray")
      ax.set_title(title, fontsize=7)
      ax.axis("off")
  fig.suptitle(f"EK-FAC influence: {top} most negative (supporting), then "
               f"{top} most positive (opposing) training images", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


# ---------------------------------------------------------------------------
# The sanity check: leave-one-out retraining of a tiny convex model.
# ---------------------------------------------------------------------------


def tiny_check(x, y, x_test, y_test, l2, removals, pool_size=4):
  r"""Predicted vs actual test-loss changes when removing one example.

  Logistic regression (one dense layer, ``M = [W; b]``) on images
  average-pooled by ``pool_size`` (7x7 by default), in float64. Its
  objective ``(1/n) Σ_i w_i ℓ_i + λ/2 ||M||²`` (``w_i = 1``) is
  minimised by Newton's method with the exact Hessian
  :math:`\frac1n \sum_i w_i \bar x_i \bar x_i^T \otimes
  (\mathrm{diag}\, p_i - p_i p_i^T) + \lambda I`; then each of the
  ``removals`` training images of largest |EK-FAC influence| on the first
  test image is removed (``w_i = 0``, the ``1/n`` kept) and the model
  retrained from the optimum, with that Hessian as preconditioner (the
  iteration contracts by ``O(1/n)`` per step). Returns
  ``({name: pearson correlation}, actual changes)``.
  """
  # Config's flag attributes are set at runtime; its stubs omit them.
  x64 = jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]
  jax.config.update("jax_enable_x64", True)
  try:
    k = 28 // pool_size
    pool = lambda a: a.reshape(-1, k, pool_size, k, pool_size).mean(  # noqa
        (2, 4)).reshape(len(a), -1).astype(np.float64)
    x, xt, yt = pool(x), pool(x_test[:1]), y_test[:1]
    n, d = x.shape
    xb = np.concatenate([x, np.ones((n, 1))], axis=1)

    def to_params(theta):
      m = theta.reshape(d + 1, 10)
      return {"layer0": {"w": m[:d], "b": m[d]}}

    def objective(theta, weights):
      ce = optax.softmax_cross_entropy_with_integer_labels(
          xb @ theta.reshape(d + 1, 10), y)
      return jnp.sum(weights * ce) / n + 0.5 * l2 * jnp.sum(theta ** 2)

    def hessian(theta, weights):
      p = jax.nn.softmax(xb @ theta.reshape(d + 1, 10))
      s = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]
      h = jnp.einsum("na,nbij->aibj", xb * (weights / n)[:, None],
                     xb[:, :, None, None] * s[:, None])
      return h.reshape((d + 1) * 10, -1) + l2 * jnp.eye((d + 1) * 10)

    @jax.jit
    def newton(theta, weights):
      def body(theta, _):
        g = jax.grad(objective)(theta, weights)
        return theta - jnp.linalg.solve(hessian(theta, weights), g), None
      return jax.lax.scan(body, theta, None, length=10)[0]

    @jax.jit
    def retrain(theta, weights, chol):
      def body(theta, _):
        g = jax.grad(objective)(theta, weights)
        return theta - jax.scipy.linalg.cho_solve((chol, True), g), None
      return jax.lax.scan(body, theta, None, length=8)[0]

    @jax.jit
    def test_loss(theta):
      return per_example_loss(to_params(theta), xt[0], yt[0])

    ones = jnp.ones((n,))
    theta = newton(jnp.zeros(((d + 1) * 10,)), ones)
    p_opt = to_params(theta)

    @jax.jit
    def exact_scores(theta):
      h = hessian(theta, ones)
      # ∇ℓ per example in the order of M = [W; b] (row-major).
      grads = jax.vmap(jax.grad(lambda t, a, b: per_example_loss(
          to_params(t), a, b)), (None, 0, 0))(theta, x, y)
      g_test = jax.grad(test_loss)(theta)
      return -grads @ jnp.linalg.solve(h, g_test), jnp.linalg.cholesky(h)

    exact, chol = exact_scores(theta)
    scores = {"exact Hessian": exact}
    loss_fn = make_loss(l2)
    for approx in ("ekfac", "kron"):
      est, state = curvature(loss_fn, p_opt, x, y, approx, l2, n)
      scores[approx] = influences(est, state, p_opt, xt, yt, x, y)[0]
    order = np.argsort(-np.abs(np.asarray(scores["ekfac"])))[:removals]
    base = float(test_loss(theta))
    actual = np.array([
        float(test_loss(retrain(theta, ones.at[i].set(0.0), chol))) - base
        for i in order])
    return {name: float(np.corrcoef(-np.asarray(s)[order] / n, actual)[0, 1])
            for name, s in scores.items()}, actual
  finally:
    jax.config.update("jax_enable_x64", x64)


def main(argv: Sequence[str] | None = None) -> dict:
  args = parse_args(argv)
  t0 = time.time()
  x, y, x_test, y_test = load(args.data, args.train_size, args.seed)
  loss_fn = make_loss(args.l2)
  params = mlp_init(jax.random.PRNGKey(args.seed), [784, args.hidden, 10])
  params, loss = train(loss_fn, params, jnp.asarray(x), jnp.asarray(y),
                       args.steps, args.batch_size, args.learning_rate,
                       args.train_damping, args.seed)
  acc = float(np.mean(np.argmax(np.asarray(jax.jit(logits_fn)(
      params, x_test)), -1) == y_test))
  print(f"trained: loss {loss:.4f}, test accuracy {acc:.3f} "
        f"({time.time() - t0:.0f}s)")
  xt, yt = x_test[:args.num_test], y_test[:args.num_test]
  out: dict[str, Any] = {"test_accuracy": acc}
  for approx in ("ekfac", "kron"):
    est, state = curvature(loss_fn, params, x, y, approx, args.l2,
                           min(args.curvature_batch, len(x)))
    out[approx] = influences(est, state, params, xt, yt, x, y)
  for t in range(len(xt)):
    corr = np.corrcoef(out["ekfac"][t], out["kron"][t])[0, 1]
    top = np.argsort(out["ekfac"][t])
    print(f"test {t} (label {yt[t]}): most supporting {top[:3].tolist()}, "
          f"most opposing {top[::-1][:3].tolist()}; EK-FAC vs K-FAC "
          f"influence correlation {corr:.3f}")
  if args.plot:
    plot(args.plot, xt, yt, x, y, out["ekfac"], args.top)
    print(f"wrote {args.plot}")
  if args.tiny_removals:
    corr, actual = tiny_check(x[:args.tiny_train_size],
                              y[:args.tiny_train_size], x_test, y_test,
                              args.l2, args.tiny_removals)
    out["tiny_correlation"], out["tiny_actual"] = corr, actual
    print("tiny model, leave-one-out retraining: correlation of predicted "
          "and actual test-loss changes: " + ", ".join(
              f"{k} {v:.3f}" for k, v in corr.items()))
  print(f"done in {time.time() - t0:.0f}s")
  return out


if __name__ == "__main__":
  main()
