"""Linked parameters: leaves of different layers as one generic block."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax_lite as kl

B = 8


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _problem():
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {"enc": {"w": jax.random.normal(ks[0], (3, 4)) / 2,
                    "b": 0.1 * jax.random.normal(ks[1], (4,))},
            "dec": {"w": jax.random.normal(ks[2], (4, 3)) / 2}}
  batch = (jax.random.normal(ks[3], (B, 3)),
           jax.random.randint(ks[4], (B,), 0, 3))
  return params, batch


def loss_fn(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["enc"]["w"] + params["enc"]["b"])
  z = kl.register_categorical_predictive_distribution(
      h @ params["dec"]["w"], y)
  return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(B), y])


def _tagged(params, batch):
  p = {"enc": dict(params["enc"]), "dec": dict(params["dec"])}
  p["enc"]["w"], p["dec"]["w"] = kl.register_generic(
      (p["enc"]["w"], p["dec"]["w"]))
  return loss_fn(p, batch)


GROUP = ("['enc']['w']", "['dec']['w']")


@pytest.mark.parametrize("how,approx", [
    ("tag", "full"), ("link", "diagonal"),
    pytest.param("link", "full", marks=pytest.mark.slow),
    pytest.param("tag", "diagonal", marks=pytest.mark.slow)])
def test_linked_leaves_are_one_block_over_their_concatenation(how, approx):
  """Empirical mode: the cotangent of each position is its NLL gradient
  (``w = 1``, ``N = B``), so the summed source gradient is ``B ∇L`` and the
  block ``(1/B)(B ∇L)(B ∇L)ᵀ = B ∇L ∇Lᵀ`` over
  ``[vec W_enc; vec W_dec]``
  (its diagonal for ``diagonal``)."""
  params, batch = _problem()
  fn = (_tagged if how == "tag" else
        kl.link_parameters(loss_fn, [GROUP], approx=approx))
  col = kl.scan(fn, params, batch, approximations={"generic": approx})
  (linked,) = [l for l in col.layers if len(l.param_paths) == 2]
  assert set(linked.param_paths) == set(GROUP)
  assert (linked.kind, linked.approx) == ("generic", approx)
  est = kl.FisherEstimator(col, estimation_mode="empirical")
  state = jax.jit(lambda p, b: est.update_cache(est.update_curvature(
      est.init(p), p, b), damping=0.1))(params, batch)
  i = col.layers.index(linked)
  got = np.asarray(est.blocks[i].full_fisher_block(est.per_layer(state)[i]))
  g = jax.grad(loss_fn)(params, batch)
  flat = jnp.concatenate([g[k]["w"].reshape(-1) for k in ("enc", "dec")])
  want = B * jnp.outer(flat, flat)
  if approx == "diagonal":
    want = jnp.diag(jnp.diag(want))
  order = [linked.param_paths.index(p) for p in GROUP]
  assert order == [0, 1]  # the leaves in GROUP's (ravel) order
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-14)
  assert np.abs(want[:12, 12:]).max() > 0 or approx == "diagonal"
  # One damped inverse over the concatenation.
  v = jax.tree.map(lambda x: jnp.cos(jnp.arange(x.size).reshape(x.shape)
                                     + 0.0), params)
  out = est.multiply_inverse(state, v)
  vflat = jnp.concatenate([v[k]["w"].reshape(-1) for k in ("enc", "dec")])
  want_v = jnp.linalg.solve(want + 0.1 * jnp.eye(want.shape[0]), vflat)
  got_v = jnp.concatenate([out[k]["w"].reshape(-1) for k in ("enc", "dec")])
  np.testing.assert_allclose(got_v, want_v, rtol=1e-8)


def test_link_parameters_keeps_value_and_gradient_and_checks_groups():
  params, batch = _problem()
  linked = kl.link_parameters(loss_fn, [GROUP])
  np.testing.assert_array_equal(linked(params, batch), loss_fn(params, batch))
  jax.tree.map(np.testing.assert_array_equal, jax.grad(linked)(params, batch),
               jax.grad(loss_fn)(params, batch))
  col = kl.scan(linked, params, batch)
  assert any(l.param_paths == GROUP and l.approx == "diagonal"
             for l in col.layers)
  with pytest.raises(ValueError, match="prefix \"\\['nope'\\]\" .*matches no"):
    kl.scan(kl.link_parameters(loss_fn, [("['nope']",)]), params, batch)
  with pytest.raises(ValueError, match="is in groups 0 and 1"):
    kl.scan(kl.link_parameters(loss_fn, [("['enc']",), ("['enc']['w']",)]),
            params, batch)
  with pytest.raises(TypeError, match="non-empty tuple"):
    kl.link_parameters(loss_fn, ["['enc']"])(params, batch)
