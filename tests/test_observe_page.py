"""The report page renders in a real browser: headless Chromium loads it and decodes every plot.

Skips when no Chromium is installed (CI installs it: apt-get install -y chromium).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from batchinfer.observe import ObserveOptions, Observer
from batchinfer.io import layout
from test_observe import feed, simulate

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)

# appended to a copy of the page: writes each image's decoded size into the DOM once the page loaded
PROBE = """<script>
window.addEventListener('load', () => {
  for (const img of document.images) {
    img.setAttribute('data-decoded', img.complete ? img.naturalWidth + 'x' + img.naturalHeight : 'no');
  }
  document.body.setAttribute('data-probed', 'yes');
});
</script></body>"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_renders_with_all_plots_decoded(tmp_path):
    out = tmp_path / "out"
    with Observer(ObserveOptions(out_dir=out)) as obs:
        feed(obs, simulate(60, start=obs.t0, max_running=8).events)
    page = layout.report_html_path(out).read_text()
    assert "http://" not in page and "https://" not in page  # self-contained: nothing to fetch
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE))
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", probed.as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'data-probed="yes"' in dom, dom[-2000:]
    imgs = re.findall(r"<img\b[^>]*>", dom)
    assert len(imgs) == 5
    for tag in imgs:
        src = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', tag)
        assert src is not None and len(src.group(1)) > 5000, tag[:200]
        size = re.search(r'data-decoded="(\d+)x(\d+)"', tag)
        assert size is not None, tag[:100] + " ... " + tag[-100:]
        assert int(size.group(1)) >= 600 and int(size.group(2)) >= 200
