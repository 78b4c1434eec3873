"""The LAPACK thread limit around the library's refresh (_blas_threads).

The limit is emitted for XLA:CPU only (``lax.platform_dependent``): the
tests that watch it are ``cpu_only``.
"""

import os
import subprocess
import sys

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import threadpoolctl

import kfac_jax_lite as kl
from kfac_jax_lite import _blas_threads
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAPACK = _blas_threads.lapack_library()
# The thread count the tests give the LAPACK library outside the calls:
# above the limit, so that a missing limit or restore shows.
OUTSIDE = 3

needs_lapack = pytest.mark.skipif(
    LAPACK is None, reason="jaxlib's LAPACK library cannot be located here")


def _controllers(lapack):
  """threadpoolctl's controllers of the LAPACK library (``lapack=True``)
  or of every other BLAS library (``False``)."""
  real = os.path.realpath(LAPACK)
  return [c for c in threadpoolctl.ThreadpoolController().lib_controllers
          if c.user_api == "blas"
          and (os.path.realpath(c.filepath) == real) == lapack]


def _threads(lapack=True):
  return [c.num_threads for c in _controllers(lapack)]


@pytest.fixture(name="outside")
def _outside_fixture():
  """The LAPACK library at OUTSIDE threads during the test."""
  jax.jit(jnp.linalg.cholesky)(jnp.eye(2))  # Loads jaxlib's LAPACK.
  with threadpoolctl.ThreadpoolController().select(
      filepath=[c.filepath for c in _controllers(True)]).limit(
          limits=OUTSIDE):
    assert _threads() == [OUTSIDE]
    yield


def _probed(x):
  """``(cholesky(x), LAPACK threads seen by the host right before the
  factorisation, other BLAS libraries' threads then)``: the probe reads
  ``x`` and the factorisation reads the probe's result, so it runs in
  between whatever XLA's schedule."""
  others = len(_threads(False))
  seen = io_callback(
      lambda _: np.asarray(_threads() + _threads(False), np.int32),
      jax.ShapeDtypeStruct((1 + others,), jnp.int32), x)
  chol = jnp.linalg.cholesky(x + 0 * seen[0].astype(x.dtype))
  return chol, seen[0], seen[1:]


@pytest.mark.cpu_only
@needs_lapack
@pytest.mark.usefixtures("outside")
def test_limited_during_the_call_and_restored_after():
  x = jnp.eye(3) * 2.0 + 0.5
  others_before = _threads(False)
  for fn in (jax.jit(_blas_threads.limited(_probed)),
             _blas_threads.limited(_probed)):  # Jitted, then eager.
    chol, inside, others = fn(x)
    np.testing.assert_array_equal(chol, jnp.linalg.cholesky(x))
    assert int(inside) == _blas_threads.THREADS
    # numpy's own BLAS (a separate library here) is left alone.
    assert list(np.asarray(others)) == others_before
    assert _threads() == [OUTSIDE]
    assert _threads(False) == others_before
  _, inside, _ = jax.jit(_probed)(x)  # Unwrapped: nothing limits.
  assert int(inside) == OUTSIDE


@pytest.mark.cpu_only
@needs_lapack
@pytest.mark.usefixtures("outside")
def test_limit_inside_cond_vmap_and_pmap():
  x = jnp.eye(3) * 2.0 + 0.5
  limited = _blas_threads.limited(_probed)

  @jax.jit
  def step(flag, x):
    return jax.lax.cond(flag, lambda x: limited(x)[1],
                        lambda x: jnp.int32(-1), x)

  before = dict(_blas_threads.counts)
  assert int(step(False, x)) == -1
  assert _blas_threads.counts == before  # Branch not taken: no calls.
  assert int(step(True, x)) == _blas_threads.THREADS
  assert _blas_threads.counts["enter"] == before["enter"] + 1
  assert _blas_threads.counts["exit"] == before["exit"] + 1
  _, inside, _ = jax.jit(jax.vmap(limited))(jnp.stack([x, x]))
  np.testing.assert_array_equal(inside, [_blas_threads.THREADS] * 2)
  n = jax.local_device_count()
  _, inside, _ = jax.pmap(limited)(jnp.stack([x] * n))
  np.testing.assert_array_equal(inside, [_blas_threads.THREADS] * n)
  assert _threads() == [OUTSIDE]
  assert _blas_threads.counts["enter"] == _blas_threads.counts["exit"]


def test_values_and_gradients_unchanged():
  m = jax.random.normal(jax.random.PRNGKey(0), (6, 6))
  m = m @ m.T + jnp.eye(6)

  def fn(m, scale):
    return {"inv": jnp.linalg.inv(m) * scale, "n": 3}

  limited = _blas_threads.limited(fn)
  for got, want in ((limited(m, 2.0), fn(m, 2.0)),
                    (jax.jit(limited)(m, 2.0), jax.jit(fn)(m, 2.0))):
    assert got["n"] == 3
    np.testing.assert_array_equal(got["inv"], want["inv"])
  grad = jax.grad(lambda m: limited(m, 2.0)["inv"].sum())(m)
  np.testing.assert_array_equal(
      grad, jax.grad(lambda m: fn(m, 2.0)["inv"].sum())(m))


def _kfac_step():
  """``(step, params, state)``: a jitted ``kfac`` step that refreshes the
  inverses every second step."""
  params = helpers.mlp_params(jax.random.PRNGKey(0), [5, 8, 3])
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 5))
  y = jax.random.randint(jax.random.PRNGKey(2), (16,), 0, 3)
  loss = helpers.classifier_loss
  collection = kl.scan(loss, params, (x, y))
  tx = kl.kfac(1e-2, collection, damping=1e-2, inverse_update_period=2)
  vgs = kl.value_grad_and_stats(loss, collection)

  @jax.jit
  def step(params, state):
    _, grads, stats = vgs(params, (x, y), jax.random.PRNGKey(0))
    updates, state = tx.update(grads, state, params, stats=stats)
    return optax.apply_updates(params, updates), state

  return step, params, tx.init(params)


@pytest.mark.cpu_only
@needs_lapack
@pytest.mark.usefixtures("outside")
def test_kfac_refresh_runs_limited_and_restores():
  step, params, state = _kfac_step()
  hlo = step.lower(params, state).as_text()
  assert _blas_threads.ENTER_TARGET in hlo
  assert _blas_threads.EXIT_TARGET in hlo
  others = _threads(False)
  before = dict(_blas_threads.counts)
  for _ in range(4):  # Refreshes at steps 0 and 2.
    params, state = step(params, state)
  jax.block_until_ready(params)
  assert _blas_threads.counts["enter"] - before["enter"] == 2
  assert _blas_threads.counts["exit"] - before["exit"] == 2
  assert _threads() == [OUTSIDE]
  assert _threads(False) == others


def test_the_limit_is_in_the_cpu_program_only():
  """The step lowered for CUDA (from any backend) has no thread-limit
  calls, and its refresh calls cuSOLVER; lowered for the CPU it has
  both calls around LAPACK."""
  step, params, state = _kfac_step()
  traced = step.trace(params, state)
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  # A cuSOLVER call, or XLA's own Cholesky (jax 0.7 registers no GPU
  # lowering rules without a GPU; XLA:GPU rewrites it into cuSOLVER).
  assert "cusolver" in cuda or "stablehlo.cholesky" in cuda
  assert _blas_threads.ENTER_TARGET not in cuda
  assert _blas_threads.EXIT_TARGET not in cuda
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert "lapack" in cpu
  assert _blas_threads.ENTER_TARGET in cpu
  assert _blas_threads.EXIT_TARGET in cpu


@pytest.mark.slow
def test_step_with_the_limit_is_persistently_cached(tmp_path):
  # A host callback would keep the step out of JAX's persistent
  # compilation cache; the limit's FFI calls must not.
  code = (
      "import jax, jax.numpy as jnp\n"
      "from kfac_jax_lite import _blas_threads\n"
      f"jax.config.update('jax_compilation_cache_dir', {str(tmp_path)!r})\n"
      "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
      "def limited_step(m):\n"
      "  return _blas_threads.limited(jnp.linalg.cholesky)(m)\n"
      "jax.jit(limited_step)(jnp.eye(4) * 2).block_until_ready()\n")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], env=env, check=True,
                 timeout=300, capture_output=True)
  assert any(name.startswith("jit_limited_step")
             for name in os.listdir(tmp_path))
