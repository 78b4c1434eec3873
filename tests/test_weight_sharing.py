"""K-FAC-expand (``kron_indep``) and K-FAC-reduce (``kron_reduce``).

Eschenhagen et al. (2023), "Kronecker-Factored Approximate Curvature for
Modern Neural Network Architectures": for a deep linear network with a
squared-error loss, each approximation equals the exact GGN block of every
layer in its own weight-sharing setting: expand when every position has its
own loss, reduce when the outputs are reduced over the shared axis before
the loss. Checked against an explicit dense ``Jᵀ H J`` (x64).
"""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kl

B, T, SIZES = 4, 3, (3, 4, 2)


@pytest.fixture(name="x64", autouse=True)
def _x64():
  with jax.enable_x64(True):
    yield


def _params(seed=0):
  params = {}
  key = jax.random.PRNGKey(seed)
  for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
    key, k1, k2 = jax.random.split(key, 3)
    params[f"l{i}"] = {"b": 0.1 * jax.random.normal(k1, (b,)),
                       "w": jax.random.normal(k2, (a, b)) / np.sqrt(a)}
  return params


def _linear(params, x):
  """A deep linear network applied at every position of ``x: [B, T, d]``."""
  for i in range(len(SIZES) - 1):
    x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
  return x


def _data(seed=1):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return {"x": jax.random.normal(kx, (B, T, SIZES[0])),
          "y_seq": jax.random.normal(ky, (B, T, SIZES[-1])),
          "y": jax.random.normal(ky, (B, SIZES[-1]))}


def _expand_outputs(params, batch):
  return _linear(params, batch["x"])                   # [B, T, d]: per position


def _reduce_outputs(params, batch):
  return jnp.sum(_linear(params, batch["x"]), axis=1)  # [B, d]: reduced


SETTINGS = {
    "expand": (_expand_outputs, "y_seq"),
    "reduce": (_reduce_outputs, "y"),
}


def _loss_fn(setting):
  outputs, target = SETTINGS[setting]

  def loss_fn(params, batch):
    z = outputs(params, batch)
    y = batch[target]
    kl.register_squared_error_loss(z, y)
    return jnp.mean(jnp.sum((z - y) ** 2, axis=-1))
  return loss_fn


def _explicit_ggn_blocks(setting, params, batch):
  """The layers' diagonal blocks of ``Jᵀ H J`` of the scalar loss."""
  outputs, target = SETTINGS[setting]
  flat, unravel = jax.flatten_util.ravel_pytree(params)
  z_of = lambda p: outputs(unravel(p), batch)  # noqa: E731
  z = z_of(flat)
  jac = jax.jit(jax.jacobian(lambda p: z_of(p).reshape(-1)))(flat)
  hess = jax.jit(jax.hessian(lambda zz: jnp.mean(jnp.sum(
      (zz.reshape(z.shape) - batch[target]) ** 2, axis=-1))))(z.reshape(-1))
  ggn = np.asarray(jac.T @ hess @ jac)
  sizes = [sum(x.size for x in jax.tree.leaves(params[k]))
           for k in sorted(params)]
  owner = np.repeat(np.arange(len(sizes)), sizes)
  return np.where(owner[:, None] == owner[None, :], ggn, 0.0)


def _kfac_blocks(setting, approx, params, batch):
  # The kind key reaches the multi-use layers; "kron" is kron_indep there.
  key = "kron" if approx == "kron_indep" else approx
  collection = kl.scan(_loss_fn(setting), params, batch,
                       approximations={"fully_connected": key})
  assert {l.approx for l in collection.layers} == {approx}
  assert {l.num_uses for l in collection.layers} == {T}
  est = kl.FisherEstimator(collection, estimation_mode="exact_GGN")
  return np.asarray(jax.jit(lambda p, b: est.full_fisher(est.update_curvature(
      est.init(p), p, b)))(params, batch))


@pytest.mark.parametrize("setting,exact,other", [
    ("expand", "kron_indep", "kron_reduce"),
    pytest.param("reduce", "kron_reduce", "kron_indep",
                 marks=pytest.mark.slow)])
def test_each_approximation_is_exact_in_its_own_setting(setting, exact,
                                                        other):
  params, batch = _params(), _data()
  want = _explicit_ggn_blocks(setting, params, batch)
  np.testing.assert_allclose(_kfac_blocks(setting, exact, params, batch),
                             want, rtol=1e-9, atol=1e-12)
  # The other one is not (the settings tell them apart).
  got = _kfac_blocks(setting, other, params, batch)
  assert np.abs(got - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.slow
def test_reduce_with_a_mean_over_the_shared_axis_is_exact_too():
  params, batch = _params(), _data()

  def loss_fn(params, batch):
    z = jnp.mean(_linear(params, batch["x"]), axis=1)
    kl.register_squared_error_loss(z, batch["y"])
    return jnp.mean(jnp.sum((z - batch["y"]) ** 2, axis=-1))
  collection = kl.scan(loss_fn, params, batch,
                       approximations={"fully_connected_multi":
                                       "kron_reduce"})
  est = kl.FisherEstimator(collection, estimation_mode="exact_GGN")
  state = est.update_curvature(est.init(params), params, batch)
  want = _explicit_ggn_blocks("reduce", params, batch) / T ** 2
  np.testing.assert_allclose(est.full_fisher(state), want, rtol=1e-9,
                             atol=1e-12)


def _attention(params, x):
  """One self-attention layer, its output mean-pooled to class logits."""
  p = params["attn"]
  q, k, v = (x @ p[n]["w"] + p[n]["b"] for n in ("q", "k", "v"))
  att = jax.nn.softmax(q @ jnp.swapaxes(k, 1, 2) / np.sqrt(q.shape[-1]))
  o = (att @ v) @ p["o"]["w"] + p["o"]["b"]
  return jnp.mean(o, axis=1) @ params["out"]["w"] + params["out"]["b"]


def _attention_problem():
  d, classes = 4, 3
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))

  def dense(a, b):
    return {"b": 0.1 * jax.random.normal(next(keys), (b,)),
            "w": jax.random.normal(next(keys), (a, b)) / np.sqrt(a)}
  params = {"attn": {n: dense(d, d) for n in ("q", "k", "v", "o")},
            "out": dense(d, classes)}
  batch = {"x": jax.random.normal(next(keys), (B, T, d)),
           "y": jax.random.randint(next(keys), (B,), 0, classes)}

  def loss_fn(params, batch):
    logits = _attention(params, batch["x"])
    kl.register_categorical_predictive_distribution(logits, batch["y"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]))
  return params, batch, loss_fn


@pytest.mark.slow
def test_attention_projections_take_reduce_factors_by_path_prefix():
  """``A = mean_b ā ā^T`` (ā the position mean of ``[x; 1]``) and, in the
  empirical mode, ``G = mean_b ḡ ḡ^T`` with ``ḡ = Σ_t ∂ℓ_b/∂y_t``, the
  gradient of example ``b``'s loss with respect to the bias."""
  params, batch, loss_fn = _attention_problem()
  collection = kl.scan(loss_fn, params, batch,
                       approximations={"['attn']": "kron_reduce"})
  by_name = {l.param_paths[0]: l for l in collection.layers}
  for n in ("q", "k", "v", "o"):
    assert by_name[f"['attn']['{n}']['w']"].approx == "kron_reduce"
  assert by_name["['out']['w']"].approx == "kron"
  est = kl.FisherEstimator(collection, estimation_mode="empirical")
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b))(
      params, batch)
  blocks = dict(zip((l.param_paths[0] for l in collection.layers),
                    est.per_layer(state)))

  def example_loss(p, x, y):
    logits = _attention(p, x[None])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y[None])[0]

  @jax.jit
  def expected(params, batch):
    per_example = jax.vmap(jax.grad(example_loss), (None, 0, 0))(
        params, batch["x"], batch["y"])
    x = batch["x"]
    p = params["attn"]
    inputs = {"q": x, "k": x, "v": x}
    q, k, v = (x @ p[n]["w"] + p[n]["b"] for n in ("q", "k", "v"))
    inputs["o"] = jax.nn.softmax(
        q @ jnp.swapaxes(k, 1, 2) / np.sqrt(q.shape[-1])) @ v
    out = {}
    for n in ("q", "k", "v", "o"):
      a_bar = jnp.mean(jnp.concatenate(
          [inputs[n], jnp.ones(inputs[n].shape[:-1] + (1,))], -1), axis=1)
      g_bar = per_example["attn"][n]["b"]
      out[n] = (a_bar.T @ a_bar / B, g_bar.T @ g_bar / B)
    return out
  want = expected(params, batch)
  for n in ("q", "k", "v", "o"):
    s = blocks[f"['attn']['{n}']['w']"]
    np.testing.assert_allclose(s.a, want[n][0], rtol=1e-9)
    np.testing.assert_allclose(s.g, want[n][1], rtol=1e-9,
                               atol=1e-14)
    np.testing.assert_allclose(s.scale, 1.0)
  # And the transform runs with them.
  tx = kl.kfac(1e-2, collection)
  updates, _ = jax.jit(lambda p, b: tx.update(
      jax.grad(loss_fn)(p, b), tx.init(p), p, batch=b))(params, batch)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
