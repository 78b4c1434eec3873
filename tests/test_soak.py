"""A tiny run of benchmarks/soak.py, so that the soak script cannot rot.

The full-size figures (5,000 steps, 6 kills) are in docs/reliability.md;
here the same invariants are checked on 60 steps of a 784-16-10 MLP.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_soak_run_holds_every_invariant(mnist, tmp_path):
  # 60 steps measure the allocator's warm-up more than a leak: the RSS
  # bound is the full-size run's job, so it is wide here. An RSS sample
  # every step: the last worker may run only 10 steps (resumed from the
  # last checkpoint), and the growth needs 8 samples.
  cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"),
         "--steps", "60", "--hidden", "16", "--batch-size", "32",
         "--poison-fraction", "0.1", "--kills", "2", "--ckpt-every", "10",
         "--report-every", "1", "--rss-tolerance", "0.5",
         "--workdir", str(tmp_path), *mnist]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=900, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "all invariants hold" in out.stdout
  assert "[FAIL]" not in out.stdout
  assert "skip counter 5 == non-finite batches 5" in out.stdout, out.stdout
