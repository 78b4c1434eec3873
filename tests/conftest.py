"""Test configuration: 4 simulated CPU devices for pmap/shard_map tests.

XLA_FLAGS must be set before jax initialises its backends, so this runs at
conftest import time, before any test module imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
