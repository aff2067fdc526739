"""How long traces take on this machine, so that an estimate that must trace can say so before it starts.

A trace runs on fake tensors: its time goes to dispatching the step's operations, which grow with the layers
traced, and to the few real tensors it makes (the attention masks, of the sequence's length squared). So the time is
kept as seconds per traced layer, measured by every trace this machine makes (the cache's
`profiles/seconds-per-layer.json`), and a new trace is expected to take that rate times its layers. Traces of the
model itself and traces at a template's marker dimensions (a few dozen tokens) keep a rate each: measured here, a
marker layer takes about a fifth of a model layer at the lengths estimates trace.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from tunecast.atomic import write_text_atomic
from tunecast.paths import cache_file

Kind = Literal["model", "marker"]
# Before this machine has traced anything: a 7B model's layer at 16k tokens on a 2-core laptop CPU, and a layer at
# marker dimensions (Gemma 3 4B's template, 2 traces of 34 layers: 16 s on 2 cores).
DEFAULT_SECONDS_PER_LAYER = {"model": 2.0, "marker": 0.25}
_KEYS = {"model": "seconds_per_layer", "marker": "marker_seconds_per_layer"}


def _path() -> Path:
    return cache_file("profiles", "seconds-per-layer.json")


def _rates() -> dict[str, float]:
    try:
        rates = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return rates if isinstance(rates, dict) else {}


def _rate(kind: Kind) -> float | None:
    try:
        rate = float(_rates()[_KEYS[kind]])
    except (KeyError, TypeError, ValueError):
        return None
    return rate if rate > 0 else None


def expected(depths: tuple[int, ...], traces: int, kind: Kind = "model") -> int:
    """Roughly how many seconds `traces` traces of `kind` take, split evenly over `depths` layers (at least 1)."""
    rate = _rate(kind) or DEFAULT_SECONDS_PER_LAYER[kind]
    return max(1, round(rate * traces * sum(depths) / len(depths)))


def remember(seconds: float, depths: tuple[int, ...], traces: int, kind: Kind = "model") -> None:
    """Fold a measurement of `traces` traces of `kind` over `depths` into this machine's rate (the mean with the
    last one); the other kind's rate is kept."""
    if os.environ.get("TUNECAST_NO_CACHE") == "1" or traces == 0 or not depths:
        return
    measured = seconds / (traces * sum(depths) / len(depths))
    before = _rate(kind)
    if before is not None:
        measured = (measured + before) / 2
    rates = {key: value for key, value in _rates().items() if key in _KEYS.values()}
    write_text_atomic(_path(), json.dumps({**rates, _KEYS[kind]: measured}))
