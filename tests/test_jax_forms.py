"""scanner.forms: each JAX release's form of an equation reads the same.

The installed JAX produces one form of each equation; the other forms are
built here from it (the params rewritten as the other releases write them)
and must read the same, and scan()/perturbed_fn must give the same result on
a jaxpr in the other form.
"""

import types

import jax
from jax import lax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl
from kfac_jax_lite import scanner
from kfac_jax_lite.scanner import forms
from kfac_jax_lite.scanner import walk
from tests import problems


class _FlatTreeStandIn:
  """jax >= 0.11's ``ft.pack((consts, carry, xs))`` of ``ft.nones(n)``s:
  ``unpack()`` gives one group per part, each with a ``len``."""

  def __init__(self, *counts):
    self.counts = counts

  def unpack(self):
    return tuple((None,) * n for n in self.counts)


def _as_flat_tree_scan(params, n_invars):
  """A jax < 0.11 scan's params in jax 0.11's ``ft_in``/``ft_out`` form."""
  p = dict(params)
  nc, ncarry = p.pop("num_consts"), p.pop("num_carry")
  p.pop("linear", None)            # Gone by jax 0.11.
  p.pop("_split_transpose", None)  # Gone by jax 0.11.
  n_ys = len(p["jaxpr"].out_avals) - ncarry
  p["ft_in"] = _FlatTreeStandIn(nc, ncarry, n_invars - nc - ncarry)
  p["ft_out"] = _FlatTreeStandIn(ncarry, n_ys)
  return p


def _as_counted_scan(params, n_invars):
  """A jax >= 0.11 scan's params in the ``num_consts``/``num_carry`` form."""
  del n_invars
  p = dict(params)
  nc, ncarry, _ = (len(g) for g in p.pop("ft_in").unpack())
  p.pop("ft_out")
  p.update(num_consts=nc, num_carry=ncarry)
  return p


def _other_scan_params(eqn):
  """The scan equation's params in the form the installed JAX does not
  produce."""
  if "ft_in" in eqn.params:
    return _as_counted_scan(eqn.params, len(eqn.invars))
  return _as_flat_tree_scan(eqn.params, len(eqn.invars))


def _rewrite_scans(closed):
  """``closed`` with every top-level scan equation in the other form."""
  eqns = [e.replace(params=_other_scan_params(e))
          if e.primitive.name == "scan" else e for e in closed.jaxpr.eqns]
  new = closed.jaxpr.replace(eqns=eqns)
  if closed.jaxpr is closed:  # jax >= 0.11: one class, consts attached.
    return new
  return jex_core.ClosedJaxpr(new, closed.consts)


def _scan_eqn():
  def step(c, x):
    return c * w + x, c - x

  w = jnp.arange(3.0)
  closed = jax.make_jaxpr(
      lambda c, xs: lax.scan(step, c, xs, reverse=True, unroll=2))(
          jnp.ones(3), jnp.ones((4, 3)))
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  return eqn


def test_scan_form_reads_both_releases_forms_the_same():
  eqn = _scan_eqn()
  native = forms.scan_form(eqn)
  # w is closed over (a const), c the carry, xs the scanned operand.
  assert (native.num_consts, native.num_carry, native.num_xs) == (1, 1, 1)
  assert (native.length, native.reverse, native.unroll) == (4, True, 2)
  other = forms.scan_form(eqn.replace(params=_other_scan_params(eqn)))
  assert other == native


def test_scan_form_rejects_counts_that_do_not_cover_the_operands():
  eqn = _scan_eqn()  # 3 operands.
  for p in (dict(eqn.params), _other_scan_params(eqn)):
    if "ft_in" in p:
      p["ft_in"] = _FlatTreeStandIn(1, 1, 5)
    else:
      p["num_carry"] = 3
    with pytest.raises(ValueError, match="scan_form"):
      forms.scan_form(eqn.replace(params=p))


def _scanned(loss_fn, params, batch, rewrite, monkeypatch):
  """scan() and one perturbed_fn evaluation, with the traced jaxpr's scans
  rewritten to the other form when ``rewrite``."""
  if rewrite:
    trace = walk.trace

    def trace_other_form(*args):
      closed, out_tree = trace(*args)
      return _rewrite_scans(closed), out_tree

    monkeypatch.setattr(walk, "trace", trace_other_form)
  collection = kl.scan(loss_fn, params, batch)
  traced = scanner.perturbed_fn(collection, params, batch)
  (loss, zs), (_, records, _, _) = traced.fn(params, traced.eps)
  return collection, loss, zs, records


def test_scan_rnn_reads_the_other_scan_form_the_same(monkeypatch):
  params, batch = problems.rnn_setup(t=5)
  native = _scanned(problems.rnn_loss, params, batch, False, monkeypatch)
  other = _scanned(problems.rnn_loss, params, batch, True, monkeypatch)
  assert native[0].layer("['cell']").num_uses == 5
  assert [(l.kind, l.param_paths, l.num_uses) for l in other[0].layers] == [
      (l.kind, l.param_paths, l.num_uses) for l in native[0].layers]
  np.testing.assert_array_equal(other[1], native[1])
  assert len(native[3]) == 2  # The cell's inputs and the readout's.
  jax.tree.map(np.testing.assert_array_equal, other[2:], native[2:])


def test_cond_branches_are_open_jaxprs_with_their_consts():
  closed = jax.make_jaxpr(
      lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, lambda y: y * 2.0], x))(
          1, 0.5)
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
  branches = forms.cond_branches(eqn)
  assert len(branches) == 3
  for (jaxpr, consts), k in zip(branches, range(3)):
    out = jax.core.eval_jaxpr(jaxpr, consts, 0.5)
    np.testing.assert_allclose(out[0], [np.sin, np.cos, lambda y: 2 * y][k](
        0.5), rtol=1e-6)


def _eqns(fn, *args):
  return jax.make_jaxpr(fn)(*args).jaxpr.eqns


@jax.custom_vjp
def _cv(x):
  return jnp.sin(x)


_cv.defvjp(lambda x: (_cv(x), x), lambda x, g: (g * jnp.cos(x),))


@jax.custom_jvp
def _cj(x):
  return jnp.sin(x)


_cj.defjvp(lambda p, t: (_cj(p[0]), t[0] * jnp.cos(p[0])))


@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "custom_jvp",
                                  "custom_vjp"])
def test_inline_body_evaluates_to_the_call(wrap):
  fn = {"jit": jax.jit(jnp.sin), "checkpoint": jax.checkpoint(jnp.sin),
        "custom_jvp": _cj, "custom_vjp": _cv}[wrap]
  (eqn,) = _eqns(fn, 0.5)
  assert eqn.primitive.name in forms.INLINE
  jaxpr, consts = forms.inline_body(eqn)
  out = jax.core.eval_jaxpr(jaxpr, consts, 0.5)
  np.testing.assert_allclose(out[0], np.sin(0.5), rtol=1e-6)


def test_inline_body_reads_the_old_custom_vjp_name():
  """``custom_vjp_call_jaxpr`` of older releases names its body
  ``fun_jaxpr``."""
  (eqn,) = _eqns(_cv, 0.5)
  p = dict(eqn.params)
  p["fun_jaxpr"] = p.pop("call_jaxpr")
  old = types.SimpleNamespace(primitive=eqn.primitive, params=p)
  assert forms.inline_body(old) == forms.inline_body(eqn)


def test_inline_body_names_the_fix_for_an_unknown_body_name():
  (eqn,) = _eqns(jax.jit(jnp.sin), 0.5)
  p = dict(eqn.params)
  p["body"] = p.pop("jaxpr")
  with pytest.raises(ValueError, match="_BODY_KEYS"):
    forms.inline_body(types.SimpleNamespace(primitive=eqn.primitive,
                                            params=p))


class _OldBindPrimitive:
  """A primitive whose ``get_bind_params`` has jax < 0.10's form:
  ``(subfuns, params)``, the subfunctions passed to ``bind`` first."""

  multiple_results = True

  def __init__(self, prim, subfuns):
    self.prim, self.subfuns, self.bound = prim, subfuns, None

  def get_bind_params(self, params):
    return list(self.subfuns), dict(params)

  def bind(self, *args, **params):
    self.bound = args[:len(self.subfuns)]
    return self.prim.bind(*args[len(self.subfuns):], **params)


def test_bind_takes_params_and_subfuns_in_either_form():
  (eqn,) = _eqns(jax.jit(lambda x: (jnp.sin(x), x + 1.0)), 0.5)
  native = forms.bind(eqn, [jnp.float32(0.5)])
  np.testing.assert_allclose(native, [np.sin(0.5), 1.5], rtol=1e-6)
  sub = object()
  prim = _OldBindPrimitive(eqn.primitive, [sub])
  if isinstance(eqn.primitive.get_bind_params(eqn.params), tuple):
    # jax < 0.10 is native here: the stand-in forms a params-only release.
    prim.get_bind_params = lambda params: dict(params)
    prim.subfuns = []
  old = types.SimpleNamespace(primitive=prim, params=eqn.params, ctx=eqn.ctx)
  np.testing.assert_array_equal(forms.bind(old, [jnp.float32(0.5)]), native)
  assert prim.bound == tuple(prim.subfuns)


def test_bind_wraps_a_single_result_in_a_list():
  (eqn,) = _eqns(jnp.sin, 0.5)
  out = forms.bind(eqn, [jnp.float32(0.5)])
  assert isinstance(out, list) and len(out) == 1
  np.testing.assert_allclose(out[0], np.sin(0.5), rtol=1e-6)


def test_gather_modes_that_stay_in_bounds():
  """``w[i]`` under vmap: ``PROMISE_IN_BOUNDS`` before jax 0.9, ``CLIP``
  after; both stay in bounds, ``FILL_OR_DROP`` does not."""
  (eqn,) = [e for e in _eqns(jax.vmap(lambda i: jnp.ones((4, 3))[i]),
                              jnp.arange(2)) if e.primitive.name == "gather"]
  assert forms.gather_keeps_slices_in_bounds(eqn)
  mode = lax.GatherScatterMode
  for m, want in ((mode.CLIP, True), (mode.PROMISE_IN_BOUNDS, True),
                  (mode.FILL_OR_DROP, False)):
    other = eqn.replace(params=dict(eqn.params, mode=m))
    assert forms.gather_keeps_slices_in_bounds(other) is want
