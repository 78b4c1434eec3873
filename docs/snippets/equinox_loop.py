import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl

key = jax.random.PRNGKey(0)
model = eqx.nn.MLP(32, 10, 64, 2, activation=jnp.tanh, key=key)
batch = {"image": jax.random.normal(key, (128, 32)),
         "label": jax.random.randint(key, (128,), 0, 10)}

# K-FAC needs a pure loss_fn(params, batch): split the model once.
params, static = eqx.partition(model, eqx.is_inexact_array)


def loss_fn(params, batch):
  logits = jax.vmap(eqx.combine(params, static))(batch["image"])
  kl.register_categorical_predictive_distribution(logits, batch["label"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["label"]).mean()


collection = kl.scan(loss_fn, params, batch)    # the three Linear layers
print(collection.describe())
assert [l.kind for l in collection.layers] == ["fully_connected"] * 3
tx = kl.kfac(2e-2, collection, damping=1e-2)
opt_state = tx.init(params)


@eqx.filter_jit
def train_step(model, opt_state, batch):
  def model_loss(m):
    return loss_fn(eqx.filter(m, eqx.is_inexact_array), batch)
  loss, grads = eqx.filter_value_and_grad(model_loss)(model)
  params = eqx.filter(model, eqx.is_inexact_array)
  updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
  return eqx.apply_updates(model, updates), opt_state, loss


model, opt_state, first = train_step(model, opt_state, batch)
for _ in range(20):
  model, opt_state, loss = train_step(model, opt_state, batch)
print(f"loss {first:.3f} -> {loss:.3f}")
assert loss < first / 2, (first, loss)
