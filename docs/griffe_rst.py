"""A griffe extension: the reST bits of the docstrings, as Markdown.

The package's docstrings are Google style with reST math and roles (the
house style, as in optax). Before mkdocstrings renders them this turns
``.. math::`` blocks into ``$$ ... $$``, ``:math:`x``` into ``$x$`` (both
typeset by KaTeX through ``pymdownx.arithmatex``), ``:func:`~a.b``` into
```b``` and each doctest run (``>>>`` and the ``...`` and output lines
that follow it, up to a blank line) into a fenced ``pycon`` code block.
Without the fence Markdown reads ``>>>`` as three nested blockquotes, joins
the lines into one paragraph and turns a ``>>> # comment`` into a heading.
"""

import re

import griffe

_BLOCK = re.compile(
    r"^(?P<indent>[ ]*)\.\. math::[ ]*(?P<first>.*)\n"
    r"(?P<rest>(?:(?P=indent)[ ]+\S.*\n|[ ]*\n(?=(?P=indent)[ ]+\S))*)",
    re.MULTILINE)
_INLINE = re.compile(r":math:`([^`]+)`")
_FENCED = re.compile(
    r"^[ ]*(?P<fence>```|~~~).*\n(?:.*\n)*?[ ]*(?P=fence)[ ]*(?:\n|$)",
    re.MULTILINE)
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


def fence_doctests(text: str) -> str:
  """``text`` with each doctest run inside a ```` ```pycon ```` fence.

  A run starts at a line whose first non-blank characters are ``>>>`` and
  goes on through the non-blank lines indented at least as much; the fence
  takes the run's indentation, so it stays inside its Google section. Runs
  already inside a fence are left alone.
  """
  out, run, indent, fenced = [], [], "", False
  for line in text.split("\n"):
    if run and line.strip() and line.startswith(indent):
      run.append(line)
      continue
    if run:
      out += [f"{indent}```pycon", *run, f"{indent}```"]
      run = []
    stripped = line.lstrip()
    if stripped.startswith(("```", "~~~")):
      fenced = not fenced
    if not fenced and stripped.startswith(">>>"):
      indent = line[:len(line) - len(stripped)]
      run = [line]
    else:
      out.append(line)
  if run:
    out += [f"{indent}```pycon", *run, f"{indent}```"]
  return "\n".join(out)


def _prose(text: str) -> str:
  # The added newline ends a math block on the last line; every match and
  # its replacement end in a newline, so the last character is that one.
  text = _BLOCK.sub(_block, text + "\n")[:-1]
  text = _INLINE.sub(lambda m: f"${m.group(1).strip()}$", text)
  return _ROLE.sub(_role, text)


def convert(text: str) -> str:
  """The docstring ``text`` with its reST math, roles and doctests as
  Markdown. Code inside fences is left as it is."""
  text = fence_doctests(text)
  out, start = [], 0
  for match in _FENCED.finditer(text):
    out += [_prose(text[start:match.start()]), match.group(0)]
    start = match.end()
  return "".join(out + [_prose(text[start:])])


class RestToMarkdown(griffe.Extension):
  """Converts every docstring griffe loads (see the module docstring)."""

  def on_instance(self, *, obj, **kwargs):
    del kwargs
    if obj.docstring is not None:
      obj.docstring.value = convert(obj.docstring.value)
