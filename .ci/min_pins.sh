#!/usr/bin/env bash
# The default (fast) test tier again, in a fresh virtual environment holding
# the lowest versions pyproject.toml allows: the pins in
# .ci/min-constraints.txt, the rest of the test extra as the resolver picks.
# Non-interactive; run from anywhere; exits with pytest's status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_NO_INPUT=1
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q -c .ci/min-constraints.txt -e ".[test]"
"$tmp/venv/bin/python" -m pip list 2>/dev/null \
  | grep -iE '^(jax|jaxlib|optax|flax|equinox|numpy) ' || true
# The checkout, not another copy on PYTHONPATH, is what gets tested.
env -u PYTHONPATH "$tmp/venv/bin/python" -m pytest tests
