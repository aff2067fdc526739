"""The HTML reports, rendered in a real browser (headless Chromium): every chart drew, the page asked for nothing
from anywhere, logged no error, and reads as the plan and the run say; screenshots are kept in test-artifacts/."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from tests.browser import render
from tests.trainruns import REPO, tiny_run

DEMO = REPO / "examples" / "llama-3.1-8b-lora.yaml"
# an element that would load something: a script, stylesheet, image, frame, media or font from a URL
EXTERNAL = re.compile(r"<(script|link|img|iframe|source|video|audio|embed|object)\b[^>]*\b(src|href|data)\s*=\s*"
                      r"[\"']?(https?:)?//", re.IGNORECASE)
PLAN_CHARTS = {"cost-vs-time", "memory-per-gpu", "rent-vs-buy"}
RUN_CHARTS = {"loss", "learning-rate", "tokens-per-second", "peak-memory", "cost", "timeline"}


def _self_contained(text: str) -> None:
    assert not EXTERNAL.search(text), EXTERNAL.search(text)
    assert "@import" not in text and "url(http" not in text


@pytest.fixture(scope="module")
def plan_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("plan-report")
    done = subprocess.run([sys.executable, "-m", "tunecast", "plan", str(DEMO), "--report", str(folder / "plan.html"),
                           "--json"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "plan.html", json.loads(done.stdout)


def test_the_plan_report_draws_every_chart_offline(plan_report: tuple[Path, dict]) -> None:
    path, document = plan_report
    text = path.read_text()
    _self_contained(text)
    assert oct(path.stat().st_mode & 0o777) != oct(0o600), "a report is a file to hand on, not a private one"

    def sort_by_hours(page) -> None:  # type: ignore[no-untyped-def]
        heads = page.locator("table[data-table=options] th")
        heads.filter(has_text="hours").click()
        first = page.locator("table[data-table=options] tbody tr").first.locator("td").nth(9).inner_text()
        sort_by_hours.first_hours = float(first)  # type: ignore[attr-defined]
        sort_by_hours.ticks = page.evaluate(  # type: ignore[attr-defined]
            "['xtick', 'ytick'].map(k => Array.from(document.querySelectorAll("
            "'[data-chart=cost-vs-time] .' + k + ' text')).map(t => t.textContent))")

    rendered = render(path, "plan-report", actions=sort_by_hours)
    assert rendered.requests == [] and rendered.errors == []
    assert set(rendered.charts) == PLAN_CHARTS
    for name, drawn in rendered.charts.items():
        assert drawn["width"] > 300 and drawn["height"] > 200 and drawn["marks"] > 0, (name, drawn)
    priced = [o for o in document["options"] if o["total_usd"] is not None]
    assert sort_by_hours.first_hours == pytest.approx(min(o["hours"] for o in priced), abs=0.01)  # type: ignore[attr-defined]
    hours, costs = sort_by_hours.ticks  # type: ignore[attr-defined]
    assert hours and all(tick.endswith(" h") for tick in hours), hours  # "0.3 h", never a bare "3"
    assert costs and all(tick.startswith("$") for tick in costs), costs
    stale = [o for o in priced[:200] if o["price_stale"]]
    assert stale, "the demo plan rests on list prices older than 30 days (the bundled catalog's of 2026-06-21)"
    assert f"{len(stale)} of these prices are old (a marketplace's after 1 day, a list price's after 30 days" \
        in html.unescape(text)
    for line in document["recommendations"]:
        assert line.replace("'", "&#x27;") in text or line in text
    assert rendered.screenshot.stat().st_size > 50_000


def test_the_memory_chart_shows_what_does_not_fit(plan_report: tuple[Path, dict]) -> None:
    path, document = plan_report
    unfit = {o["gpu"] for o in document["options"] if not o["fits"] and o["gpu_count"] == 1}
    assert unfit, "the demo plan has a card that does not fit (rtx-4080)"
    payload = path.read_text().split('data-chart="memory-per-gpu"', 1)[1].split("</script>", 1)[0]
    for gpu in unfit:
        assert f"1×{gpu} (does not fit)" in payload
        option = next(o for o in document["options"] if o["gpu"] == gpu and o["gpu_count"] == 1)
        assert sum(option["memory_breakdown_gib"].values()) > option["capacity_gib"]


def test_the_run_report_draws_the_run(cli, tmp_path: Path, plan_report: tuple[Path, dict]) -> None:  # type: ignore[no-untyped-def]
    config = tiny_run(tmp_path, max_steps=6, **{"checkpoint.every_steps": 2, "eval.every_steps": 3,
                                                "eval.examples": 4})
    result = cli("train", str(config), "--report")
    assert result.code == 0, result.stderr[-3000:]
    kept = tmp_path / "out" / "report.html"
    assert kept.exists(), "train --report keeps report.html in the output"
    (tmp_path / "plan.json").write_text(json.dumps(plan_report[1]))
    result = cli("report", str(tmp_path / "out"), "-o", str(tmp_path / "run.html"), "--plan",
                 str(tmp_path / "plan.json"))
    assert result.code == 0, result.stderr
    text = (tmp_path / "run.html").read_text()
    _self_contained(text)
    rendered = render(tmp_path / "run.html", "run-report")
    assert rendered.requests == [] and rendered.errors == []
    assert set(rendered.charts) == RUN_CHARTS
    for name, drawn in rendered.charts.items():
        assert drawn["width"] > 300 and drawn["marks"] > 0, (name, drawn)
    assert "finished at step 6 of 6" in text and "plan: " in text
    assert render(kept, "run-report-kept").charts.keys() == RUN_CHARTS


def test_a_report_of_no_run_is_a_user_error(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = cli("report", str(tmp_path))
    assert result.code == 2 and "metrics.jsonl" in result.stderr


def test_report_paths_and_documents_that_cannot_serve_are_user_errors(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "event", "event": "start", "step": 0}) + "\n")
    (tmp_path / "not-a-plan.json").write_text(json.dumps({"options": [{"gpu": "x"}]}))
    result = cli("report", str(run), "--plan", str(tmp_path / "not-a-plan.json"))
    assert result.code == 2 and "not a plan" in result.stderr
    result = cli("report", str(run), "-o", str(tmp_path))  # a folder, not a file
    assert result.code == 2 and "--output" in result.stderr
    (run / "plan.json").write_text("{ damaged")
    result = cli("report", str(run))
    assert result.code == 2 and "plan.json is not JSON" in result.stderr
