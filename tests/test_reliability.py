"""Reliability: bad inputs, non-finite batches, checkpoints, determinism."""

import os
import subprocess
import sys

import hypothesis
from hypothesis import strategies as st
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import blocks as blocks_lib
from kfac_jax_lite import collection as collection_lib
from tests import helpers
from tests import problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(name="problem", scope="module")
def _problem():
  p = problems.tiny_classifier()
  return p.params, p.batch, p.scan()


def _tag_loss(tag):
  def loss_fn(params, x):
    out = tag(params, x)
    kl.register_normal_predictive_distribution(out)
    return jnp.sum(out)
  return loss_fn


_W, _X = jnp.ones((4, 3)), jnp.ones((2, 4))
_IMG, _K = jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4))


def _conv(strides):
  y = lax.conv_general_dilated(_IMG, _K, (1, 1), "SAME",
                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return kl.register_conv(y, _IMG, _K, window_strides=strides,
                          padding="SAME",
                          dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _bad_inputs(problem):
  params, batch, c = problem
  est = lambda **kw: kl.FisherEstimator(c, **kw)  # noqa: E731
  tx = kl.kfac(0.1, c)
  state = tx.init(params)
  scan_w = lambda p, loss_fn=None: kl.scan(  # noqa: E731
      loss_fn or _tag_loss(lambda p, x: kl.register_dense(
          x @ p["w"], x, p["w"])), p, _X)
  return [
      # (thunk, exception type, text the message must contain)
      (lambda: scan_w({"w": _W, "n": jnp.zeros((), jnp.int32)}), TypeError,
       "params['n'] has dtype int32"),
      (lambda: scan_w({"w": _W.astype(jnp.complex64)}), TypeError,
       "dtype complex64"),
      (lambda: kl.register_dense(jnp.ones((2, 5)), _X, _W), ValueError,
       "register_dense: y has shape (2, 5)"),
      (lambda: kl.register_dense(jnp.ones((2, 3)), jnp.ones((2, 5)), _W),
       ValueError, "register_dense: x has shape (2, 5)"),
      (lambda: kl.register_dense(jnp.ones((2, 3)), _X, jnp.ones((4, 3, 1))),
       ValueError, "w has shape (4, 3, 1)"),
      (lambda: kl.register_dense(jnp.ones((2, 3)), _X, _W, jnp.ones(4)),
       ValueError, "b has shape (4,)"),
      (lambda: _conv((2, 2)), ValueError,
       "register_conv: y has shape (2, 5, 5, 4), expected (2, 3, 3, 4)"),
      (lambda: kl.register_conv2d(jnp.ones((2, 5, 5, 4)), _IMG, _K,
                                  strides=1, padding="SAME",
                                  data_format="NHCW"),
       ValueError, "data_format='NHCW'"),
      (lambda: kl.register_embedding(jnp.ones((3, 2)), jnp.array([0, 1, 9]),
                                     jnp.ones((5, 2))),
       ValueError, "ids range over [0, 9], outside the vocabulary [0, 5)"),
      (lambda: kl.register_embedding(jnp.ones((3, 2)), jnp.ones(3),
                                     jnp.ones((5, 2))),
       TypeError, "ids have dtype float32"),
      (lambda: kl.register_categorical_predictive_distribution(
          jnp.ones((2, 3)), weight=-1.0), ValueError, "weight=-1.0"),
      (lambda: kl.register_normal_predictive_distribution(
          jnp.ones((2, 3)), var=0.0), ValueError, "var=0.0"),
      (lambda: est(cov_ema_decay=1.5), ValueError, "cov_ema_decay=1.5"),
      (lambda: est(damping=-1.0), ValueError, "damping=-1.0"),
      (lambda: est(estimation_mode="bogus"), ValueError,
       "estimation_mode='bogus'"),
      (lambda: est(num_samples=0), ValueError, "num_samples=0"),
      (lambda: est(damping_type="tikhonov"), ValueError,
       "damping_type='tikhonov'"),
      (lambda: kl.FisherEstimator("not a collection"), TypeError,
       "collection"),
      (lambda: kl.scale_by_kfac(c, inverse_update_period=2.5), ValueError,
       "inverse_update_period=2.5"),
      (lambda: kl.scale_by_kfac(c, cov_update_period=0), ValueError,
       "cov_update_period=0"),
      (lambda: kl.scale_by_kfac(c, power=0.5), ValueError, "power=0.5"),
      (lambda: kl.scale_by_kfac(c, norm_constraint=-1.0), ValueError,
       "norm_constraint=-1.0"),
      (lambda: kl.kfac(-0.1, c), ValueError, "learning_rate=-0.1"),
      (lambda: kl.kfac_optimizer(c, damping_adaptation_decay=2.0),
       ValueError, "damping_adaptation_decay=2.0"),
      (lambda: scan_w({"w": _W}, _tag_loss(lambda p, x: kl.register_dense(
          x @ p["w"], x, p["w"], approx="kron_x"))), ValueError,
       "approx='kron_x'"),
      (lambda: kl.scan(helpers.classifier_loss, params, batch,
                       approximations={"conv": "bad"}), ValueError,
       "approximations['conv']='bad'"),
      (lambda: kl.scan(helpers.classifier_loss, params, batch,
                       approximations={"['nope']": "kron"}), ValueError,
       "approximations key \"['nope']\""),
      (lambda: tx.update(params, state, params, batch=batch, stats={}),
       ValueError, "both batch and stats"),
      (lambda: tx.update(params, state, params), ValueError,
       "neither batch nor stats"),
      (lambda: tx.update({"x": jnp.ones(3)}, state, {"x": jnp.ones(3)},
                         batch=batch), ValueError,
       "params does not match the parameters"),
      (lambda: est(exps=(-1,)).multiply_matpower(
          est().init(params), params, 0.5), ValueError, "exps=[-1]"),
  ]


def test_bad_inputs_fail_fast_naming_the_argument(problem):
  cases = _bad_inputs(problem)
  assert len(cases) >= 20
  for thunk, exc, text in cases:
    with pytest.raises(exc) as info:
      thunk()
    assert text in str(info.value), (text, str(info.value))


# ---------------------------------------------------------------------------
# Numerics.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", ["kfac", "kfac_optimizer"])
def test_nan_batches_are_skipped_and_counted(problem, make):
  params, _, c = problem
  tx = (kl.kfac(0.1, c, damping=1e-2) if make == "kfac"
        else kl.kfac_optimizer(c))
  state = tx.init(params)
  fn = kl.value_grad_and_stats(helpers.classifier_loss, c)

  @jax.jit
  def step(params, state, batch, key):
    loss, grads, stats = fn(params, batch, key)
    updates, state = tx.update(grads, state, params, stats=stats,
                               batch=None if make == "kfac" else batch)
    return optax.apply_updates(params, updates), state, loss

  clean = helpers.classification_batch(jax.random.PRNGKey(7), 32, 6, 3)
  start = float(helpers.classifier_loss(params, clean))
  bad = 0
  for i in range(50):
    x, y = helpers.classification_batch(jax.random.PRNGKey(i % 5), 32, 6, 3)
    if (i + 1) % 7 == 0:
      x = x.at[i % 32, i % 6].set(jnp.nan if i % 2 else jnp.inf)
      bad += 1
    params, state, _ = step(params, state, (x, y), jax.random.PRNGKey(i))
  assert all(np.all(np.isfinite(l)) for l in jax.tree.leaves(params))
  assert all(np.all(np.isfinite(l)) for l in jax.tree.leaves(state))
  assert int(state.num_skipped) == bad == 7
  train = [helpers.classification_batch(jax.random.PRNGKey(j), 32, 6, 3)
           for j in range(5)]
  end = np.mean([float(helpers.classifier_loss(params, b)) for b in train])
  begin = np.mean([float(helpers.classifier_loss(
      problem[0], b)) for b in train])
  assert end < 0.8 * begin, (begin, end)
  del start


def _run(tx, params, batches, **kw):
  """``(params, state)`` after a jitted step per batch (``kw``: more
  extra args of ``update``), and the params after each step."""
  step = jax.jit(lambda p, s, b: tx.update(
      jax.grad(helpers.classifier_loss)(p, b), s, p, batch=b, **kw))
  state, seen = tx.init(params), []
  for b in batches:
    updates, state = step(params, state, b)
    params = optax.apply_updates(params, updates)
    seen.append(params)
  return seen, state


def _nan_lr_schedule(count):
  # Finite at steps 0 and 1, NaN from step 2 on (the square root of a
  # negative number, as a mistaken warm-down would give).
  return 0.1 * jnp.sqrt(1.5 - count)


@pytest.mark.parametrize("how", ["array", "schedule", "injected"])
def test_nonfinite_learning_rate_is_skipped_and_counted(problem, how):
  """A NaN learning rate skips the step like a NaN gradient: parameters
  and state unchanged, counted. The step count does not advance on a
  skipped step, so a schedule that is NaN from step 2 on skips every step
  from then on (each one counted)."""
  params, batch, c = problem
  batches = [helpers.classification_batch(jax.random.PRNGKey(i), 16, 6, 3)
             for i in range(4)]
  if how == "array":
    tx = kl.kfac(jnp.asarray(jnp.nan), c, damping=1e-2)
    seen, state = _run(tx, params, batches)
    for p in seen:
      helpers.assert_trees_close(p, params, rtol=0)
    assert int(state.num_skipped) == 4 and not bool(state.last_finite)
    assert int(state.inner[0].count) == 0
    return
  if how == "schedule":
    tx = kl.kfac(_nan_lr_schedule, c, damping=1e-2)
    seen, state = _run(tx, params, batches)
  else:
    tx = optax.inject_hyperparams(kl.kfac, static_args=("collection",))(
        learning_rate=0.1, collection=c, damping=1e-2)
    step = jax.jit(lambda p, s, b: tx.update(
        jax.grad(helpers.classifier_loss)(p, b), s, p, batch=b))
    state, seen, p = tx.init(params), [], params
    for i, b in enumerate(batches):
      if i == 2:
        state.hyperparams["learning_rate"] = jnp.asarray(jnp.nan)
      updates, state = step(p, state, b)
      p = optax.apply_updates(p, updates)
      seen.append(p)
    state = state.inner_state
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(seen))
  assert not np.array_equal(jax.tree.leaves(seen[1])[0],
                            jax.tree.leaves(seen[0])[0])  # steps 0, 1 ran
  helpers.assert_trees_close(seen[2], seen[1], rtol=0)
  helpers.assert_trees_close(seen[3], seen[1], rtol=0)
  assert int(state.num_skipped) == 2 and not bool(state.last_finite)
  assert int(state.inner[0].count) == 2   # the curvature kept its count
  if how == "schedule":
    assert int(state.inner[-1].count) == 2  # and so did the schedule


def test_kfac_optimizer_nonfinite_fixed_learning_rate_is_skipped(problem):
  params, _, c = problem
  batches = [helpers.classification_batch(jax.random.PRNGKey(i), 16, 6, 3)
             for i in range(2)]
  tx = kl.kfac_optimizer(c, adapt_learning_rate=False,
                         learning_rate=jnp.asarray(jnp.nan))
  seen, state = _run(tx, params, batches)
  for p in seen:
    helpers.assert_trees_close(p, params, rtol=0)
  assert int(state.num_skipped) == 2
  assert not bool(state.curvature.last_finite)
  assert int(state.curvature.count) == 0


@pytest.mark.parametrize("damping", [1e-10, 1e10])
def test_extreme_damping_and_ill_conditioned_factors_stay_finite(damping):
  # Factors with condition number ~1e8.
  d = 6
  layer = collection_lib.Layer(
      name="l", kind="fully_connected", approx="kron", param_paths=("w",),
      param_indices=(0,), param_shapes=((d, d),), param_dtypes=("float32",))
  for exps in ((-1,), (-1, -0.5)):
    block = blocks_lib.make_block(layer, blocks_lib.BlockConfig(exps=exps))
    scales = jnp.logspace(0, -4, d)
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 1, d)) * scales
    g = jax.random.normal(jax.random.PRNGKey(1), (1, 64, 1, d)) * scales
    data = blocks_lib.LayerData(inputs=((x,),), grads=(g,),
                                params=(jnp.ones((d, d)),), param_grads=(),
                                batch_size=64)
    state = block.update_curvature(block.init(), block.compute_stats(data),
                                   0.95)
    cond = np.linalg.cond(np.asarray(state.a, np.float64))
    assert cond > 1e7
    state = block.update_cache(state, damping)
    v = (jnp.ones((d, d)),)
    for e in exps:
      out = block.multiply_matpower(state, v, e)
      assert np.all(np.isfinite(out[0])), (damping, e)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_params_train(dtype):
  params = jax.tree.map(lambda a: a.astype(dtype),
                        helpers.mlp_params(jax.random.PRNGKey(0), [6, 8, 3]))
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 16, 6, 3)
  batch = (batch[0].astype(dtype), batch[1])
  c = kl.scan(helpers.classifier_loss, params, batch)
  tx = kl.kfac(0.05, c, damping=1e-2)
  state = tx.init(params)
  step = jax.jit(lambda p, s: tx.update(
      jax.grad(helpers.classifier_loss)(p, batch), s, p, batch=batch))
  for _ in range(3):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  assert all(l.dtype == dtype for l in jax.tree.leaves(params))
  factors = state.inner[0].estimator.blocks[0]
  assert factors.a.dtype == jnp.float32 and factors.g.dtype == jnp.float32
  assert all(np.all(np.isfinite(np.asarray(l, np.float32)))
             for l in jax.tree.leaves((params, state)))


_APPROXES = ["kron", "kron_in_diag", "kron_out_diag", "kron_both_diag",
             "diagonal", "full"]


@pytest.mark.slow
@hypothesis.settings(max_examples=12, deadline=None,
                     suppress_health_check=[
                         hypothesis.HealthCheck.too_slow])
@hypothesis.given(d_in=st.integers(1, 5), d_out=st.integers(1, 5),
                  bias=st.booleans(), approx=st.sampled_from(_APPROXES),
                  dtype=st.sampled_from(["float32", "bfloat16"]),
                  seed=st.integers(0, 2 ** 16))
def test_block_identities_property(d_in, d_out, bias, approx, dtype, seed):
  shapes = ((d_in, d_out),) + (((d_out,),) if bias else ())
  layer = collection_lib.Layer(
      name="l", kind="fully_connected", approx=approx,
      param_paths=tuple(f"p{i}" for i in range(len(shapes))),
      param_indices=tuple(range(len(shapes))), param_shapes=shapes,
      param_dtypes=(dtype,) * len(shapes))
  block = blocks_lib.make_block(layer)
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(k[0], (12, 1, d_in))
  g = jax.random.normal(k[1], (2, 12, 1, d_out))
  params = tuple(jnp.zeros(s, dtype) for s in shapes)
  data = blocks_lib.LayerData(inputs=((x,),), grads=(g,), params=params,
                              param_grads=(), batch_size=12)
  v = tuple(jax.random.normal(k[2], s).astype(dtype) for s in shapes)

  @jax.jit  # One compile per example instead of one per op.
  def products():
    state = block.update_curvature(block.init(), block.compute_stats(data),
                                   0.9)
    state = block.update_cache(state, 0.1)
    return (block.full_fisher_block(state),
            block.multiply(state, block.multiply_inverse(state, v)))

  full, back = products()
  full = np.asarray(full, np.float64)
  np.testing.assert_allclose(full, full.T, atol=1e-5)
  assert np.linalg.eigvalsh(full).min() > -1e-4 * max(1.0, np.abs(full).max())
  tol = 1e-4 if dtype == "float32" else 5e-2
  helpers.assert_trees_close(back, v, rtol=tol)


# ---------------------------------------------------------------------------
# Checkpointing and determinism.
# ---------------------------------------------------------------------------


def _run_worker(*args):
  # One simulated device is enough; keep conftest's other XLA flags.
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=flags,
             OPENBLAS_NUM_THREADS="1")
  subprocess.run([sys.executable, "-m", "tests.resume_worker",
                  *map(str, args)], cwd=ROOT, env=env, check=True,
                 timeout=300, capture_output=True)


@pytest.mark.slow
def test_kill_and_resume_is_bitwise_identical(tmp_path):
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  whole.mkdir()
  parts.mkdir()
  # One process: the uninterrupted run, then the "killed" run that stops
  # after saving its checkpoint at step 15. A fresh process resumes it.
  _run_worker(whole, 0, 30, -1, parts, 0, 15, 15)
  assert not (parts / "final_30.npz").exists()
  _run_worker(parts, 15, 30, -1)
  a, b = np.load(whole / "final_30.npz"), np.load(parts / "final_30.npz")
  assert len(a.files) == len(b.files) > 10
  for key in a.files:
    np.testing.assert_array_equal(a[key], b[key])


def test_flax_serialization_round_trip(problem):
  from flax import serialization  # pylint: disable=import-outside-toplevel
  params, batch, c = problem
  tx = kl.kfac_optimizer(c)
  init = jax.jit(tx.init)  # Jitted: not hundreds of eager op-by-op compiles.
  _, state = jax.jit(lambda p, s, b: tx.update(
      jax.grad(helpers.classifier_loss)(p, b), s, p, batch=b))(
          params, init(params), batch)
  restored = serialization.from_bytes(init(params),
                                      serialization.to_bytes(state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(x, y)


def test_two_identical_runs_are_bitwise_identical(problem):
  params0, _, c = problem

  def run():
    tx = kl.kfac(0.1, c)
    params, state = params0, tx.init(params0)
    step = jax.jit(lambda p, s, b: tx.update(
        jax.grad(helpers.classifier_loss)(p, b), s, p, batch=b))
    for i in range(6):
      b = helpers.classification_batch(jax.random.PRNGKey(i), 16, 6, 3)
      updates, state = step(params, state, b)
      params = optax.apply_updates(params, updates)
    return params, state

  r1, r2 = run(), run()
  for x, y in zip(jax.tree.leaves(r1), jax.tree.leaves(r2)):
    np.testing.assert_array_equal(x, y)
