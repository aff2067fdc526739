"""The run report (`tunecast report RUN_DIR_OR_URL`, and `tunecast train --report` keeping RUN/report.html): what a
run's `metrics.jsonl` says, drawn.

* loss, train and held-out, and the learning rate, per optimizer step;
* tokens per second over the run's training time, against the plan's prediction where a plan is given;
* peak memory per step against the memory check's prediction (the estimate the run chose its batch by) and the
  device's usable memory; on a CPU the resident growth above the process before its model, which is what
  `tunecast memory --device cpu` estimates;
* cost so far and the projection at the end, against the plan's total where a plan is given;
* the timeline: starts, resumptions, checkpoints, preemptions and evaluations over training time;
* predicted against measured, side by side, for every figure a plan (`--plan`, a `tunecast plan --json`
  document, or `plan.json` in the run) or a calibration (`--calibration`) predicts.

Training time (`elapsed_s`) runs on over every session of a run, so a resumed run continues where it left off;
the lines of steps redone after a preemption are written once (metrics.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tunecast.errors import TunecastError
from tunecast.report.html import chart, facts, page, paragraph, section, table
from tunecast.storage.store import Storage

PLAN_FILE = "plan.json"
REPORT_FILE = "report.html"


@dataclass
class RunRecords:
    """metrics.jsonl, by kind."""

    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> RunRecords:
        records = cls()
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if number == len(text.splitlines()):  # a line cut by a kill while it was written
                    break
                raise TunecastError(f"metrics.jsonl line {number} is not JSON", field="RUN_DIR",
                                    hint="the file was damaged; the run's checkpoints are unaffected") from None
            kind = record.get("kind")
            (records.train if kind == "train" else records.evals if kind == "eval" else records.events).append(record)
        return records

    @property
    def start(self) -> dict[str, Any]:
        return next((e for e in self.events if e.get("event") == "start"), {})


@dataclass(frozen=True)
class ReportView:
    """`train --report`: the view a run is given (train/loop.py RunView), which rewrites report.html in its output from
    the metrics so far, at every checkpoint and at the end."""

    name: str = REPORT_FILE

    def __call__(self, storage: Storage, metrics: str, config: str) -> None:
        storage.write(self.name, run_report(storage.url, RunRecords.parse(metrics), config).encode())


def read_run(url: str) -> tuple[RunRecords, str | None, dict[str, Any] | None]:
    """(metrics, config.yaml text, a plan document in the run) of the run at `url` (a folder or storage URL)."""
    storage = Storage(url)
    if not storage.exists("metrics.jsonl"):
        raise TunecastError(f"{url} has no metrics.jsonl: not the output of `tunecast train`", field="RUN_DIR",
                            hint="give the run's output directory or storage URL (its `output`)")
    records = RunRecords.parse(storage.read("metrics.jsonl").decode())
    config = storage.read("config.yaml").decode() if storage.exists("config.yaml") else None
    plan = None
    if storage.exists(PLAN_FILE):
        try:
            plan = json.loads(storage.read(PLAN_FILE))
        except ValueError:
            raise TunecastError(f"{url}/{PLAN_FILE} is not JSON", field="RUN_DIR",
                                hint="put there what `tunecast plan --json` printed, or remove it") from None
    return records, config, plan


def run_report(url: str, records: RunRecords, config: str | None, *, plan: dict[str, Any] | None = None,
               calibration: dict[str, Any] | None = None) -> str:
    start = records.start
    last = records.train[-1] if records.train else {}
    finished = any(e.get("event") == "finished" for e in records.events)
    state = "finished" if finished else ("stopped" if records.train else "not started")
    subtitle = (f"{url} · {state} at step {last.get('step', 0)} of {start.get('total_steps', '?')} · "
                f"{start.get('device', 'device unknown')} · ${last.get('cost_usd', 0.0):,.2f} so far")
    predicted = _planned(plan, start)
    sections = [
        section("Summary", _summary(records, predicted, calibration)),
        section("Loss and learning rate", _loss(records), _learning_rate(records)),
        section("Speed", _speed(records, predicted)),
        section("Memory", _memory(records, predicted)),
        section("Cost", _cost(records, predicted)),
        section("Timeline", _timeline(records)),
    ]
    if config:
        from tunecast.report.html import escape

        sections.append(section("Config", f"<pre>{escape(config)}</pre>"))
    return page("Run report", subtitle, sections)


def _planned(plan: dict[str, Any] | None, start: dict[str, Any]) -> dict[str, Any] | None:
    """The plan's option for this run's device: the first-ranked option of the run's GPU, else the first."""
    if not plan or not plan.get("options"):
        return None
    options: list[dict[str, Any]] = [o for o in plan["options"] if o["fits"]]
    mine = [o for o in options if o["gpu"] == start.get("gpu")]
    same_count = [o for o in mine if o["gpu_count"] == start.get("processes", 1)]
    chosen = same_count or mine or options
    return chosen[0] if chosen else None


def _counted(records: RunRecords) -> tuple[str, str, str]:
    """What a run's speed counts (the train lines' key), its unit and its name: images for a diffusion run, real
    tokens for a language model's."""
    if records.train and "images" in records.train[0]:
        return "images", "img/s", "images per second"
    return "tokens", "tok/s", "tokens per second"


def _summary(records: RunRecords, predicted: dict[str, Any] | None, calibration: dict[str, Any] | None) -> str:
    start, train = records.start, records.train
    counted, unit, named = _counted(records)
    measured_speed = (sum(r[counted] for r in train) / sum(r["step_seconds"] for r in train)) if train else None
    peak = _peaks(records)
    rows: list[list[Any]] = []

    def add(what: str, value: float | None, unit: str, plan_value: float | None, calibrated: float | None) -> None:
        def shown(number: float | None) -> str:
            return "—" if number is None else f"{number:,.2f} {unit}"

        rows.append([what, shown(value), shown(plan_value), shown(calibrated),
                     f"{value / plan_value - 1:+.1%}" if value and plan_value else "—"])

    measured = calibration.get("measured", {}) if calibration else {}
    add(named, measured_speed, unit, predicted.get(f"{counted}_per_second") if predicted else None,
        measured.get(f"{counted}_per_second"))
    add("peak memory", max(peak) if peak else None, "GiB",
        predicted["device_total_gib"] if predicted else start.get("predicted_memory_gib"),
        measured.get("peak_reserved_gib") or measured.get("growth_gib"))
    add("cost of the whole run", train[-1].get("projected_cost_usd") if train else None, "USD",
        predicted["total_usd"] if predicted else None, None)
    comparison = table([("figure", False), ("measured", True), ("predicted", True), ("calibration", True),
                        ("measured ÷ predicted", True)], rows, sortable=False, name="predicted-vs-measured")
    basis = ("predicted: the plan's option for this device" if predicted else
             "predicted: the memory check before the first step (no plan given: `tunecast report --plan FILE`)")
    batch = (f"micro-batch {start.get('micro_batch', '?')} × accumulation {start.get('grad_accum', '?')}"
             + (", gradient checkpointing" if start.get("grad_checkpointing") else ""))
    shape = facts([("batch", batch),
                   ("checkpoints", start.get("checkpoint_policy", "—")),
                   ("price", f"${start.get('usd_per_hour', 0.0):g}/h"),
                   ("sessions", str(sum(1 for e in records.events if e.get("event") in ("start", "resume"))))])
    return shape + comparison + paragraph(basis, muted=True)


def _peaks(records: RunRecords) -> list[float]:
    """Each step's peak memory as the estimate counts it: allocator reserve on CUDA, resident growth on a CPU."""
    start = records.start
    base = float(start.get("rss_before_model_gib") or 0.0)
    peaks = []
    for record in records.train:
        if "peak_reserved_gib" in record:
            peaks.append(float(record["peak_reserved_gib"]))
        elif "peak_rss_gib" in record:
            peaks.append(float(record["peak_rss_gib"]) - base)
    return peaks


def _empty(name: str, what: str) -> str:
    return f'<figure data-chart="{name}"><p class="muted">{what}</p></figure>'


def _loss(records: RunRecords) -> str:
    import plotly.graph_objects as go

    if not records.train:
        return _empty("loss", "No step has run yet.")
    figure = go.Figure()
    figure.add_trace(go.Scatter(x=[r["step"] for r in records.train], y=[r["loss"] for r in records.train],
                                name="train", mode="lines", line={"color": "#0072B2", "width": 2}))
    if records.evals:
        figure.add_trace(go.Scatter(x=[r["step"] for r in records.evals], y=[r["eval_loss"] for r in records.evals],
                                    name="held out", mode="lines+markers",
                                    line={"color": "#D55E00", "width": 2, "dash": "dash"},
                                    marker={"symbol": "diamond", "size": 9}))
    figure.update_layout(xaxis_title="optimizer step", yaxis_title="loss per trained token",
                         legend={"orientation": "h", "y": -0.2})
    return chart("loss", figure, "Training loss of every logged step and the held-out loss of each evaluation.")


def _learning_rate(records: RunRecords) -> str:
    import plotly.graph_objects as go

    if not records.train:
        return _empty("learning-rate", "No step has run yet.")
    figure = go.Figure(go.Scatter(x=[r["step"] for r in records.train], y=[r["learning_rate"] for r in records.train],
                                  name="learning rate", mode="lines", line={"color": "#009E73", "width": 2}))
    figure.update_layout(xaxis_title="optimizer step", yaxis_title="learning rate", height=300)
    return chart("learning-rate", figure, "The learning rate of each step (warm-up, then the schedule).")


def _speed(records: RunRecords, predicted: dict[str, Any] | None) -> str:
    import plotly.graph_objects as go

    counted, unit, named = _counted(records)
    name = named.replace(" ", "-")
    if not records.train:
        return _empty(name, "No step has run yet.")
    key = f"{counted}_per_second"
    planned = predicted.get(key) if predicted is not None else None
    minutes = [r["elapsed_s"] / 60 for r in records.train]
    figure = go.Figure(go.Scatter(x=minutes, y=[r[key] for r in records.train], name="measured",
                                  mode="lines+markers", marker={"size": 4}, line={"color": "#0072B2"}))
    if planned is not None:
        figure.add_hline(y=planned, line_dash="dash", line_color="#D55E00",
                         annotation_text=f"plan: {planned:,.0f} {unit}")
    what = "real tokens" if counted == "tokens" else "images"
    figure.update_layout(xaxis_title="training time, minutes", yaxis_title=f"{what} per second")
    described = "Real (non-padding) tokens" if counted == "tokens" else "Images"
    return chart(name, figure, f"{described} per second of each step over training time"
                 + (", the plan's prediction dashed." if planned is not None else "."))


def _memory(records: RunRecords, predicted: dict[str, Any] | None) -> str:
    import plotly.graph_objects as go

    peaks = _peaks(records)
    if not peaks:
        return _empty("peak-memory", "No step has run yet.")
    start = records.start
    cpu = start.get("memory_kind") == "cpu" or "peak_rss_gib" in records.train[0]
    figure = go.Figure(go.Scatter(x=[r["step"] for r in records.train], y=peaks, name="measured peak",
                                  mode="lines+markers", marker={"size": 4}, line={"color": "#0072B2"}))
    estimate = predicted["device_total_gib"] if predicted else start.get("predicted_memory_gib")
    if estimate:
        figure.add_hline(y=estimate, line_dash="dash", line_color="#D55E00",
                         annotation_text=f"predicted: {estimate:.2f} GiB")
    capacity = start.get("capacity_gib")
    # a line far above the run would flatten it: drawn when within 4× of what the run uses, else said
    drawn = capacity is not None and capacity <= 4 * max([*peaks, estimate or 0.0])
    if drawn:
        figure.add_hline(y=capacity, line_dash="dot", line_color="#000000",
                         annotation_text=f"usable: {capacity:.1f} GiB")
    what = "resident growth above the process before its model (CPU)" if cpu else "allocator reserve (CUDA)"
    figure.update_layout(xaxis_title="optimizer step", yaxis_title="GiB")
    usable = ("what the run may use (dotted)" if drawn else
              f"the {capacity:.1f} GiB the run may use (not drawn: far above)" if capacity else "")
    return chart("peak-memory", figure, f"Peak memory up to each step: {what}, against the prediction (dashed)"
                 + (f" and {usable}" if usable else "") + ".")


def _cost(records: RunRecords, predicted: dict[str, Any] | None) -> str:
    import plotly.graph_objects as go

    if not records.train:
        return _empty("cost", "No step has run yet.")
    spent = [r.get("cost_usd") or 0.0 for r in records.train] + [r.get("projected_cost_usd") or 0.0
                                                                  for r in records.train]
    if not any(spent) and (predicted is None or not predicted.get("total_usd")):
        # a flat line at $0 on an axis from −1 to 1 says nothing a sentence does not say better
        return _empty("cost", "No cost to chart: the run had no price, so everything shows $0. Give it one with "
                              "pricing.usd_per_hour (or --usd-per-hour) for a local GPU, or run on a GPU the catalog "
                              "has offers for.")
    hours = [r["elapsed_s"] / 3600 for r in records.train]
    figure = go.Figure()
    figure.add_trace(go.Scatter(x=hours, y=[r["cost_usd"] for r in records.train], name="spent", mode="lines",
                                line={"color": "#0072B2", "width": 3}))
    if any("projected_cost_usd" in r for r in records.train):
        figure.add_trace(go.Scatter(x=hours, y=[r.get("projected_cost_usd") for r in records.train],
                                    name="projected at the end", mode="lines",
                                    line={"color": "#E69F00", "width": 2, "dash": "dash"}))
    if predicted is not None and predicted.get("total_usd") is not None:
        figure.add_hline(y=predicted["total_usd"], line_dash="dot", line_color="#D55E00",
                         annotation_text=f"plan: ${predicted['total_usd']:,.2f}")
    figure.update_layout(xaxis_title="training time, hours", yaxis_title="USD", yaxis_rangemode="tozero",
                         legend={"orientation": "h", "y": -0.2})
    return chart("cost", figure, "What the run has cost so far at its price, the projection at the end from the "
                 "current step time" + (", and the plan's total." if predicted else "."))


TIMELINE = {"start": ("circle", "#009E73"), "resume": ("triangle-up", "#56B4E9"), "checkpoint": ("square", "#0072B2"),
            "preempted": ("x", "#D55E00"), "finished": ("star", "#000000")}


def _timeline(records: RunRecords) -> str:
    import plotly.graph_objects as go

    figure = go.Figure()
    for kind, (symbol, colour) in TIMELINE.items():
        chosen = [e for e in records.events if e.get("event") == kind and e.get("elapsed_s") is not None]
        if chosen:
            figure.add_trace(go.Scatter(
                x=[e["elapsed_s"] / 60 for e in chosen], y=[kind] * len(chosen), mode="markers", name=kind,
                marker={"symbol": symbol, "size": 12, "color": colour},
                text=[f"step {e.get('step')}: {e.get('reason') or e.get('signal') or kind}" for e in chosen],
                hovertemplate="%{text}<br>%{x:.1f} min<extra></extra>"))
    if records.evals:
        figure.add_trace(go.Scatter(x=[e["elapsed_s"] / 60 for e in records.evals],
                                    y=["evaluation"] * len(records.evals), mode="markers", name="evaluation",
                                    marker={"symbol": "diamond", "size": 10, "color": "#CC79A7"},
                                    text=[f"step {e['step']}: loss {e['eval_loss']:.4f}" for e in records.evals],
                                    hovertemplate="%{text}<br>%{x:.1f} min<extra></extra>"))
    if not figure.data:
        return _empty("timeline", "Nothing has happened yet.")
    figure.update_layout(xaxis_title="training time, minutes", height=320, showlegend=False)
    return chart("timeline", figure, "Starts, resumptions, checkpoints, preemptions and evaluations over training "
                 "time.")
