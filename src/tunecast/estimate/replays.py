"""Replays of step profiles, kept in this process and on disk, so that a warm estimate replays nothing.

Replaying a profile (profile.py: every allocation of the step, on the simulated caching allocator) costs
5-20 ms for a 4- or 8-layer copy of a large model, and one estimate asks for dozens: both depths, the
ladder of shapes that keeps reserved monotone (memory.py), and a fit search or a plan asks again for each
micro-batch, length and setting it tries. A replay depends only on the profile, the shape, the device
kind and the fixed blocks; profiles that come from the cache or a template carry an `origin` naming them
(their cache key, which holds the library versions), and their replays are kept under that name in
`~/.cache/tunecast/replays/`, written atomically, with a digest of the replay's own code (a replay of other
code is not used). A damaged file is dropped with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunecast.atomic import write_text_atomic
from tunecast.estimate import allocator as allocator_module
from tunecast.estimate import profile as profile_module
from tunecast.estimate import progress
from tunecast.estimate.profile import PhasePeak, Replay, StepProfile, replay
from tunecast.estimate.profiles import ProfilePair
from tunecast.paths import cache_dir

REPLAY_FORMAT = 2  # bump when what a kept replay holds changes


@functools.cache
def _code() -> str:
    """The replay's own code (profile.py's replay, allocator.py's simulation): a kept replay of other code is
    not used."""
    digest = hashlib.sha256()
    for module in (profile_module, allocator_module):
        digest.update(Path(str(module.__file__)).read_bytes())
    return f"{REPLAY_FORMAT}-{digest.hexdigest()[:16]}"


_KEPT = 4096  # replays of profiles without an origin kept in this process

# Replays by origin (and shape), as read from disk and added to in this process; which origins changed.
_BY_ORIGIN: dict[str, dict[str, Replay]] = {}
_CHANGED: set[str] = set()
# Replays of profiles without an origin (traced in this process and not cached), by object.
_BY_OBJECT: dict[tuple[int, str], tuple[StepProfile, Replay]] = {}


def _path(origin: str) -> Path:
    return cache_dir() / "replays" / f"{hashlib.sha256(origin.encode()).hexdigest()[:32]}.json"


def _to_json(result: Replay) -> list[Any]:
    return [{name: [peak.allocated, peak.breakdown] for name, peak in result.phases.items()},
            result.peak_reserved, result.extra_allocated, result.peak_pinned]


def _from_json(data: list[Any]) -> Replay:
    phases, reserved, extra, pinned = data
    return Replay({name: PhasePeak(int(allocated), {k: int(v) for k, v in breakdown.items()})
                   for name, (allocated, breakdown) in phases.items()}, int(reserved), int(extra), int(pinned))


def _kept(origin: str) -> dict[str, Replay]:
    if origin in _BY_ORIGIN:
        return _BY_ORIGIN[origin]
    found: dict[str, Replay] = {}
    path = _path(origin)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("format") == _code() and data.get("origin") == origin:
                found = {key: _from_json(value) for key, value in data["replays"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as damaged:
            progress.warning(f"the cached replays {path} are damaged ({type(damaged).__name__}: {damaged}); "
                             "replaying again")
            found = {}
    _BY_ORIGIN[origin] = found
    return found


def replayed(pair: ProfilePair, which: str, batch: int, seq: int, *, cuda: bool, blocks: tuple[int, ...],
             reserve: bool = True) -> Replay:
    """The replay of `pair.shallow` or `pair.deeper` (`which`) at (batch, seq); without `reserve`, one that
    does not simulate the allocator's reserve (profile.replay)."""
    profile: StepProfile = getattr(pair, which)
    key = f"{which} {batch} {seq} {int(cuda)} {','.join(map(str, blocks))}" + ("" if reserve else " allocated")
    if pair.origin is None:
        entry = _BY_OBJECT.get((id(profile), key))
        if entry is not None and entry[0] is profile:  # the entry holds its profile, so the id is not reused
            return entry[1]
        if len(_BY_OBJECT) >= _KEPT:
            _BY_OBJECT.clear()
        result = replay(profile, batch, seq, cuda=cuda, fixed_blocks=blocks, reserve=reserve)
        _BY_OBJECT[(id(profile), key)] = (profile, result)
        return result
    kept = _kept(pair.origin)
    if key not in kept:
        kept[key] = replay(profile, batch, seq, cuda=cuda, fixed_blocks=blocks, reserve=reserve)
        _CHANGED.add(pair.origin)
    return kept[key]


def exported() -> dict[str, dict[str, Replay]]:
    """The replays of profiles with an origin made or read in this process (for another process's `merge`)."""
    return {origin: dict(kept) for origin, kept in _BY_ORIGIN.items()}


def merge(found: dict[str, dict[str, Replay]]) -> None:
    """Add replays another process made (prewarm.py): kept, and written with this process's at its flush."""
    for origin, kept in found.items():
        mine = _kept(origin)
        added = {key: value for key, value in kept.items() if key not in mine}
        if added:
            mine.update(added)
            _CHANGED.add(origin)


_DEFERRING = [0]  # depth of `deferred` blocks: while above 0, `flush` writes nothing


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Write the replays once, on leaving the block (also on an error or Ctrl-C), not at each estimate's
    flush: a limit search or a plan is dozens of estimates, and each write is a whole file and an fsync."""
    _DEFERRING[0] += 1
    try:
        yield
    finally:
        _DEFERRING[0] -= 1
        flush()


def flush() -> None:
    """Write the replays added in this process (atomically; nothing when caching is off, nor inside a
    `deferred` block, which writes them when it ends)."""
    if _DEFERRING[0]:
        return
    if os.environ.get("TUNECAST_NO_CACHE") == "1":
        _CHANGED.clear()
        return
    for origin in sorted(_CHANGED):
        kept = _BY_ORIGIN.get(origin)
        if kept is None:  # dropped from this process since (tests reset it)
            continue
        write_text_atomic(_path(origin), json.dumps(
            {"format": _code(), "origin": origin, "replays": {k: _to_json(v) for k, v in kept.items()}},
            separators=(",", ":")))
    _CHANGED.clear()
