"""Tags are the identity in value and gradient under every transformation."""

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import kfac_jax_lite as kl
from tests import helpers


def _dense(w, b, x, tag):
  y = x @ w + b
  return kl.register_dense(y, x, w, b) if tag else y


def _model(params, x, tag=True):
  w1, b1, w2, b2 = params
  h = jnp.tanh(_dense(w1, b1, x, tag))
  logits = _dense(w2, b2, h, tag)
  if tag:
    logits = kl.register_categorical_predictive_distribution(logits)
  return jnp.sum(jax.nn.log_softmax(logits) * jnp.cos(logits))


@pytest.fixture(name="setup")
def _setup():
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  params = (jax.random.normal(k[0], (3, 4)), jax.random.normal(k[1], (4,)),
            jax.random.normal(k[2], (4, 2)), jax.random.normal(k[3], (2,)))
  x = jax.random.normal(k[4], (5, 3))
  return params, x


def _assert_same(f, args):
  tagged = f(functools.partial(_model, tag=True), *args)
  plain = f(functools.partial(_model, tag=False), *args)
  for a, b in zip(jax.tree.leaves(tagged), jax.tree.leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_value_and_grad_equal_untagged(setup):
  _assert_same(lambda m, p, x: jax.value_and_grad(m)(p, x), setup)
  _assert_same(lambda m, p, x: jax.jit(jax.grad(m, argnums=1))(p, x), setup)


@pytest.mark.slow
def test_check_grads_through_tags(setup):
  # float64, so that finite differences are accurate enough for order 2.
  with jax.enable_x64(True):
    params, x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), setup)
    check_grads(lambda p, x: _model(p, x), (params, x), order=2,
                modes=("fwd", "rev"))


def test_vmap(setup):
  params, x = setup
  f = lambda m, p, x: jax.vmap(jax.grad(m), in_axes=(None, 0))(p, x[:, None])
  _assert_same(f, (params, x))


def test_remat(setup):
  _assert_same(lambda m, p, x: jax.grad(jax.checkpoint(m))(p, x), setup)


def test_scan(setup):
  params, x = setup

  def run(m, p, x):
    def body(c, xt):
      return c + m(p, xt[None]), None
    return jax.grad(lambda p: lax.scan(body, 0.0, x)[0])(p)
  _assert_same(run, (params, x))


def test_cond(setup):
  params, x = setup

  def run(m, p, x):
    f = lambda p: lax.cond(jnp.sum(x) > -1e9, lambda q: m(q, x),
                           lambda q: 2.0 * m(q, x), p)
    return jax.value_and_grad(f)(p)
  _assert_same(run, (params, x))


def test_pmap_two_devices(setup):
  with helpers.on_replica_devices(2) as devices:
    params, x = jax.tree.map(np.asarray, setup)  # Placed in the block.
    xs = jnp.stack([x, x + 1.0])

    def run(m, p, xs):
      g = jax.pmap(lambda xi: jax.lax.pmean(jax.grad(m)(p, xi), "d"),
                   axis_name="d", devices=devices)(xs)
      return g
    _assert_same(run, (params, xs))


def test_tag_metadata_is_static():
  x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  jaxpr = jax.make_jaxpr(lambda w: kl.register_conv2d(
      jnp.ones((2, 1, 1, 4)), x.reshape(2, 1, 1, 3), w.reshape(1, 1, 3, 4),
      strides=[1, 2, 2, 1], padding="SAME"))(w)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name ==
            "kfac_layer_tag"]
  meta = dict(eqn.params["meta"])
  assert meta["window_strides"] == (2, 2)
  assert meta["padding"] == "SAME"
  assert eqn.params["kind"] == "conv"


@pytest.mark.parametrize("bad", [jnp.ones(()), "x"])
def test_loss_tag_weight_must_be_static(bad):
  with pytest.raises(TypeError, match="weight"):
    kl.register_categorical_predictive_distribution(jnp.ones((2, 3)),
                                                    weight=bad)


def test_loss_tag_weight_must_be_positive():
  with pytest.raises(ValueError, match="weight=-1"):
    kl.register_categorical_predictive_distribution(jnp.ones((2, 3)),
                                                    weight=-1.0)
