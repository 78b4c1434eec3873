import jax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl


def loss_fn(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"])
  pred = h @ params["w2"]
  kl.register_normal_predictive_distribution(pred, y)   # loss tag only:
  return jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))    # dense layers found


k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"w1": jax.random.normal(k1, (8, 32)) / 8 ** 0.5,
          "w2": jax.random.normal(k2, (32, 2)) / 32 ** 0.5}
x = jax.random.normal(k3, (64, 8))
batch = (x, jnp.stack([jnp.sin(x[:, 0]), jnp.cos(x[:, 1])], axis=-1))

collection = kl.scan(loss_fn, params, batch)   # auto-registers w1 and w2
tx = kl.kfac(3e-2, collection, damping=1e-2)
opt_state = tx.init(params)


# --8<-- [start:step]
@jax.jit
def step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
  return optax.apply_updates(params, updates), opt_state, loss
# --8<-- [end:step]


first = loss_fn(params, batch)
for _ in range(30):
  params, opt_state, loss = step(params, opt_state, batch)
print(f"loss {first:.4f} -> {loss:.4f}")
assert loss < first / 4, (first, loss)
