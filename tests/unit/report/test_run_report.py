"""The run report's reading of metrics.jsonl and the choice of the plan's prediction, without a browser
(tests/integration/test_reports.py renders the pages)."""

from __future__ import annotations

import json

import pytest

from tunecast.errors import TunecastError
from tunecast.report.run import RunRecords, _planned, run_report


def _lines(*records: dict) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


START = {"kind": "event", "event": "start", "step": 0, "total_steps": 2, "micro_batch": 1, "grad_accum": 1,
         "device": "NVIDIA H100", "usd_per_hour": 2.0, "gpu": "h100-sxm", "processes": 2, "elapsed_s": 0.0,
         "memory_kind": "cuda", "predicted_memory_gib": 30.0, "capacity_gib": 75.0}
STEP = {"kind": "train", "step": 1, "loss": 2.0, "learning_rate": 1e-4, "tokens": 1000, "step_seconds": 0.5,
        "tokens_per_second": 2000.0, "peak_reserved_gib": 31.0, "elapsed_s": 10.0, "cost_usd": 0.01,
        "projected_cost_usd": 0.02}


def test_a_line_cut_by_a_kill_is_left_out_and_a_damaged_one_is_an_error() -> None:
    records = RunRecords.parse(_lines(START, STEP) + '{"kind": "train", "st')
    assert len(records.train) == 1 and records.start["total_steps"] == 2
    with pytest.raises(TunecastError, match="line 2 is not JSON"):
        RunRecords.parse(_lines(START) + "garbage\n" + _lines(STEP))


def test_the_prediction_is_the_plans_option_for_the_runs_gpu_and_count() -> None:
    plan = {"options": [
        {"gpu": "rtx-4090", "gpu_count": 1, "fits": True},
        {"gpu": "h100-sxm", "gpu_count": 1, "fits": True},
        {"gpu": "h100-sxm", "gpu_count": 2, "fits": True},
        {"gpu": "h100-sxm", "gpu_count": 4, "fits": False},
    ]}
    assert _planned(plan, START) == plan["options"][2]
    assert _planned(plan, {**START, "processes": 8}) == plan["options"][1]  # the GPU at another count
    assert _planned(plan, {**START, "gpu": None}) == plan["options"][0]  # no catalog GPU: the plan's first
    assert _planned(None, START) is None


def test_a_name_in_a_chart_cannot_end_its_script() -> None:
    import plotly.graph_objects as go

    from tunecast.report.html import chart

    drawn = chart("x", go.Figure(go.Scatter(x=[1], y=[1], name="</script><b>bold</b>")), "caption")
    script = drawn.split("<script>", 1)[1]
    assert script.index("</script>") == len(script) - len("</script></figure>")  # only the element's own end
    assert "<\\/script><b>bold<\\/b>" in script


def test_every_chart_of_a_run_is_there_even_before_its_first_step() -> None:
    for text in (_lines(START, STEP), _lines(START)):
        page = run_report("/runs/x", RunRecords.parse(text), None)
        assert page.count('data-chart="') == 6
