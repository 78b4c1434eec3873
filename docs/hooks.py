"""mkdocs hooks: the reference tables, generated from the code.

``<!-- generated: NAME -->`` in a page is replaced by ``TABLES[NAME]()``,
so the reference tables are built from the registries the package itself
uses (``kinds.py``, ``linearization.py``) and cannot drift from them.
``tests/test_docs.py`` imports this module to check the tables too.
"""

import re

from kfac_jax_lite import kinds
from kfac_jax_lite import linearization
from kfac_jax_lite import tags

# One line per estimation mode. A mode added to linearization.MODES without a
# line here fails the docs build (and tests/test_docs.py).
MODE_NOTES = {
    "gradients": (
        "targets sampled from the model's predictive distribution",
        "the Fisher; `num_samples` draws per position"),
    "empirical": (
        "the data targets",
        "the empirical Fisher; loss tags need `targets`"),
    "curvature_prop": (
        "Rademacher vectors through a factor of the loss's Fisher",
        "unbiased, no sampling of targets"),
    "curvature_prop_GGN": (
        "Rademacher vectors through a factor of the loss's GGN",
        "the GGN; equals the Fisher for the three registered losses"),
    "exact": (
        "every column of the loss's Fisher factor",
        "no sampling noise; cost grows with the output size"),
    "exact_GGN": (
        "every column of the loss's GGN factor",
        "as `exact`, for the GGN"),
}

# The register_* function of each layer kind.
KIND_TAGS = {
    "fully_connected": "register_dense",
    "conv": "register_conv, register_conv2d",
    "depthwise_conv": "register_depthwise_conv2d",
    "separable_conv": "register_separable_conv2d",
    "embedding": "register_embedding",
    "tied_embedding": "(automatic: a table looked up and used as x @ W.T)",
    "scale_and_shift": "register_scale_and_shift",
    "generic": "register_generic (and every parameter left over)",
}


def modes_table() -> str:
  """The estimation modes, their kfac-jax names and what they sample."""
  aliases = {v: k for k, v in linearization.MODE_ALIASES.items()}
  missing = set(linearization.MODES) - set(MODE_NOTES)
  if missing:
    raise ValueError(f"docs/hooks.py: MODE_NOTES lacks {sorted(missing)}.")
  lines = ["| mode | kfac-jax name | output gradients from | notes |",
           "|---|---|---|---|"]
  for m in linearization.MODES:
    source, note = MODE_NOTES[m]
    alias = f"`{aliases[m]}`" if m in aliases else ""
    lines.append(f"| `{m}` | {alias} | {source} | {note} |")
  return "\n".join(lines)


def tags_table() -> str:
  """Each layer kind, the function that tags it, and its default."""
  missing = set(tags.LAYER_KINDS) - set(KIND_TAGS)
  if missing:
    raise ValueError(f"docs/hooks.py: KIND_TAGS lacks {sorted(missing)}.")
  lines = ["| kind | tagged by | default (used once) | default (multi-use) |",
           "|---|---|---|---|"]
  for name, row in kinds.KINDS.items():
    fns = ", ".join(f"`{f.strip()}`" if f.strip().startswith("register")
                    else f.strip() for f in KIND_TAGS[name].split(","))
    lines.append(f"| `{name}` | {fns} | `{row.approximations[0]}` | "
                 f"`{row.multi_approximations[0]}` |")
  return "\n".join(lines)


TABLES = {
    "kinds_table": kinds.markdown_table,
    "modes_table": modes_table,
    "tags_table": tags_table,
}

_MARKER = re.compile(r"<!-- generated: (\w+) -->")


def on_page_markdown(markdown, page, config, files):
  """Replaces every ``<!-- generated: NAME -->`` marker by its table."""
  del page, config, files

  def table(match):
    name = match.group(1)
    if name not in TABLES:
      raise ValueError(f"docs/hooks.py: no generated table {name!r}; the "
                       f"tables are {sorted(TABLES)}.")
    return TABLES[name]()

  return _MARKER.sub(table, markdown)

