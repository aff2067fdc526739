"""The README's screenshot of the plan report: `tunecast plan examples/llama-3.1-8b-lora.yaml --report`, opened in
headless Chromium (Debian's `chromium`, driven by Playwright), the page's first screens captured.

Run:  .venv/bin/python scripts/screenshots.py     (or `make screenshots`)
Writes docs/images/plan-report.png (and the report itself to a temporary folder).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "llama-3.1-8b-lora.yaml"
OUT = REPO / "docs" / "images" / "plan-report.png"
WIDTH, HEIGHT = 1280, 2300  # the recommendation, cost against time and memory per GPU


def main() -> int:
    from playwright.sync_api import sync_playwright

    browser_path = os.environ.get("TUNECAST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if browser_path is None:
        print("no chromium: apt-get install chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tunecast-screenshots-") as scratch:
        report = Path(scratch) / "plan.html"
        subprocess.run([sys.executable, "-m", "tunecast", "plan", str(CONFIG), "--report", str(report)], check=True,
                       cwd=REPO, stdout=subprocess.DEVNULL)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            page.goto(report.as_uri())
            page.wait_for_function("typeof Plotly !== 'undefined'")
            page.wait_for_timeout(800)
            OUT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(OUT), clip={"x": 0, "y": 0, "width": WIDTH, "height": HEIGHT})
            browser.close()
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
