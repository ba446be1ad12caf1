"""The demo report seen in a real browser: headless Chromium opens index.html, every image
loads and the headline is there (skipped, with the reason, where no Chromium is installed;
.ci/run installs Debian's). The offline check needs no browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PAGES = ("index.html", "model-card.html", "analysis/report.html")

# appended to a copy of index.html: after every image has loaded or failed (the load
# event), the page writes what it saw into the DOM, which --dump-dom prints
_PROBE = """<script>
window.addEventListener('load', () => {
  const images = [...document.images].map(i => [i.getAttribute('src'), i.naturalWidth]);
  const h = document.getElementById('headline');
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({images, headline: h ? h.textContent : null});
  document.body.appendChild(out);
});
</script>"""


def _browser() -> str | None:
    return next((b for b in map(shutil.which, BROWSERS) if b), None)


def test_report_reads_offline(quick_demo):
    """No script, style, font or image is fetched from outside the folder."""
    _, folder = quick_demo
    external = re.compile(r"""(src|href)\s*=\s*['"]?\s*(https?:)?//""", re.IGNORECASE)
    imports = re.compile(r"@import|url\(\s*['\"]?(https?:)?//", re.IGNORECASE)
    for name in PAGES:
        page = (folder / name).read_text()
        assert not external.search(page), (name, external.search(page).group(0))
        assert not imports.search(page), name
        assert "<script" not in page.lower(), name


@pytest.mark.skipif(_browser() is None, reason=f"no headless browser installed (looked for "
                    f"{', '.join(BROWSERS)}; .ci/run installs Debian's chromium)")
def test_report_opens_in_headless_chromium(quick_demo):
    _, folder = quick_demo
    page = (folder / "index.html").read_text()
    probe = folder / "probe.html"  # beside index.html, so the same relative image paths
    probe.write_text(page.replace("</body>", _PROBE + "</body>"))
    cmd = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-extensions", "--allow-file-access-from-files",
           "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    found = re.search(r"<pre id=\"probe\">(.*?)</pre>", done.stdout, re.DOTALL)
    assert found, f"the page's probe did not run (exit {done.returncode}): {done.stderr[-2000:]}"
    seen = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    images = dict(seen["images"])
    expected = set(re.findall(r"<img src='([^']+)'", page))
    assert set(images) == expected and len(expected) >= 6
    broken = [src for src, width in images.items() if width <= 0]
    assert not broken, f"images that did not load: {broken}"
    off = json.loads((folder / "offload.json").read_text())
    assert seen["headline"].startswith("Headline. At real expert sizes (6.0 MiB experts, RANDOM ")
    assert f"{off['systems']['stmoe']['decode_tokens_per_s']:.1f} tokens/s" in seen["headline"]
