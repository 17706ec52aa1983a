"""The shadow report renders: every embedded plot decodes in a real headless Chromium; the animation is a valid GIF."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from tests.helpers.shadow_candidates import shadow_result

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

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
        proc = subprocess.run(
            [
                _chromium(),
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                "--virtual-time-budget=10000",
                "--dump-dom",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
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
    damaged.write_text(html[:start] + html[start + 5000 :])
    images = decoded_images(damaged, tmp_path)
    assert [im["alt"] for im in images if not im["ok"]] == ["returns"]


def test_report_has_the_gate_table(lqr_report):
    from pathlib import Path

    html = Path(lqr_report["report"]).read_text()
    for key in (
        "gate.min_return_ratio",
        "gate.max_violations",
        "gate.max_intervention_rate",
        "gate.max_latency_p99_us",
    ):
        assert key in html
    assert "verdict pass" in html
    assert "Per constraint, candidate driving (shielded)" in html and "<td>rail_band</td>" in html


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


# What `calibrate` returns, in the part the report shows: one parameter identified, one the logs cannot pin,
# one given as known; one flat direction.
CALIBRATION = {
    "parameters": {
        "body_mass.cart": {"nominal": 1.0, "identified": 1.31, "identified_ok": True, "range": [1.26, 1.36]},
        "body_mass.pole": {"nominal": 1.0, "identified": 1.8, "identified_ok": False, "range": [0.9, 1.5]},
        "joint_damping.slider": {
            "nominal": 1.0,
            "identified": 1.1,
            "identified_ok": True,
            "known": True,
            "range": [1.1, 1.1],
        },
    },
    "flat_directions": [{"weights": {"body_mass.pole": 0.7, "actuator_gain.cart_force": -0.7}}],
    "latency_steps": {"identified": 2},
    "log": {"source": "field-logs/", "seconds": 120.0},
    "prediction_error": {"before": {"rms_normalized": 3.2}, "after": {"rms_normalized": 0.9}},
}


def test_report_shows_the_twin_calibration_the_gate_ran_on(lqr_report, tmp_path):
    """Gated after calibrating the twin to field logs: the report says what was identified, what was not, and how
    much closer the calibrated twin predicts the plant. Without a calibration there is no such section."""
    from pathlib import Path

    from pipeline.evaluation.shadow import run_shadow
    from tests.helpers.shadow_candidates import LOOSE_LATENCY_US, cartpole_config, shadow_result

    bundle, _ = shadow_result("lqr", tmp_path)
    cfg = cartpole_config(episodes=1, max_episode_steps=50)
    cfg.gate.max_latency_p99_us = LOOSE_LATENCY_US
    result = run_shadow(bundle, cfg, report_dir=tmp_path / "calibrated", calibration=CALIBRATION)
    page = Path(result["report"]).read_text()
    section = page[page.index("<h2>Twin calibration: identified vs nominal</h2>") :]
    section = section[: section.index("<h2>", 4)]
    rows = re.findall(
        r'<tr class="(\w+)"><td>([^<]+)</td><td>[^<]+</td><td>([^<]+)</td><td>([^<]+)</td>'
        r"<td>([^<]+)</td></tr>",
        section,
    )
    assert rows == [
        ("pass", "body_mass.cart", "1.31", "1.26 .. 1.36", "identified"),
        ("skipped", "body_mass.pole", "1.8", "0.9 .. 1.5", "NOT identified by the logs: keeps its configured range"),
        ("pass", "joint_damping.slider", "1.1", "1.1 .. 1.1", "known (calibration.known)"),
    ]
    assert "from 3.20 (nominal) to 0.90 (calibrated)" in section and "latency 2 control steps" in section
    assert "+0.70 log body_mass.pole + -0.70 log actuator_gain.cart_force" in section
    assert "Twin calibration" not in Path(lqr_report["report"]).read_text()
