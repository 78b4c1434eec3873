"""scan(): layers, kinds, parameter paths, use counts, and errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import kfac_jax_lite as kl
from tests import helpers
from tests import problems


def _summary(collection):
  return [(l.kind, l.param_paths, l.num_uses, l.approx, l.found_by)
          for l in collection.layers]


def test_plain_jax_mlp():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [6, 5, 4, 3])
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 8, 6, 3)
  c = kl.scan(helpers.classifier_loss, params, batch)
  assert _summary(c) == [
      ("fully_connected", (f"['layer{i}']['w']", f"['layer{i}']['b']"), 1,
       "kron", "tag") for i in range(3)]
  assert c.losses[0].kind == "categorical"
  assert c.losses[0].has_targets
  assert set(c.registered_variables) == set(c.leaf_paths)
  c.check_registration(params)
  assert "fully_connected" in c.describe()
  assert hash(c) == hash(kl.scan(helpers.classifier_loss, params, batch))


class TaggedDense(nn.Module):
  features: int
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    w = self.param("kernel", nn.initializers.lecun_normal(),
                   (x.shape[-1], self.features))
    y = x @ w
    b = None
    if self.use_bias:
      b = self.param("bias", nn.initializers.zeros, (self.features,))
      y = y + b
    return kl.register_dense(y, x, w, b)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(TaggedDense(8)(x))
    x = nn.relu(TaggedDense(8, use_bias=False)(x))
    return TaggedDense(3)(x)


def test_flax_linen_mlp():
  model = MLP()
  x, y = helpers.classification_batch(jax.random.PRNGKey(1), 4, 5, 3)
  variables = model.init(jax.random.PRNGKey(0), x)

  def loss_fn(variables, batch):
    logits = model.apply(variables, batch[0])
    kl.register_categorical_predictive_distribution(logits, batch[1])
    return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]))

  c = kl.scan(loss_fn, variables, (x, y))
  assert [(l.kind, l.param_paths, l.num_uses) for l in c.layers] == [
      ("fully_connected", ("['params']['TaggedDense_0']['kernel']",
                           "['params']['TaggedDense_0']['bias']"), 1),
      ("fully_connected", ("['params']['TaggedDense_1']['kernel']",), 1),
      ("fully_connected", ("['params']['TaggedDense_2']['kernel']",
                           "['params']['TaggedDense_2']['bias']"), 1)]
  assert c.layers[1].has_bias is False


def test_nested_jit_and_checkpoint():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [4, 4, 2])
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 3, 4, 2)

  @jax.jit
  def first(p, x):
    return jnp.tanh(kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"]))

  @jax.checkpoint
  def second(p, x):
    return kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])

  def loss_fn(params, batch):
    logits = second(params["layer1"], first(params["layer0"], batch[0]))
    kl.register_categorical_predictive_distribution(logits, batch[1])
    return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]))

  c = kl.scan(loss_fn, params, batch)
  assert [(l.kind, l.num_uses, l.found_by) for l in c.layers] == [
      ("fully_connected", 1, "tag")] * 2


rnn_loss = problems.rnn_loss
rnn_setup = problems.rnn_setup


def test_rnn_cell_in_scan_is_one_multi_use_layer():
  params, batch = rnn_setup(t=5)
  c = kl.scan(rnn_loss, params, batch)
  cell = c.layer("['cell']")
  assert cell.num_uses == 5
  assert cell.approx == "kron_indep"
  assert c.layer("['out']").num_uses == 1


def test_same_dense_twice_is_one_layer_with_two_uses():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [4, 4])
  p = params["layer0"]

  def loss_fn(params, batch):
    p = params["layer0"]
    dense = lambda x: kl.register_dense(x @ p["w"] + p["b"], x, p["w"],
                                        p["b"])
    out = dense(jnp.tanh(dense(batch)))
    kl.register_normal_predictive_distribution(out)
    return jnp.mean(jnp.sum(out ** 2, axis=-1))

  c = kl.scan(loss_fn, params, jnp.ones((2, 4)))
  assert _summary(c) == [("fully_connected", ("['layer0']['w']",
                                              "['layer0']['b']"), 2,
                          "kron_indep", "tag")]
  del p


def test_approximation_resolution_order():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [6, 5, 4, 3])
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 8, 6, 3)
  c = kl.scan(helpers.classifier_loss, params, batch, approximations={
      "fully_connected": "kron_in_diag", "['layer1']": "kron_out_diag"})
  assert [l.approx for l in c.layers] == [
      "kron_in_diag", "kron_out_diag", "kron_in_diag"]

  def explicit(params, batch):
    p = params["layer0"]
    x = batch[0]
    s = kl.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"],
                          approx="kron_both_diag")
    kl.register_normal_predictive_distribution(s)
    return jnp.sum(s)

  params1 = {"layer0": params["layer0"]}
  c = kl.scan(explicit, params1, batch,
              approximations={"['layer0']": "kron_in_diag"})
  assert c.layers[0].approx == "kron_both_diag"


def test_leftover_params_are_generic_and_listed():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [4, 3])
  params["temperature"] = jnp.ones(())

  def loss_fn(params, batch):
    p = params["layer0"]
    s = kl.register_dense(batch @ p["w"] + p["b"], batch, p["w"], p["b"])
    s = s * params["temperature"]
    kl.register_normal_predictive_distribution(s)
    return jnp.mean(jnp.sum(s ** 2, axis=-1))

  c = kl.scan(loss_fn, params, jnp.ones((2, 4)))
  generic = c.layer("['temperature']")
  assert (generic.kind, generic.approx, generic.found_by) == (
      "generic", "diagonal", "leftover")
  assert "fallbacks:" in c.describe()
  assert "['temperature']" in c.describe().split("fallbacks:")[1]
  with pytest.raises(ValueError, match=r"strict=True.*\['temperature'\]"):
    kl.scan(loss_fn, params, jnp.ones((2, 4)), strict=True)


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def test_error_no_loss_tag():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [4, 3])

  def loss_fn(params, x):
    p = params["layer0"]
    return jnp.sum(kl.register_dense(x @ p["w"], x, p["w"]))

  with pytest.raises(ValueError, match="no loss tag"):
    kl.scan(loss_fn, params, jnp.ones((2, 4)))


def _loss_with(tagged_w):
  def loss_fn(params, x):
    w = tagged_w(params, x)
    s = kl.register_dense(x @ w, x, w)
    kl.register_normal_predictive_distribution(s)
    return jnp.sum(s)
  return loss_fn


def test_error_tag_param_from_several_leaves():
  params = {"a": jnp.ones((4, 3)), "b": jnp.ones((4, 3))}
  with pytest.raises(ValueError, match=r"computed by `add` from parameter "
                     r"leaves \[\"\['a'\]\", \"\['b'\]\"\]"):
    kl.scan(_loss_with(lambda p, x: p["a"] + p["b"]), params,
            jnp.ones((2, 4)))


def test_error_tag_param_from_data():
  params = {"a": jnp.ones((4, 3))}
  with pytest.raises(ValueError, match="does not come from a parameter leaf"):
    kl.scan(_loss_with(lambda p, x: jnp.ones((4, 3)) * x[0, 0]), params,
            jnp.ones((2, 4)))


def test_error_leaf_in_two_layers():
  params = {"w": jnp.ones((4, 4)), "b1": jnp.ones(4), "b2": jnp.ones(4)}

  def loss_fn(params, x):
    w = params["w"]
    h = kl.register_dense(x @ w + params["b1"], x, w, params["b1"])
    o = kl.register_dense(h @ w + params["b2"], h, w, params["b2"])
    kl.register_normal_predictive_distribution(o)
    return jnp.sum(o)

  with pytest.raises(ValueError, match=r"\['w'\] is in two different layers"):
    kl.scan(loss_fn, params, jnp.ones((2, 4)))


def test_error_unknown_approx():
  params = {"w": jnp.ones((4, 3))}

  def loss_fn(params, x):
    s = kl.register_dense(x @ params["w"], x, params["w"], approx="kron_x")
    kl.register_normal_predictive_distribution(s)
    return jnp.sum(s)

  with pytest.raises(ValueError, match="approx='kron_x'.*choose one of"):
    kl.scan(loss_fn, params, jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r"approximations\['conv'\]='nope'"):
    kl.scan(helpers.classifier_loss,
            helpers.mlp_params(jax.random.PRNGKey(0), [4, 2]),
            helpers.classification_batch(jax.random.PRNGKey(0), 2, 4, 2),
            approximations={"conv": "nope"})


def test_check_registration_missing_and_double():
  params = helpers.mlp_params(jax.random.PRNGKey(0), [4, 3, 2])
  batch = helpers.classification_batch(jax.random.PRNGKey(1), 2, 4, 2)
  c = kl.scan(helpers.classifier_loss, params, batch)
  extra = dict(params, extra={"v": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"\['extra'\]\['v'\] is not "
                     "registered"):
    c.check_registration(extra)
  doubled = c.__class__(
      layers=c.layers + c.layers[:1], losses=c.losses,
      leaf_paths=c.leaf_paths, params_treedef=c.params_treedef,
      loss_fn=c.loss_fn)
  with pytest.raises(ValueError, match=r"\['layer0'\]\['w'\] is registered "
                     "in 2 layers"):
    doubled.check_registration(params)


def test_error_integer_params():
  params = {"w": jnp.ones((4, 3)), "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(TypeError, match=r"params\['step'\] has dtype int32"):
    kl.scan(_loss_with(lambda p, x: p["w"]), params, jnp.ones((2, 4)))


def test_error_not_scalar_loss():
  params = {"w": jnp.ones((4, 3))}

  def loss_fn(params, x):
    s = kl.register_dense(x @ params["w"], x, params["w"])
    kl.register_normal_predictive_distribution(s)
    return s

  with pytest.raises(ValueError, match="scalar loss"):
    kl.scan(loss_fn, params, jnp.ones((2, 4)))
