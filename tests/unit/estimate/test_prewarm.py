"""The second process that replays a composed step's limits while the first traces its loss (prewarm.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tunecast.estimate import prewarm, replays
from tunecast.estimate.memory import RESERVE_MIN_SEQ
from tunecast.estimate.profile import PhasePeak, Replay
from tunecast.estimate.profiles import NeedsTrace


def test_the_walk_goes_up_both_limits_to_the_second_shape_past_the_capacity() -> None:
    asked: list[tuple[str, int]] = []

    def proxy(**shape: int) -> float:
        (name, value), = shape.items()
        asked.append((name, value))
        return value / 10 if name == "micro_batch" else value / 1000  # GiB: 80 at 800 sequences, at 80k tokens

    prewarm.walk(proxy, 80.0, batch=8, seq=1024, longest=1 << 20)
    batches = [value for name, value in asked if name == "micro_batch"]
    lengths = [value for name, value in asked if name == "seq_len"]
    assert batches == [1 << k for k in range(12)]  # 1024 is past 800, 2048 the second
    # the reserve ladder's lengths above 1024: 98,304 is past 80k tokens, 131,072 the second
    assert lengths == [3 * RESERVE_MIN_SEQ, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536,
                       98304, 131072]


def test_the_walk_stops_where_no_template_serves_and_at_the_context_length() -> None:
    asked: list[int] = []

    def proxy(**shape: int) -> float:
        value = shape.get("micro_batch", shape.get("seq_len", 0))
        asked.append(value)
        if "micro_batch" in shape and value >= 4:
            raise NeedsTrace("no template at this micro-batch")
        return 1.0

    prewarm.walk(proxy, 80.0, batch=2, seq=1024, longest=2048)
    assert asked == [1, 2, 4, 1536, 2048]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the second process is forked")
def test_the_second_process_s_replays_are_this_process_s_after_collecting(isolated_home: object,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replays, "_BY_ORIGIN", {})
    monkeypatch.setattr(replays, "_CHANGED", set())
    monkeypatch.setattr(prewarm.threading, "active_count", lambda: 1)  # pytest-xdist's worker runs a thread
    made = Replay({"forward": PhasePeak(7, {})}, 11, 0)

    def proxy(**shape: int) -> float:  # in the second process: a replay of a template it estimated
        replays.merge({"template test-origin": {f"shallow {shape}": made}})
        return 1e9

    started = prewarm.start(proxy, 80.0, batch=1, seq=512, longest=512)
    assert started is not None
    prewarm.collect(started)
    kept = replays.exported()["template test-origin"]
    assert kept == {f"shallow {{'micro_batch': {b}}}": made for b in (1, 2, 4)}
    prewarm.abandon(started)  # after collecting: nothing left to stop, and nothing closed twice


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the second process is forked")
def test_a_second_process_that_fails_leaves_this_one_as_it_was(isolated_home: object,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prewarm.threading, "active_count", lambda: 1)
    def proxy(**shape: int) -> float:
        os._exit(3)  # as if killed

    before = replays.exported()
    started = prewarm.start(proxy, 80.0, batch=1, seq=512, longest=512)
    prewarm.collect(started)
    assert replays.exported() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the second process is forked")
def test_both_limits_at_once_the_second_in_a_forked_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prewarm.threading, "active_count", lambda: 1)  # the test runner's threads aside
    here = os.getpid()
    assert prewarm.both(lambda: 1, lambda: 2 if os.getpid() != here else -1) == (1, 2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the second process is forked")
def test_a_second_limit_whose_process_fails_is_solved_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prewarm.threading, "active_count", lambda: 1)
    here = os.getpid()

    def second() -> int:
        if os.getpid() != here:
            os._exit(3)  # as if killed
        return 2

    assert prewarm.both(lambda: 1, second) == (1, 2)


def test_a_process_with_threads_starts_no_second_one() -> None:
    """A server's estimates: a lock another thread holds while the process forks stays held in the fork."""
    stop = threading.Event()
    waiting = threading.Thread(target=stop.wait)
    waiting.start()
    here = os.getpid()
    try:
        assert prewarm.start(lambda **shape: 1.0, 80.0, batch=1, seq=512, longest=512) is None
        # nor does it solve a composed step's second limit in a fork: both here, in turn
        assert prewarm.both(lambda: 1, lambda: 2 if os.getpid() == here else -1) == (1, 2)
    finally:
        stop.set()
        waiting.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the second process is forked")
def test_a_first_limit_that_fails_stops_the_second_process(monkeypatch: pytest.MonkeyPatch) -> None:
    forked: list[int] = []
    fork = os.fork

    def recorded() -> int:
        pid = fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(prewarm.os, "fork", recorded)
    monkeypatch.setattr(prewarm.threading, "active_count", lambda: 1)

    def first() -> int:
        raise ValueError("the first limit's estimate failed")

    with pytest.raises(ValueError, match="first limit"):
        prewarm.both(first, lambda: time.sleep(60) or 2)
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)  # stopped and waited for, not left running


def test_the_command_line_s_spinner_stops_its_thread_while_the_second_limit_forks() -> None:
    """The spinner `tunecast memory` shows (rich's status) refreshes from a thread of its own: while a composed step's
    second limit forks (`progress.paused`), that thread is stopped, so the fork copies no lock it holds; the spinner
    runs again afterwards."""
    from tunecast.cli.render import working
    from tunecast.estimate import progress

    before = threading.active_count()
    with working("estimating"):
        spinning = threading.active_count()
        with progress.paused():
            stopped = threading.active_count()
        assert threading.active_count() == spinning
    assert spinning == before + 1 and stopped == before
