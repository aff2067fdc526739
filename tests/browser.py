"""Open a report in headless Chromium (Debian's `chromium`, driven by Playwright) and say what it did: the
requests it made, its console errors, what each `[data-chart]` element drew; keep a screenshot."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("TUNECAST_TEST_ARTIFACTS", str(REPO / "test-artifacts")))


def chromium() -> str:
    found = os.environ.get("TUNECAST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise AssertionError("no chromium to render the reports in: `make browser` installs it (make test does so first)")
    return found


@dataclass
class Rendered:
    requests: list[str]  # every URL the page asked for, but its own file
    errors: list[str]  # console errors and uncaught exceptions
    charts: dict[str, dict[str, Any]]  # data-chart name → what it drew
    screenshot: Path


CHARTS = """
Array.from(document.querySelectorAll('[data-chart]')).map(function (figure) {
  var svg = figure.querySelector('svg.main-svg');
  var box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  return {name: figure.dataset.chart, width: box.width, height: box.height,
          marks: figure.querySelectorAll('svg .point, svg .bars path, svg .js-line, svg .scatterlayer path').length};
})
"""


def render(page_file: Path, name: str, actions: Any = None) -> Rendered:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    own = page_file.resolve().as_uri()
    requests: list[str] = []
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda request: requests.append(request.url) if request.url != own else None)
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(own)
            page.wait_for_function("typeof Plotly !== 'undefined'")
            page.wait_for_timeout(500)  # the charts draw as the page's scripts run; let layout settle
            charts = {one["name"]: one for one in page.evaluate(CHARTS)}
            if actions is not None:
                actions(page)
            shot = ARTIFACTS / f"{name}.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    return Rendered(requests, errors, charts, shot)
