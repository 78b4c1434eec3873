"""One BLAS/LAPACK thread while the library's own LAPACK work runs.

On CPU, jaxlib runs Cholesky, triangular solves and eigendecompositions
through the LAPACK that ``scipy.linalg.cython_lapack`` exports (scipy's
bundled OpenBLAS in a pip install). OpenBLAS starts its own threads for
them, next to XLA's thread pool; on a small or busy machine the two pools
oversubscribe the cores and the inverse refresh slows several-fold
(docs/performance.md, *BLAS threads*).

:func:`limited` wraps a traced computation (the refresh) so that the
compiled program itself sets that library's thread count to
:data:`THREADS` right before the computation and restores the previous
count right after it, at run time, inside whatever ``jit``, ``lax.cond``
or ``vmap`` the user put around it. The user's own numpy/scipy threading
is untouched outside those calls.

Mechanism: two XLA FFI custom calls (``ENTER_TARGET``, ``EXIT_TARGET``),
ordered and kept by data dependencies (:func:`limited`).
Their handlers are Python functions exposed to XLA through ``ctypes``
(XLA's FFI C ABI, ``xla/ffi/api/c_api.h``), registered by name: unlike
``jax.pure_callback``/``io_callback`` they leave no host callback in the
executable, so a step that contains them is still written to JAX's
persistent compilation cache. They call the library's own thread-count
functions (:func:`thread_control`). On other platforms the calls are not
emitted (``lax.platform_dependent``).
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import logging
import os
import threading
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

_log = logging.getLogger(__name__)

#: Threads the BLAS/LAPACK library may use during a :func:`limited` call.
THREADS = 1

ENTER_TARGET = "kfac_jax_lite_blas_threads_enter"
EXIT_TARGET = "kfac_jax_lite_blas_threads_exit"

# ---------------------------------------------------------------------------
# XLA FFI C ABI (the prefixes of the structs that the handlers read).
# ---------------------------------------------------------------------------

_EXTENSION_METADATA = 1  # XLA_FFI_Extension_Metadata
_STAGE_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
# The FFI API version these handlers follow (XLA_FFI_API_MAJOR/MINOR of
# the c_api.h whose layouts are mirrored here).
_API_MAJOR, _API_MINOR = 0, 3
# The XLA of jaxlib 0.7 and 0.8 sends the metadata query without its API
# table and registers only a handler of its own version, 0.1; the struct
# prefixes read here are the same in 0.1.
_API_MINOR_UNTOLD = 1


class _ExtensionBase(ctypes.Structure):
  pass


_ExtensionBase._fields_ = [  # pylint: disable=protected-access
    ("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
    ("next", ctypes.POINTER(_ExtensionBase))]


class _ApiVersion(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t),
              ("extension_start", ctypes.POINTER(_ExtensionBase)),
              ("major_version", ctypes.c_int),
              ("minor_version", ctypes.c_int)]


class _Api(ctypes.Structure):  # Prefix of XLA_FFI_Api.
  _fields_ = [("struct_size", ctypes.c_size_t),
              ("extension_start", ctypes.POINTER(_ExtensionBase)),
              ("api_version", _ApiVersion)]


class _Metadata(ctypes.Structure):  # Prefix of XLA_FFI_Metadata.
  _fields_ = [("struct_size", ctypes.c_size_t),
              ("api_version", _ApiVersion), ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
  _fields_ = [("extension_base", _ExtensionBase),
              ("metadata", ctypes.POINTER(_Metadata))]


class _Args(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets.
  _fields_ = [("struct_size", ctypes.c_size_t),
              ("extension_start", ctypes.POINTER(_ExtensionBase)),
              ("size", ctypes.c_int64), ("types", ctypes.c_void_p),
              ("values", ctypes.POINTER(ctypes.c_void_p))]


class _Buffer(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t),
              ("extension_start", ctypes.POINTER(_ExtensionBase)),
              ("dtype", ctypes.c_int), ("data", ctypes.c_void_p),
              ("rank", ctypes.c_int64),
              ("dims", ctypes.POINTER(ctypes.c_int64))]


class _CallFrame(ctypes.Structure):  # Prefix of XLA_FFI_CallFrame.
  _fields_ = [("struct_size", ctypes.c_size_t),
              ("extension_start", ctypes.POINTER(_ExtensionBase)),
              ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p),
              ("stage", ctypes.c_int), ("args", _Args), ("rets", _Args)]


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))


def _handler(action: Callable[[], None]):
  """An XLA FFI handler (``XLA_FFI_Error* (XLA_FFI_CallFrame*)``) that
  answers XLA's metadata query and, when executed, zeroes its int32
  result and runs ``action``. It never reports an error: a
  failure to set the thread count must not fail the user's step."""

  def handle(frame_ptr):
    try:
      frame = frame_ptr.contents
      ext = frame.extension_start
      if ext and ext.contents.type == _EXTENSION_METADATA:
        meta = ctypes.cast(ext, ctypes.POINTER(_MetadataExtension)
                           ).contents.metadata.contents
        # A handler on an older minor version than XLA's is accepted; a
        # different major version is rejected at registration.
        minor = (min(_API_MINOR, frame.api.contents.api_version.minor_version)
                 if frame.api else _API_MINOR_UNTOLD)
        meta.api_version = _ApiVersion(
            ctypes.sizeof(_ApiVersion), None, _API_MAJOR, minor)
        meta.traits = 0
        return None
      if frame.stage != _STAGE_EXECUTE:
        return None
      # The result first, all zeros (int32; batched under vmap): the
      # traced program computes with it.
      if frame.rets.size >= 1:
        buf = ctypes.cast(frame.rets.values[0],
                          ctypes.POINTER(_Buffer)).contents
        if buf.data:
          size = int(np.prod([buf.dims[d] for d in range(buf.rank)]))
          ctypes.memset(buf.data, 0, 4 * size)
      action()
    except Exception:  # pylint: disable=broad-except
      _log.warning("kfac_jax_lite: setting the BLAS thread count failed",
                   exc_info=True)
    return None

  return _HANDLER(handle)


# ---------------------------------------------------------------------------
# The thread count, process-wide, with nesting (several devices or several
# refreshes may be inside at once: the first in limits, the last out
# restores).
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_depth = 0
_saved = None
_control = None
#: Calls of the enter/exit handlers so far (for tests and diagnostics).
counts = {"enter": 0, "exit": 0}


class _DlInfo(ctypes.Structure):
  _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
              ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def lapack_library() -> Optional[str]:
  """Path of the shared library whose LAPACK jaxlib's CPU kernels call, or
  None where it cannot be told.

  jaxlib takes its kernels from ``scipy.linalg.cython_lapack``, whose
  wrappers call ``dpotrf`` & co. of the library scipy links; ``dlsym`` on
  that module's handle finds the symbol where the loader resolves it
  (scipy's bundled OpenBLAS names it ``scipy_dpotrf_``), and ``dladdr``
  names the library that defines it.
  """
  try:
    # A compiled module that scipy's annotations do not list.
    # pylint: disable-next=g-import-not-at-top
    from scipy.linalg import cython_lapack  # pyright: ignore[reportAttributeAccessIssue]
    module = ctypes.CDLL(cython_lapack.__file__)
    dladdr = ctypes.CDLL(None).dladdr
    own = os.path.realpath(cython_lapack.__file__)
    for name in ("scipy_dpotrf_", "dpotrf_", "dpotrf"):
      try:
        fn = getattr(module, name)
      except AttributeError:
        continue
      info = _DlInfo()
      if dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
        path = info.dli_fname.decode()
        if os.path.realpath(path) != own:
          return path
  except Exception:  # pylint: disable=broad-except
    pass
  return None


# (getter, setter) of the thread count: OpenBLAS (plain, scipy's prefixed
# builds, 64-bit-integer builds), MKL, BLIS.
_THREAD_SYMBOLS = tuple(
    (f"{p}openblas_get_num_threads{s}", f"{p}openblas_set_num_threads{s}")
    for p in ("scipy_", "") for s in ("", "64_")) + (
        ("MKL_Get_Max_Threads", "MKL_Set_Num_Threads"),
        ("bli_thread_get_num_threads", "bli_thread_set_num_threads"))


def thread_control() -> Optional[tuple]:
  """``(get, set)`` of the thread count of :func:`lapack_library`, found on
  first use (once LAPACK is loaded), or None (then nothing is limited).

  The library's own functions, called directly: threadpoolctl's setter
  ignores calls from any thread but the first one that set OpenBLAS's
  count, and XLA runs the handlers on its own threads.
  """
  global _control
  if _control is None:
    _control = ()
    path = lapack_library()
    if path is not None:
      lib = ctypes.CDLL(path)
      for get_name, set_name in _THREAD_SYMBOLS:
        try:
          get, set_ = getattr(lib, get_name), getattr(lib, set_name)
        except AttributeError:
          continue
        get.restype, get.argtypes = ctypes.c_int, []
        set_.restype, set_.argtypes = None, [ctypes.c_int]
        _control = (get, set_)
        break
  return _control or None


def _enter() -> None:
  global _depth, _saved
  with _lock:
    counts["enter"] += 1
    if _depth == 0 and (control := thread_control()):
      get, set_ = control
      _saved = get()
      if _saved != THREADS:
        set_(THREADS)
    _depth += 1


def _exit() -> None:
  global _depth, _saved
  with _lock:
    counts["exit"] += 1
    _depth = max(0, _depth - 1)
    if _depth == 0 and _saved is not None:
      if _saved != THREADS and (control := thread_control()):
        control[1](_saved)
      _saved = None


# ---------------------------------------------------------------------------
# Registration and the traced wrapper.
# ---------------------------------------------------------------------------

_handlers = {}  # Keeps the ctypes function pointers alive.
_registered: Optional[bool] = None


def registered() -> bool:
  """Registers the two FFI targets for CPU on first use; False (and the
  wrapper a no-op) where this jaxlib refuses them."""
  global _registered
  if _registered is None:
    try:
      for name, action in ((ENTER_TARGET, _enter), (EXIT_TARGET, _exit)):
        _handlers[name] = _handler(action)
        jax.ffi.register_ffi_target(
            name, jax.ffi.pycapsule(_handlers[name]), platform="cpu")
      _registered = True
    except Exception:  # pylint: disable=broad-except
      _log.warning("kfac_jax_lite: could not register the BLAS thread "
                   "limit; LAPACK runs with the library's own thread "
                   "count", exc_info=True)
      _registered = False
  return _registered


_TOKEN = jax.ShapeDtypeStruct((), jnp.int32)
_inside = contextvars.ContextVar("kfac_jax_lite_blas_limited", default=False)


def _call(target: str, *operands):
  # No side-effect flag: XLA's SPMD partitioner requires a sharding on
  # side-effecting ops; the results' uses keep both calls alive instead.
  def cpu(*ops):
    return jax.ffi.ffi_call(target, _TOKEN, vmap_method="broadcast_all")(
        *ops)

  return jax.lax.platform_dependent(
      *operands, cpu=cpu, default=lambda *_: jnp.zeros((), jnp.int32))


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _is_matrix(x) -> bool:
  return (_is_array(x) and np.ndim(x) >= 2
          and jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _after(token, x):
  """``x`` computed from ``token`` (0) as well: ``x - 0``, exact for every
  value (signed zeros included), which XLA cannot fold since the token
  comes from a custom call."""
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    zero = jax.lax.bitcast_convert_type(token, jnp.float32)
  else:
    zero = token
  return x - zero.astype(x.dtype)


def limited(fn: Callable) -> Callable:
  """``fn`` with the LAPACK library's threads limited to :data:`THREADS`
  while its computation runs (see the module docstring).

  The order is a data dependency, the only one XLA keeps: the floating
  matrix leaves of ``fn``'s arguments are recomputed from the limiting
  call's result (:func:`_after`), and the restoring call takes one element
  of every array leaf of ``fn``'s result as an operand, so every LAPACK kernel
  inside ``fn`` computed from those matrices runs in between; the
  restoring call's result flows into every array of the result that
  ``fn`` computed (arguments passed through are returned as they came),
  so that any use of those keeps both calls, paired (neither is flagged
  as a side effect: XLA's SPMD partitioner would require a sharding on
  it). Other leaves (Python numbers, the estimator itself) pass through.
  A ``limited`` function called while another is traced, or on no
  floating matrix, adds nothing. Values are unchanged.

  Args:
    fn: a function of arrays (and static values) returning a pytree.

  Returns:
    The wrapped function, with ``fn``'s signature and docstring.
  """

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    if _inside.get() or not registered():
      return fn(*args, **kwargs)
    leaves, tree = jax.tree.flatten((args, kwargs))
    mats = [i for i, x in enumerate(leaves) if _is_matrix(x)]
    if not mats:
      return fn(*args, **kwargs)
    # An operand from the inputs, so that two calls on different inputs
    # are not merged into one by XLA.
    token = _call(ENTER_TARGET, jax.lax.stop_gradient(
        jnp.ravel(leaves[mats[0]])[0]))
    original = {}
    for i in mats:
      x = leaves[i]
      leaves[i] = _after(token, x)
      original[id(leaves[i])] = x
    args, kwargs = jax.tree.unflatten(tree, leaves)
    reset = _inside.set(True)
    try:
      out = fn(*args, **kwargs)
    finally:
      _inside.reset(reset)
    leaves, tree = jax.tree.flatten(out)
    # Arguments passed through go back as they came, outside the limit
    # (a refresh passes the factors through).
    leaves = [original.get(id(x), x) for x in leaves]
    arrays = [i for i, x in enumerate(leaves)
              if _is_array(x) and not any(x is y for y in original.values())]
    # One element of every result: each depends on the whole computation
    # of its array, and the conditional of ``_call`` takes scalars only.
    done = _call(EXIT_TARGET, *[jax.lax.stop_gradient(jnp.ravel(leaves[i])[0])
                                for i in arrays if np.size(leaves[i])],
                 token)
    # Every computed array carries the restoring call's token: any use of
    # them keeps both calls, paired.
    for i in arrays:
      leaves[i] = _after(done, leaves[i])
    return jax.tree.unflatten(tree, leaves)

  return wrapped
