"""Sampling keys derived by integer hashing (no threefry in the step).

K-FAC's sampled Fisher needs a fresh key per step, per loss, per sample
and (data-parallel) per replica. ``jax.random.split``/``fold_in`` run
threefry, which XLA:CPU compiles as a ``while`` loop of scalar kernels
(docs/performance.md#hashed-keys). Here every derivation is a few integer
multiplies and shifts on a handful of ``uint32`` words (one small fused
kernel), and the draws themselves (:func:`random_bits`) hash a counter
with the key, elementwise, inside the kernel that consumes them.

The mixer is MurmurHash3's 32-bit finaliser ``fmix32`` (Appleby 2008), a
bijection of ``uint32`` with full avalanche; keys are chained through it
word by word, with a distinct odd constant per output word and per index.
Statistical quality only has to hold for drawing targets of a Fisher
estimate, and derived keys are deterministic functions of the caller's
key, so a run is reproducible.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio, odd.
_LANES = (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1)


def _u32(x):
  return jnp.asarray(x, jnp.uint32)


# The hash is written with lax's integer primitives and numpy scalar
# operands: no dtype promotion or broadcasting to resolve at trace time
# (docs/performance.md#hashed-keys).
_xor, _mul, _add = lax.bitwise_xor, lax.mul, lax.add


def _xorshift(h, bits: int):
  return _xor(h, lax.shift_right_logical(h, np.uint32(bits)))


def fmix32(h):
  """MurmurHash3's finaliser: a bijective avalanche mix of ``uint32``."""
  h = _xorshift(_mul(_xorshift(_u32(h), 16), np.uint32(0x85EBCA6B)), 13)
  return _xorshift(_mul(h, np.uint32(0xC2B2AE35)), 16)


def key_words(key) -> jnp.ndarray:
  """The ``uint32`` words of a typed key (any impl) or a raw key array."""
  if jnp.issubdtype(getattr(key, "dtype", None) or np.uint32,
                    jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  key = jnp.asarray(key)
  if key.dtype != jnp.uint32:
    raise TypeError(
        f"a sampling key must be a jax.random key or a uint32 array (e.g. "
        f"jax.random.PRNGKey(0)); got dtype {key.dtype}.")
  return key.reshape(-1)


def _absorb(h, words) -> jnp.ndarray:
  """``fmix32(h_K(... h_1(h)))`` with ``h_j(x) = fmix32(x ^ w_j) + φ``:
  ``h`` (any shape) chained through the key's words ``w_1..w_K``."""
  for i in range(words.shape[0]):
    w = lax.broadcast(lax.index_in_dim(words, i, keepdims=False), h.shape)
    h = _add(fmix32(_xor(h, w)), np.uint32(_GOLDEN))
  return fmix32(h)


def derive(key, index, num_words: int = 2) -> jnp.ndarray:
  """``num_words`` fresh ``uint32`` words from ``key`` and ``index``.

  Every output word depends on every input word and on ``index`` (an int
  or a traced integer scalar): distinct indices give unrelated words, like
  ``fold_in``. With ``num_words=2`` the result is a raw threefry key.
  """
  words = key_words(key)
  lanes = _u32(np.array(_LANES * (num_words // 4 + 1))[:num_words])
  mixed = fmix32(_add(_mul(_u32(index), np.uint32(_GOLDEN)), np.uint32(1)))
  return _absorb(fmix32(_xor(lanes, lax.broadcast(mixed, lanes.shape))),
                 words)


def step_keys(key):
  """``(this step's sampling key, the next state key)``, like ``split``."""
  return derive(key, 0), derive(key, 1)


def sample_keys(key, index: int, num: int) -> jnp.ndarray:
  """``[num, 2]`` keys for draw ``index`` (one per target sample)."""
  base = derive(key, index, num_words=2)
  salt = fmix32(_u32(np.arange(1, num + 1) * _GOLDEN & 0xFFFFFFFF))
  return fmix32(base[None, :] ^ salt[:, None] ^ _u32(np.array(_LANES[:2])))


def random_bits(key, shape) -> jnp.ndarray:
  """``uint32`` bits of ``shape``: a counter-based hash of ``key``.

  Element ``i`` (row-major) is ``h_K(... h_1(i))`` with
  ``h_j(x) = fmix32(x ^ w_j) + φ`` chained over the key's words
  ``w_1..w_K`` (``φ`` the golden-ratio constant) and a final ``fmix32``.
  Each ``h_j`` is a bijection, so the elements of one draw never collide,
  and every bit of every element depends on every key bit. It is
  elementwise integer arithmetic: XLA fuses it into the kernel that uses
  the draw, where ``RngBitGenerator`` is a kernel of its own
  (docs/performance.md#hashed-keys).
  """
  return _absorb(jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape),
                 key_words(key))


def uniform(key, shape, dtype=jnp.float32) -> jnp.ndarray:
  """Uniform draws in the open interval ``(0, 1)`` (24 random bits)."""
  bits = (random_bits(key, shape) >> 8).astype(jnp.float32)
  return ((bits + 0.5) * (1.0 / (1 << 24))).astype(dtype)
