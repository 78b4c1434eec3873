"""A griffe extension: the reST bits of the docstrings, as Markdown.

The package's docstrings are Google style with reST math and roles (the
house style, as in optax). Before mkdocstrings renders them this turns
``.. math::`` blocks into ``$$ ... $$``, ``:math:`x``` into ``$x$`` (both
typeset by MathJax through ``pymdownx.arithmatex``) and ``:func:`~a.b```
into ```b```.
"""

import re

import griffe

_BLOCK = re.compile(
    r"^(?P<indent>[ ]*)\.\. math::[ ]*(?P<first>.*)\n"
    r"(?P<rest>(?:(?P=indent)[ ]+\S.*\n|[ ]*\n(?=(?P=indent)[ ]+\S))*)",
    re.MULTILINE)
_INLINE = re.compile(r":math:`([^`]+)`")
_ROLE = re.compile(r":(?:func|class|data|mod|meth|attr|obj|exc):`~?([^`]+)`")


def _block(match) -> str:
  indent = match.group("indent")
  lines = [match.group("first")] + match.group("rest").splitlines()
  body = " ".join(l.strip() for l in lines if l.strip())
  return f"{indent}$$\n{indent}{body}\n{indent}$$\n"


def _role(match) -> str:
  name = match.group(1)
  if match.group(0).split("`")[1].startswith("~"):
    name = name.rsplit(".", 1)[-1]
  return f"`{name}`"


def convert(text: str) -> str:
  """The docstring ``text`` with its reST math and roles as Markdown."""
  text = _BLOCK.sub(_block, text + "\n").rstrip("\n")
  text = _INLINE.sub(lambda m: f"${m.group(1).strip()}$", text)
  return _ROLE.sub(_role, text)


class RestToMarkdown(griffe.Extension):
  """Converts every docstring griffe loads (see the module docstring)."""

  def on_instance(self, *, obj, **kwargs):
    del kwargs
    if obj.docstring is not None:
      obj.docstring.value = convert(obj.docstring.value)
