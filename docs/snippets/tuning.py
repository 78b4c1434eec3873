import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl


def loss_fn(params, batch):
  x, labels = batch
  logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
  kl.register_categorical_predictive_distribution(logits, labels)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w1": jax.random.normal(k1, (16, 32)) / 4,
          "w2": jax.random.normal(k2, (32, 4)) / 32 ** 0.5}
batch = (jax.random.normal(k3, (64, 16)), jax.random.randint(k3, (64,), 0, 4))
collection = kl.scan(loss_fn, params, batch)

# --8<-- [start:schedules]
# Schedules of the step count, where optax takes them.
tx = kl.kfac(
    learning_rate=optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, 100),
    collection=collection,
    damping=optax.exponential_decay(1e-1, 50, 0.5, end_value=1e-3),
    momentum=0.9, inverse_update_period=5, norm_constraint=1e-2)

# Or hyperparameters set from outside the step (the periods stay static).
tx = optax.inject_hyperparams(
    kl.kfac, static_args=("collection", "inverse_update_period"))(
        learning_rate=3e-2, collection=collection, damping=1e-2,
        inverse_update_period=5)
opt_state = tx.init(params)
opt_state.hyperparams["damping"] = jnp.asarray(3e-2)   # e.g. a controller
# --8<-- [end:schedules]


@jax.jit
def step(params, opt_state, batch):
  grads = jax.grad(loss_fn)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
  return optax.apply_updates(params, updates), opt_state


first = loss_fn(params, batch)
for _ in range(20):
  params, opt_state = step(params, opt_state, batch)
print(f"loss {first:.3f} -> {loss_fn(params, batch):.3f}")
assert loss_fn(params, batch) < first / 2
