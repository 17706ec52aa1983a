"""The shadow report renders: every embedded plot decodes in a real headless Chromium; the animation is a valid GIF."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from tests.shadow_candidates import shadow_result

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Runs after load: records, for every <img>, whether the browser decoded it (naturalWidth > 0).
IMAGE_CHECK = """<script>
window.addEventListener('load', function () {
  var rows = Array.from(document.images).map(function (im) {
    return {alt: im.alt, ok: im.complete && im.naturalWidth > 0, w: im.naturalWidth};
  });
  var pre = document.createElement('pre');
  pre.id = 'image-check';
  // markers built by concatenation so the script's own source never matches them
  pre.textContent = 'IMAGE' + 'CHECK' + JSON.stringify(rows) + 'END' + 'CHECK';
  document.body.appendChild(pre);
});
</script></body>"""


def _chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium on PATH (Debian: apt-get install chromium)")


def decoded_images(html_path, tmp_path) -> list[dict]:
    """Load `html_path` with the image check injected; return one {alt, ok, w} per <img>."""
    page = tmp_path / f"checked-{html_path.stem}.html"
    page.write_text(html_path.read_text().replace("</body>", IMAGE_CHECK))
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        proc = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                               "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                              capture_output=True, text=True, timeout=120)
    match = re.search(r"IMAGECHECK(.*?)ENDCHECK", proc.stdout, re.S)
    assert match, f"the page's check never ran (rc {proc.returncode}): {proc.stderr[-500:]}"
    return json.loads(match.group(1).replace("&quot;", '"'))


@pytest.fixture(scope="module")
def lqr_report(tmp_path_factory):
    _, result = shadow_result("lqr", tmp_path_factory.mktemp("report"))
    return result


def test_every_plot_renders_in_chromium(lqr_report, tmp_path):
    from pathlib import Path

    report = Path(lqr_report["report"])
    html = report.read_text()
    images = decoded_images(report, tmp_path)
    assert len(images) == html.count("<img ")
    alts = {im["alt"] for im in images}
    assert {"action traces", "h shadow", "h counterfactual", "returns", "latency"} <= alts
    broken = [im["alt"] for im in images if not im["ok"]]
    assert not broken, f"plots that did not render: {broken}"
    # The check really fails on a broken plot: truncate one image's data and load again.
    start = html.index('alt="returns" src="data:image/png;base64,') + len('alt="returns" src="data:image/png;base64,')
    damaged = tmp_path / "damaged.html"
    damaged.write_text(html[:start] + html[start + 5000:])
    images = decoded_images(damaged, tmp_path)
    assert [im["alt"] for im in images if not im["ok"]] == ["returns"]


def test_report_has_the_gate_table(lqr_report):
    from pathlib import Path

    html = Path(lqr_report["report"]).read_text()
    for key in ("gate.min_return_ratio", "gate.max_violations", "gate.max_intervention_rate", "gate.max_latency_p99_us"):
        assert key in html
    assert "verdict pass" in html


def test_animation_is_a_valid_gif(lqr_report):
    from pathlib import Path

    from PIL import Image

    gif = Path(lqr_report["report"]).parent / "counterfactual.gif"
    html = Path(lqr_report["report"]).read_text()
    if not gif.exists():
        note = re.search(r"animation skipped[^<]*", html)
        assert note, "no animation and no note saying why"
        pytest.skip(f"offscreen rendering unavailable here ({note.group(0)}); Debian: apt-get install libosmesa6")
    with Image.open(gif) as im:
        assert im.format == "GIF" and im.n_frames > 1 and im.size == (160, 120)
        im.seek(im.n_frames // 2)
        pixels = np.asarray(im.convert("RGB")).reshape(-1, 3)
        assert len(np.unique(pixels, axis=0)) > 4, "frames are blank"
    assert 'alt="counterfactual animation" src="data:image/gif;base64,' in html
