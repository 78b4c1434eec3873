// Typesets the math that pymdownx.arithmatex (generic mode) leaves in the
// pages: <span class="arithmatex">\(...\)</span> inline and
// <div class="arithmatex">\[...\]</div> displayed. KaTeX is served with the
// site (javascripts/katex/, see its README.md), so no network is needed.
// document$ is Material's page observable: it also fires after instant
// navigation loads a page.
document$.subscribe(({ body }) => {
  for (const el of body.querySelectorAll(".arithmatex")) {
    const tex = el.textContent.trim();
    const display = tex.startsWith("\\[");
    katex.render(tex.slice(2, -2), el, {
      displayMode: display,
      throwOnError: false
    });
  }
});
