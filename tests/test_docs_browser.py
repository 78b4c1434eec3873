"""The built docs site, as a browser shows it.

Builds the site with ``mkdocs build --strict``, serves it on 127.0.0.1 and
loads pages in headless Chromium (Debian's ``chromium`` package, which
``.ci/run`` installs) with every other host unresolvable, so the checks
hold without a network. After the page's scripts have run, the DOM must
have every formula typeset by the KaTeX served with the site (no raw
``\\(`` or ``\\[`` left in the text, no KaTeX error), each docstring's
Example as a highlighted Python code block (no blockquotes), and a table of
contents that lists the API page's sections and the API's names only.
Those are the slow tier; the default tier checks the checkers on small
hand-written pages. Without ``/usr/bin/chromium`` the browser tests skip.
"""

import functools
import html.parser
import http.server
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

import kfac_jax_lite as kl

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
    "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
    # Any host but the local server fails to resolve: the page gets what
    # the site serves and nothing else.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--virtual-time-budget=10000")
# Void elements of HTML: no closing tag, no children.
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link",
        "meta", "source", "track", "wbr"}
# Elements whose text is not prose: raw TeX there is expected.
NOT_PROSE = {"code", "pre", "script", "style", "noscript", "annotation"}


class Node:
  """An element of the parsed DOM (``tag`` None: the document)."""

  def __init__(self, tag, attrs, parent):
    self.tag, self.attrs, self.parent = tag, dict(attrs), parent
    self.children = []   # Nodes and strings

  @property
  def classes(self) -> set:
    return set((self.attrs.get("class") or "").split())

  def iter(self):
    """This node and every element below it, in document order."""
    yield self
    for child in self.children:
      if isinstance(child, Node):
        yield from child.iter()

  def find_all(self, tag=None, cls=None) -> list:
    return [n for n in self.iter() if (tag is None or n.tag == tag) and
            (cls is None or cls in n.classes)]

  def text(self, skip=lambda node: False) -> str:
    parts = []
    for child in self.children:
      if isinstance(child, str):
        parts.append(child)
      elif not skip(child):
        parts.append(child.text(skip))
    return "".join(parts)

  def ancestors(self):
    node = self.parent
    while node is not None:
      yield node
      node = node.parent


class _TreeBuilder(html.parser.HTMLParser):

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.root = Node(None, {}, None)
    self.current = self.root

  def handle_starttag(self, tag, attrs):
    node = Node(tag, attrs, self.current)
    self.current.children.append(node)
    if tag not in VOID:
      self.current = node

  def handle_startendtag(self, tag, attrs):
    self.current.children.append(Node(tag, attrs, self.current))

  def handle_endtag(self, tag):
    node = self.current
    while node is not None and node.tag != tag:
      node = node.parent
    if node is not None and node.parent is not None:
      self.current = node.parent

  def handle_data(self, data):
    self.current.children.append(data)


def parse(text: str) -> Node:
  builder = _TreeBuilder()
  builder.feed(text)
  builder.close()
  return builder.root


def _prose(node: Node) -> str:
  """``node``'s text outside code and outside typeset math."""
  return node.text(skip=lambda n: n.tag in NOT_PROSE or bool(
      n.classes & {"katex", "katex-display"}))


def math_problems(article: Node) -> list:
  """Formulas left untypeset in ``article`` (a rendered page's body)."""
  out = []
  formulas = article.find_all(cls="arithmatex")
  for node in formulas:
    if not node.find_all(cls="katex"):
      out.append(f"not typeset: {node.text()[:80]!r}")
  for node in article.find_all(cls="katex-error"):
    out.append(f"KaTeX error: {node.attrs.get('title', '')[:120]!r} in "
               f"{node.text()[:80]!r}")
  prose = _prose(article)
  for delimiter in ("\\(", "\\[", "$$"):
    at = prose.find(delimiter)
    if at >= 0:
      out.append(f"raw {delimiter!r} in the text: "
                 f"{prose[max(0, at - 60):at + 60]!r}")
  return out


def example_problems(article: Node) -> list:
  """Example sections of ``article`` that are not highlighted code, and
  documented functions or classes without one."""
  out = [f"a blockquote: {b.text()[:80]!r}"
         for b in article.find_all("blockquote")]
  for details in article.find_all("details", cls="example"):
    blocks = [c for c in details.children if isinstance(c, Node) and
              c.tag != "summary"]
    stray = "".join(c for c in details.children if isinstance(c, str))
    if (not blocks or stray.strip() or
        any("highlight" not in c.classes for c in blocks)):
      out.append(f"an Example that is not only code blocks: "
                 f"{details.text()[:120]!r}")
      continue
    for block in blocks:
      code = block.find_all("code")
      prompts = [s for s in block.find_all("span", cls="gp")
                 if s.text().strip() in (">>>", "...")]
      names = block.find_all("span", cls="n") + block.find_all(
          "span", cls="nf")
      if not code or not prompts or not names:
        out.append(f"an Example not highlighted as Python: "
                   f"{block.text()[:120]!r}")
  for heading in article.find_all("h3", cls="doc-heading"):
    symbol = heading.find_all("code", cls="doc-symbol")
    kinds = symbol[0].classes if symbol else set()
    if not kinds & {"doc-symbol-function", "doc-symbol-class"}:
      continue
    contents = [c for c in heading.parent.children if isinstance(c, Node)
                and "doc-contents" in c.classes]
    own = [d for d in contents[0].find_all("details", cls="example")
           if _owner(d) is heading.parent] if contents else []
    if not own:
      out.append(f"{heading.attrs.get('id')}: no Example block")
  return out


def _owner(node: Node) -> Node:
  """The innermost documented object (``div.doc-object``) holding node."""
  return next(a for a in node.ancestors() if "doc-object" in a.classes)


def toc_problems(page: Node, sections: set) -> list:
  """Entries of the page's table of contents that are neither one of
  ``sections`` nor an API name; API names missing from it."""
  navs = [n for n in page.find_all("nav", cls="md-nav--secondary")]
  assert navs, "the page has no table of contents"
  out, listed = [], set()
  for link in navs[0].find_all("a", cls="md-nav__link"):
    label = " ".join(link.text().split())
    anchor = link.attrs.get("href", "").lstrip("#")
    if anchor.startswith("kfac_jax_lite."):
      path = anchor.split(".")[1:]
      if path[0] in kl.__all__ and label == path[-1]:
        listed.add(path[0])
        continue
    elif label in sections:
      continue
    out.append(f"TOC entry {label!r} (#{anchor}) is not an API name")
  out += [f"{name} is not in the TOC" for name in
          sorted(set(kl.__all__) - listed)]
  return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp("site")
  run = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, check=False)
  assert run.returncode == 0, run.stdout + run.stderr
  return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    del format, args


@pytest.fixture(scope="module")
def served(site):
  """The site's root URL on 127.0.0.1 (a free port)."""
  handler = functools.partial(_QuietHandler, directory=str(site))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}/"
  server.shutdown()
  server.server_close()
  thread.join()


@pytest.fixture(scope="module")
def browser():
  """Returns ``dump(url) -> DOM after the page's scripts``."""
  if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"{CHROMIUM} is missing: `apt-get install chromium` "
                "(.ci/run installs it) to check the rendered docs")
  profile = tempfile.mkdtemp(prefix="docs-chromium-")

  def dump(url: str) -> str:
    run = subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0 and "</html>" in run.stdout, (
        f"chromium failed on {url}: {run.stderr[-2000:]}")
    return run.stdout

  yield dump
  shutil.rmtree(profile, ignore_errors=True)


def _article(page: Node) -> Node:
  articles = page.find_all("article")
  assert len(articles) == 1, len(articles)
  return articles[0]


def _math_pages(site) -> list:
  return sorted(p.parent.relative_to(site).as_posix() for p in
                site.rglob("index.html")
                if 'class="arithmatex"' in p.read_text())


@pytest.mark.slow
def test_api_page_renders_math_examples_and_a_toc_of_names(
    site, served, browser):
  page = parse(browser(served + "reference/api/"))
  article = _article(page)
  assert len(article.find_all(cls="arithmatex")) >= 10
  assert len(article.find_all("details", cls="example")) >= 30
  sections = set(re.findall(
      r"^## (.+?)\s*$", (ROOT / "docs/reference/api.md").read_text(), re.M))
  problems = (math_problems(article) + example_problems(article) +
              toc_problems(page, sections))
  assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_every_page_with_math_typesets_it(site, served, browser):
  pages = [p for p in _math_pages(site) if p != "reference/api"]
  assert pages, "no page but the API has math: is arithmatex still on?"
  problems = []
  for path in pages:
    article = _article(parse(browser(served + path + "/")))
    problems += [f"{path}: {p}" for p in math_problems(article)]
  assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_the_site_loads_nothing_from_another_host(site):
  external = re.compile(
      r"<(?:script|img|iframe|source)\b[^>]*\ssrc=\"(?:https?:)?//[^\"]*\"|"
      r"<link\b[^>]*\shref=\"(?:https?:)?//[^\"]*\"|"
      r"@import\s+url\(\"?(?:https?:)?//|url\(\"?(?:https?:)?//")
  found = []
  for path in sorted(site.rglob("*")):
    if path.suffix in (".html", ".css", ".js") and path.is_file():
      found += [f"{path.relative_to(site)}: {m.group(0)[:120]}"
                for m in external.finditer(path.read_text(errors="replace"))]
  assert not found, "\n".join(found)


def test_the_checks_catch_what_they_look_for():
  """The checkers above on hand-written pages: each fault is reported."""
  raw_math = parse('<article><p>see <span class="arithmatex">\\(x\\)</span>'
                   "</p></article>")
  assert any("not typeset" in p for p in math_problems(raw_math))
  assert any("raw '\\\\('" in p for p in math_problems(raw_math))
  typeset = parse('<article><span class="arithmatex"><span class="katex">'
                  '<annotation>\\(x\\)</annotation>x</span></span>'
                  "<code>\\[</code></article>")
  assert math_problems(typeset) == []
  quoted = parse(
      '<article><div class="doc doc-object"><h3 class="doc doc-heading" '
      'id="kfac_jax_lite.scan"><code class="doc-symbol '
      'doc-symbol-function"></code>scan</h3><div class="doc doc-contents">'
      '<details class="example"><summary>Example</summary><blockquote>'
      "<p>&gt; x = 1</p></blockquote></details></div></div></article>")
  problems = example_problems(quoted)
  assert any("blockquote" in p for p in problems)
  assert any("not only code blocks" in p for p in problems)
  bad_toc = parse(
      '<nav class="md-nav md-nav--secondary"><a class="md-nav__link" '
      'href="#or-one-forward-pass">or, one forward pass:</a></nav>')
  problems = toc_problems(bad_toc, {"Layer tags"})
  assert "TOC entry 'or, one forward pass:' (#or-one-forward-pass) is not " \
         "an API name" in problems
  assert "scan is not in the TOC" in problems
