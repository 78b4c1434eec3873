"""The lowest versions CI tests (.ci/min-constraints.txt) are pyproject's.

.ci/min_pins.sh installs the test extra with the pins of
.ci/min-constraints.txt and runs the default tier; each pin must be the lower
bound that pyproject.toml's dependencies and test extra state, so neither
can move without the other. (The examples extra may ask for more: its nnx
examples need a newer flax.)
"""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PINNED = ("jax", "jaxlib", "optax", "flax", "equinox")


def _version(text):
  parts = [int(p) for p in text.split(".")]
  while len(parts) > 1 and parts[-1] == 0:
    parts.pop()
  return tuple(parts)


def _lower_bounds():
  """``{package: [lower bound, ...]}`` over the dependencies and the test
  extra."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  lists = [project["dependencies"], project["optional-dependencies"]["test"]]
  out = {}
  for req in (r for reqs in lists for r in reqs):
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", req)
    if m:
      out.setdefault(m.group(1).lower(), []).append(m.group(2))
  return out


def _pins():
  out = {}
  for line in (ROOT / ".ci" / "min-constraints.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      out[name.strip().lower()] = version.strip()
  return out


def test_constraints_pin_pyprojects_lower_bounds():
  bounds, pins = _lower_bounds(), _pins()
  assert set(pins) == set(PINNED), pins
  for name in PINNED:
    assert name in bounds, f"pyproject.toml states no lower bound for {name}"
    for bound in bounds[name]:
      assert _version(bound) == _version(pins[name]), (
          f"pyproject.toml says {name}>={bound} but .ci/min-constraints.txt "
          f"pins {name}=={pins[name]}; change both together.")

