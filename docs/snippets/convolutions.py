import jax
from jax import lax
import jax.numpy as jnp
import optax
import kfac_jax_lite as kl

DN = ("NHWC", "HWIO", "NHWC")


def loss_fn(params, batch):
  x, labels = batch                              # x: [B, 8, 8, 3]
  w, b = params["conv"]["w"], params["conv"]["b"]
  y = lax.conv_general_dilated(x, w, (2, 2), "SAME",
                               dimension_numbers=DN) + b
  y = kl.register_conv2d(y, x, w, b, strides=2, padding="SAME",
                         approx="kron")  # or "diagonal", "kron_reduce", ...
  h = jnp.tanh(y).reshape(x.shape[0], -1)        # [B, 4 * 4 * 8]
  logits = h @ params["head"]                    # found automatically
  kl.register_categorical_predictive_distribution(logits, labels)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()


k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
params = {"conv": {"w": jax.random.normal(k1, (3, 3, 3, 8)) / 27 ** 0.5,
                   "b": jnp.zeros(8)},
          "head": jax.random.normal(k2, (128, 10)) / 128 ** 0.5}
batch = (jax.random.normal(k3, (32, 8, 8, 3)),
         jax.random.randint(k3, (32,), 0, 10))

collection = kl.scan(loss_fn, params, batch)
print(collection.describe())
tx = kl.kfac(1e-2, collection, damping=1e-2)
opt_state = tx.init(params)


@jax.jit
def step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
  return optax.apply_updates(params, updates), opt_state, loss


first = loss_fn(params, batch)
for _ in range(20):
  params, opt_state, loss = step(params, opt_state, batch)
print(f"loss {first:.3f} -> {loss:.3f}")
assert loss < first / 2, (first, loss)
