"""A run shows itself through the view its command gives it (`train --report`): rank 0 draws it, and a view that
fails is said while the run goes on."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tunecast.report.run import REPORT_FILE, ReportView
from tunecast.storage.store import Storage
from tunecast.train.loop import refresh_view

START = {"kind": "event", "event": "start", "step": 0, "model": "tiny", "method": "lora", "total_steps": 4}
STEP = {"kind": "step", "step": 1, "loss": 2.5, "lr": 1e-4, "tokens": 64, "elapsed_s": 0.5}


class Said:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def event(self, kind: str, message: str) -> None:
        self.events.append((kind, message))


def session(tmp_path: Path, view: Any, *, main: bool = True) -> SimpleNamespace:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in (START, STEP)))
    return SimpleNamespace(view=view, engine=SimpleNamespace(world=SimpleNamespace(main=main)),
                           store=SimpleNamespace(storage=Storage(str(tmp_path / "out"))),
                           metrics=SimpleNamespace(path=metrics), config_yaml="model: tiny\n", reporter=Said())


def test_rank_zero_draws_the_report_from_the_metrics_so_far(tmp_path: Path) -> None:
    run = session(tmp_path, ReportView())
    refresh_view(run)  # type: ignore[arg-type]
    page = (tmp_path / "out" / REPORT_FILE).read_text()
    assert page.startswith("<!DOCTYPE html>") and "model: tiny" in page
    assert run.reporter.events == []


def test_other_ranks_draw_nothing(tmp_path: Path) -> None:
    refresh_view(session(tmp_path, ReportView(), main=False))  # type: ignore[arg-type]
    assert not (tmp_path / "out" / REPORT_FILE).exists()


def test_a_view_that_fails_is_said_and_the_run_goes_on(tmp_path: Path) -> None:
    class Broken:
        name = "report.html"

        def __call__(self, storage: Storage, metrics: str, config: str) -> None:
            raise OSError("disk full")

    run = session(tmp_path, Broken())
    refresh_view(run)  # type: ignore[arg-type]
    assert run.reporter.events == [("report", "report.html not updated: OSError: disk full")]
