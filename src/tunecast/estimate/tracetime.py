"""How long traces take on this machine, so that an estimate that must trace can say so before it starts.

A trace runs on fake tensors: its time goes to dispatching the step's operations, which grow with the layers
traced, not with the tensors' sizes. So the time is kept as seconds per traced layer, measured by every trace this
machine makes (the cache's `profiles/seconds-per-layer.json`), and a new trace is expected to take that rate times
its layers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tunecast.atomic import write_text_atomic
from tunecast.paths import cache_file

# Before this machine has traced anything: a 7B model's layer at 16k tokens on a 2-core laptop CPU.
DEFAULT_SECONDS_PER_LAYER = 2.0


def _path() -> Path:
    return cache_file("profiles", "seconds-per-layer.json")


def _rate() -> float:
    try:
        rate = float(json.loads(_path().read_text())["seconds_per_layer"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_SECONDS_PER_LAYER
    return rate if rate > 0 else DEFAULT_SECONDS_PER_LAYER


def expected(depths: tuple[int, ...], traces: int) -> int:
    """Roughly how many seconds `traces` traces take, split evenly over `depths` layers (at least 1)."""
    return max(1, round(_rate() * traces * sum(depths) / len(depths)))


def remember(seconds: float, depths: tuple[int, ...], traces: int) -> None:
    """Fold a measurement of `traces` traces over `depths` into this machine's rate (the mean with the last one)."""
    if os.environ.get("TUNECAST_NO_CACHE") == "1" or traces == 0 or not depths:
        return
    measured = seconds / (traces * sum(depths) / len(depths))
    if _path().is_file():
        measured = (measured + _rate()) / 2
    write_text_atomic(_path(), json.dumps({"seconds_per_layer": measured}))
