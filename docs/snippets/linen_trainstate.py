import flax.linen as nn
from flax.training import train_state
import jax
import optax
import kfac_jax_lite as kl


class MLP(nn.Module):                 # plain linen: no tags in the model

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(64)(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(10)(x)


model = MLP()
key, data_key = jax.random.split(jax.random.PRNGKey(0))
batch = {"image": jax.random.normal(data_key, (128, 32)),
         "label": jax.random.randint(data_key, (128,), 0, 10)}
params = model.init(key, batch["image"])["params"]


def loss_fn(params, batch):           # params: the linen "params" collection
  logits = model.apply({"params": params}, batch["image"])
  kl.register_categorical_predictive_distribution(logits, batch["label"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["label"]).mean()


collection = kl.scan(loss_fn, params, batch)  # Dense and LayerNorm found
print(collection.describe())
tx = kl.kfac(2e-2, collection, damping=3e-3, momentum=0.5)
state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                      tx=tx)
value_grad_and_stats = kl.value_grad_and_stats(loss_fn, collection)


# --8<-- [start:step]
@jax.jit
def train_step(state, batch, rng):
  loss, grads, stats = value_grad_and_stats(state.params, batch, rng)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params,
                                       stats=stats)
  params = optax.apply_updates(state.params, updates)
  return state.replace(step=state.step + 1, params=params,
                       opt_state=opt_state), loss
# --8<-- [end:step]


first = loss_fn(state.params, batch)
for i in range(20):
  state, loss = train_step(state, batch, jax.random.PRNGKey(i))
print(f"loss {first:.3f} -> {loss:.3f}")
assert loss < first / 2, (first, loss)
