"""Seconds from the end of a training script to the end of its process.

Runs each exit case of ``tests/test_exit.py`` (``tests/exit_child.py``: a
script that queues steps without waiting for them, then ends, exits,
raises, is signalled or loses a thread) and prints its exit status and
how long the process took to go after the script's end, for K-FAC and,
on the ``end`` and ``wait`` cases, for Adam. ``wait`` is the reference: a
script that waits for its steps (``waited`` seconds) before it ends.

Run::

  python benchmarks/exit_times.py               # 1 device, jax.jit
  python benchmarks/exit_times.py 8 pmap        # 8 simulated devices
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))

from tests import test_exit  # noqa: E402


def main(devices: int = 1, mode: str = "jit") -> None:
  cases = dict(test_exit.CASES, wait=(None, 0))
  cache = tempfile.mkdtemp()
  print(f"{'case':15s} {'optimizer':9s} status expected  end->exit  waited")
  for case, (_, want) in cases.items():
    for adam in (False, True):
      if adam and case not in ("end", "wait"):
        continue
      test_exit.CASES.setdefault(case, cases[case])
      status, seconds, out = test_exit.run_case(case, devices, mode, cache,
                                                adam=adam)
      waited = [l.split()[1] for l in out.splitlines()
                if l.startswith("waited")]
      print(f"{case:15s} {'adam' if adam else 'kfac_adamw':9s} "
            f"{status:6d} {want:8d} {seconds:8.2f} s  "
            f"{waited[0] + ' s' if waited else ''}", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 1,
       sys.argv[2] if len(sys.argv) > 2 else "jit")
