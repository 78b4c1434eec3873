"""The LAPACK thread limit of a CPU process (_blas_threads).

Tracing the library's refresh on a CPU backend sets the thread count of
jaxlib's LAPACK library to one, once; the compiled step holds nothing of
it (no custom call, no host callback): it runs no Python.
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
# The thread count the tests give the LAPACK library before the limit:
# above it, so that a missing limit shows.
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


@pytest.fixture(name="fresh")
def _fresh_fixture():
  """The LAPACK library at OUTSIDE threads and the limit not yet applied,
  as in a new process; both restored afterwards."""
  jax.jit(jnp.linalg.cholesky)(jnp.eye(2))  # Loads jaxlib's LAPACK.
  saved = _blas_threads.applied
  _blas_threads.applied = None
  try:
    with threadpoolctl.ThreadpoolController().select(
        filepath=[c.filepath for c in _controllers(True)]).limit(
            limits=OUTSIDE):
      assert _threads() == [OUTSIDE]
      yield
  finally:
    _blas_threads.applied = saved


def _probed(x):
  """``(cholesky(x), LAPACK threads seen by the host right before the
  factorisation)``: the probe reads ``x`` and the factorisation reads the
  probe's result, so it runs in between whatever XLA's schedule."""
  seen = io_callback(lambda _: np.asarray(_threads(), np.int32),
                     jax.ShapeDtypeStruct((1,), jnp.int32), x)
  return jnp.linalg.cholesky(x + 0 * seen[0].astype(x.dtype)), seen[0]


@pytest.mark.cpu_only
@needs_lapack
@pytest.mark.usefixtures("fresh")
def test_tracing_limits_the_process_once():
  x = jnp.eye(3) * 2.0 + 0.5
  others = _threads(False)
  traced = jax.jit(_blas_threads.limited(_probed)).trace(x)
  # Tracing set it, before anything ran.
  assert _threads() == [_blas_threads.THREADS]
  assert _blas_threads.applied == {"library": LAPACK, "before": OUTSIDE,
                                   "after": _blas_threads.THREADS}
  chol, inside = traced.lower().compile()(x)
  np.testing.assert_array_equal(chol, jnp.linalg.cholesky(x))
  assert int(inside) == _blas_threads.THREADS  # While the step runs.
  # numpy's own BLAS (a separate library here) is left alone.
  assert _threads(False) == others
  # Once: a count the user sets afterwards stays.
  threadpoolctl.ThreadpoolController().select(
      filepath=[c.filepath for c in _controllers(True)]).limit(limits=2)
  jax.jit(_blas_threads.limited(lambda x: jnp.linalg.cholesky(x) + 1))(x)
  assert _threads() == [2]


@pytest.mark.cpu_only
@needs_lapack
@pytest.mark.usefixtures("fresh")
def test_other_default_backends_leave_the_library_alone(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  jax.jit(_blas_threads.limited(jnp.linalg.cholesky)).trace(jnp.eye(3))
  assert _blas_threads.applied is None
  assert _threads() == [OUTSIDE]


def test_program_values_and_gradients_unchanged():
  m = jax.random.normal(jax.random.PRNGKey(0), (6, 6))
  m = m @ m.T + jnp.eye(6)

  def fn(m, scale):
    return {"inv": jnp.linalg.inv(m) * scale, "n": 3}

  limited = _blas_threads.limited(fn)
  assert str(jax.make_jaxpr(limited)(m, 2.0)) == str(
      jax.make_jaxpr(fn)(m, 2.0))
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


def _custom_call_targets(text):
  return {line.split("custom_call_target=\"")[1].split("\"")[0]
          for line in text.splitlines() if "custom_call_target=\"" in line}


@pytest.mark.cpu_only
@needs_lapack
@pytest.mark.usefixtures("fresh")
def test_kfac_step_runs_no_python():
  """The compiled CPU step calls LAPACK and nothing else on the host (no
  callback, no library handler): it never needs the GIL."""
  step, params, state = _kfac_step()
  compiled = step.lower(params, state).compile()
  targets = _custom_call_targets(compiled.as_text())
  assert targets and all(t.startswith("lapack_") for t in targets), targets
  assert _threads() == [_blas_threads.THREADS]
  for _ in range(2):
    params, state = compiled(params, state)
  jax.block_until_ready(params)


def test_cuda_and_cpu_programs_hold_no_thread_calls():
  """Lowered for CUDA (from any backend) the refresh calls cuSOLVER;
  lowered for the CPU, LAPACK; neither holds a call of the library's."""
  step, params, state = _kfac_step()
  traced = step.trace(params, state)
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  # A cuSOLVER call, or XLA's own Cholesky (jax 0.7 registers no GPU
  # lowering rules without a GPU; XLA:GPU rewrites it into cuSOLVER).
  assert "cusolver" in cuda or "stablehlo.cholesky" in cuda
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert "lapack" in cpu
  for text in (cuda, cpu):
    assert "kfac_jax_lite" not in text
    assert "callback" not in text


@pytest.mark.slow
def test_kfac_step_is_persistently_cached(tmp_path):
  # A host callback would keep the step out of JAX's persistent
  # compilation cache.
  code = (
      "import jax, jax.numpy as jnp\n"
      f"jax.config.update('jax_compilation_cache_dir', {str(tmp_path)!r})\n"
      "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
      "from tests.test_blas_threads import _kfac_step\n"
      "step, params, state = _kfac_step()\n"
      "jax.block_until_ready(step(params, state))\n")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], env=env, check=True,
                 timeout=300, capture_output=True, cwd=ROOT)
  assert any(name.startswith("jit_step") for name in os.listdir(tmp_path))
