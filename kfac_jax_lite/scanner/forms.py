"""Reads of jaxpr equations whose form differs between JAX releases.

The scanner walks and re-evaluates jaxprs, so it reads the parameters of
higher-order equations (``scan``, ``cond``, ``jit``, ``remat``, custom
derivatives) and re-binds equations. Those parameters are JAX internals and
change between releases; every read whose form differs across the supported
releases (``pyproject.toml``'s lower bound to the newest) is here, so that a
new release's change is one function to teach, with one test in
``tests/test_jax_forms.py``.

The forms known:

* ``Primitive.get_bind_params``: before jax 0.10 it returned
  ``(subfuns, params)`` and ``bind`` took the subfunctions as leading
  operands; from 0.10 it returns the params dict alone.
* ``scan``: before jax 0.11 the operand groups were counted by the params
  ``num_consts`` and ``num_carry`` (the rest are ``xs``); from 0.11 they are
  ``ft_in``, a flat tree whose ``unpack()`` gives the consts, carry and xs
  groups (each with a ``len``), and ``ft_out``, giving carry and ys.
* Closed and open jaxprs: before jax 0.11 ``ClosedJaxpr`` wrapped a
  ``Jaxpr`` with its ``consts``; from 0.11 they are one class whose
  ``.jaxpr`` is itself and whose ``constvars`` are the inputs with ``consts``
  attached (``invars`` are the others).
* ``x[i]`` with a traced integer ``i`` gathers with mode
  ``PROMISE_IN_BOUNDS`` before jax 0.9 and ``CLIP`` from 0.9.
* Inlinable calls name their body differently: ``jaxpr`` (``jit``, named
  ``pjit`` before jax 0.7; ``remat2``/``checkpoint``), ``call_jaxpr``
  (``closed_call``, ``core_call``, ``custom_jvp_call``, ``custom_vjp_call``)
  or ``fun_jaxpr`` (``custom_vjp_call_jaxpr`` of older releases).

Only the scanner reads these; it is one of the two places (with
:mod:`kfac_jax_lite.tags`) allowed JAX internals.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.extend import core as jex_core

# Higher-order primitives whose body runs once, on the equation's operands
# in order: the walk and the interpreter step into them.
INLINE = frozenset({
    "jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})

_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def open_and_consts(j) -> tuple[Any, tuple]:
  """``(jaxpr, consts)`` of a closed or open jaxpr, in any release's form.

  The jaxpr's ``constvars`` take ``consts`` and its ``invars`` the
  operands, whichever class carries them.
  """
  if isinstance(j, jex_core.ClosedJaxpr):  # Every Jaxpr from jax 0.11.
    return j.jaxpr, tuple(j.consts)
  return j, ()


def inline_body(eqn) -> tuple[Any, tuple]:
  """``(jaxpr, consts)`` of the body of an :data:`INLINE` equation.

  Raises:
    ValueError: if the equation has none of the known body params (a JAX
      release that renamed it): teach this function the new name.
  """
  for k in _BODY_KEYS:
    if k in eqn.params:
      return open_and_consts(eqn.params[k])
  raise ValueError(
      f"`{eqn.primitive.name}` has params {sorted(eqn.params)}, none of "
      f"{list(_BODY_KEYS)}: this JAX release names the body of a call "
      "differently; add its name to kfac_jax_lite.scanner.forms._BODY_KEYS.")


class ScanForm(NamedTuple):
  """What the scanner reads of a ``scan`` equation.

  Attributes:
    num_consts: leading operands passed whole to every step.
    num_carry: operands after those that are the loop carry.
    num_xs: the remaining operands, sliced along their leading axis.
    body: the step's jaxpr (``(consts, carry, x) -> (carry, y)`` flattened).
    body_consts: values of ``body``'s ``constvars``.
    length, reverse, unroll: as for ``lax.scan``.
  """
  num_consts: int
  num_carry: int
  num_xs: int
  body: Any
  body_consts: tuple
  length: int
  reverse: bool
  unroll: Any


def scan_form(eqn) -> ScanForm:
  """Reads a ``scan`` equation, in the form of jax < 0.11 or >= 0.11."""
  p = eqn.params
  if "ft_in" in p:  # jax >= 0.11: flat-tree packs of the operand groups.
    nc, ncarry, nxs = (len(g) for g in p["ft_in"].unpack())
  else:
    nc, ncarry = p["num_consts"], p["num_carry"]
    nxs = len(eqn.invars) - nc - ncarry
  if nxs < 0 or nc + ncarry + nxs != len(eqn.invars):
    raise ValueError(
        f"A scan equation has {len(eqn.invars)} operands but its params "
        f"count {nc} consts, {ncarry} carry and {nxs} xs: this JAX "
        "release's scan form is not one kfac_jax_lite.scanner.forms.scan_form "
        "knows.")
  body, body_consts = open_and_consts(p["jaxpr"])
  return ScanForm(nc, ncarry, nxs, body, body_consts, p["length"],
                  p["reverse"], p.get("unroll", 1))


def cond_branches(eqn) -> tuple:
  """``((jaxpr, consts), ...)``, one per branch of a ``cond`` equation.

  Each branch takes the operands after the index.
  """
  return tuple(open_and_consts(b) for b in eqn.params["branches"])


def gather_keeps_slices_in_bounds(eqn) -> bool:
  """Whether a ``gather`` equation never reads outside its operand.

  True for mode ``CLIP`` (starts clamped into range; what ``x[i]`` gives
  from jax 0.9) and ``PROMISE_IN_BOUNDS`` (the caller promises it; what
  ``x[i]`` gives before jax 0.9, after making ``i`` non-negative); false for
  ``FILL_OR_DROP``, whose out-of-range slices are filled instead.
  """
  mode = str(eqn.params.get("mode"))
  return "CLIP" in mode or "PROMISE_IN_BOUNDS" in mode


def bind(eqn, invals) -> list:
  """Re-binds an equation unchanged (the body of ``jax.core.eval_jaxpr``).

  Returns:
    The outputs, as a list even for a single-result primitive.
  """
  bound = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bound, tuple):  # jax < 0.10: (subfuns, params).
    subfuns, params = bound
  else:
    subfuns, params = (), bound
  ctx = getattr(eqn.ctx, "manager", None)
  if ctx is not None:
    with ctx:
      ans = eqn.primitive.bind(*subfuns, *invals, **params)
  else:
    ans = eqn.primitive.bind(*subfuns, *invals, **params)
  return ans if eqn.primitive.multiple_results else [ans]
