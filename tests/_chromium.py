"""Headless Chromium for the HTML pages' tests (``posenc report``: tests/viz/test_report.py; ``posenc
inspect``: tests/viz/test_inspection.py): load a page from disk with every host name unresolvable, run
a probe script once it has loaded, and return the JSON the probe writes into the page."""

from __future__ import annotations

import html as html_lib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

#: The window pages are laid out in (the first screen is measured in it).
VIEWPORT = (1300, 900)

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--hide-scrollbars",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # anything fetched from the network would fail to load
    "--virtual-time-budget=10000",
    f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
]


def run_probe(page: Path, tmp_path: Path, probe: str, extra_head: str = "") -> dict:
    """Load ``page`` (with ``extra_head`` added to its head and the ``<script>`` ``probe`` before its
    end) in headless Chromium; return the JSON the probe wrote into ``<pre id="probe">``."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not on PATH (Debian: apt-get install -y chromium); cannot render the page")
    probed = tmp_path / "probe.html"
    text = page.read_text().replace("</head>", extra_head + "</head>").replace("</body>", probe + "</body>")
    probed.write_text(text)
    result = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probed.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.S)
    assert found, "the probe did not run (no <pre id=probe> in the dumped DOM)"
    return json.loads(html_lib.unescape(found.group(1)))
