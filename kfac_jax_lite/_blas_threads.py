"""One BLAS/LAPACK thread for the LAPACK work of a CPU process.

On CPU, jaxlib runs Cholesky, triangular solves and eigendecompositions
through the LAPACK that ``scipy.linalg.cython_lapack`` exports (scipy's
bundled OpenBLAS in a pip install). OpenBLAS starts its own threads for
them, next to XLA's thread pool; on a small or busy machine the two pools
oversubscribe the cores and the inverse refresh slows several-fold
(docs/performance.md, *BLAS threads*).

:func:`limited` wraps the refresh. When it is traced in a process whose
default backend is the CPU, it sets that library's thread count to
:data:`THREADS`, once for the process (:func:`limit_process_threads`), on
the thread that traces. Nothing is added to the compiled program: the
step runs no Python, so it never waits for the GIL (a busy data-loading
thread does not stall it, and an interpreter shutting down while steps
are in flight does not deadlock with them), and it is written to JAX's
persistent compilation cache like any other program.

The count is the process's: the user's own ``scipy.linalg`` calls and
JAX's other CPU LAPACK kernels run with it too (numpy's bundled OpenBLAS
is a separate library in a pip install, and keeps its threads). It is
set once: a count set afterwards (``threadpoolctl``, the library's own
setter) is left as it is.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Callable, Optional

import jax

_log = logging.getLogger(__name__)

#: Threads the BLAS/LAPACK library is given (:func:`limit_process_threads`).
THREADS = 1


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

_control = None


def thread_control() -> Optional[tuple]:
  """``(get, set)`` of the thread count of :func:`lapack_library`, found on
  first use, or None (then nothing is limited).

  The library's own functions, called directly.
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


_lock = threading.Lock()
#: What :func:`limit_process_threads` did, once it ran: ``library`` (the
#: path, or None where no thread count could be found), ``before`` and
#: ``after`` (the counts, or None).
applied: Optional[dict] = None


def limit_process_threads() -> dict:
  """Sets the LAPACK library's thread count to :data:`THREADS` (where it
  is higher), the first time it is called in the process.

  Returns:
    :data:`applied`: the library and its thread count before and after.
  """
  global applied
  with _lock:
    if applied is None:
      control = thread_control()
      record = {"library": lapack_library() if control else None,
                "before": None, "after": None}
      if control is not None:
        get, set_ = control
        record["before"] = get()
        if record["before"] > THREADS:
          set_(THREADS)
        record["after"] = get()
        _log.info("kfac_jax_lite: %s runs LAPACK with %d thread(s) "
                  "(it had %d); docs/performance.md#blas-threads",
                  record["library"], record["after"], record["before"])
      else:
        _log.info("kfac_jax_lite: the thread count of jaxlib's LAPACK "
                  "library was not found; it keeps its own "
                  "(docs/performance.md#blas-threads)")
      applied = record
    return applied


def limited(fn: Callable) -> Callable:
  """``fn``, which limits the LAPACK library's threads when it is called
  (traced) in a process whose default backend is the CPU.

  The first such call runs :func:`limit_process_threads`; nothing is
  added to ``fn``'s computation, whose values, gradients and program are
  those of ``fn``. On other default backends the library is left alone
  (a step there runs no CPU LAPACK).

  Args:
    fn: any function.

  Returns:
    The wrapped function, with ``fn``'s signature and docstring.
  """

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    if applied is None and jax.default_backend() == "cpu":
      limit_process_threads()
    return fn(*args, **kwargs)

  return wrapped
