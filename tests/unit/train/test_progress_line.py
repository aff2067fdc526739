"""The progress line of `tunecast train` on a terminal narrows with it: at 80 columns it keeps its bar and the
step, loss, tokens/s, ETA and cost; too narrow for a bar, it keeps those figures alone."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from tunecast.cli.train_cmds import ConsoleReporter

RECORD = {"step": 120, "loss": 1.23456, "tokens_per_second": 12345.6, "elapsed_s": 3725.0, "cost_usd": 12.3456}


def drawn(width: int) -> list[str]:
    """The lines the live progress leaves on a terminal `width` columns wide."""
    buffer = io.StringIO()
    reporter = ConsoleReporter(Console(file=buffer, width=width, force_terminal=True, color_system=None))
    reporter.step(RECORD, 1000, eta_s=26_640.0, cost_at_end_usd=98.7654)
    reporter.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_line_keeps_its_bar_and_figures(width: int) -> None:
    line = drawn(width)[-1]
    assert len(line) <= width and "…" not in line
    assert "━" in line
    assert "120/1000" in line and "loss 1.23" in line and "12,346 tok/s" in line and "ETA 7:24:00" in line
    assert "$12.35" in line and "$98.77" in line


def test_a_wide_terminal_shows_everything() -> None:
    line = drawn(200)[-1]
    assert line.startswith("training ")
    assert ("step 120/1000 · loss 1.2346 · 12,346 tok/s · 1:02:05 elapsed · ETA 7:24:00 · $12.35 so far, $98.77 at "
            "the end") in line


def test_too_narrow_for_a_bar_the_figures_stay() -> None:
    line = drawn(70)[-1]
    assert "━" not in line and "…" not in line
    assert line.strip() == "120/1000 · loss 1.235 · 12,346 tok/s · ETA 7:24:00 · $12.35→$98.77"
