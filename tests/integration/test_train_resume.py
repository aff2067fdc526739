"""A preempted run costs only the work since its last checkpoint, and a resumed run equals an uninterrupted one
bit for bit: the same final adapter bytes and the same loss at every step.

Runs start in fresh processes forked from a warm server (tests/forkserver.py), so that each kill is a real
SIGKILL or SIGTERM of a real process, without paying for torch's import every time.
"""

from __future__ import annotations

import json
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.trainruns import NO_EVAL, ForkServer, adapter_bytes, tiny_run, train_losses

KILLS = 10  # random SIGKILLs in CI; benchmarks/kill_resume.py runs 100
MAX_ATTEMPTS = 40


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    forks = ForkServer.start()
    yield forks
    forks.stop()


@pytest.fixture(scope="module")
def reference(server: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The uninterrupted run: its adapter, losses, and how long it took."""
    import time

    tmp = tmp_path_factory.mktemp("reference")
    config = tiny_run(tmp)
    started = time.monotonic()
    code = server.run(["train", str(config)], tmp / "log.txt")
    assert code == 0, (tmp / "log.txt").read_text()[-3000:]
    return {"adapter": adapter_bytes(tmp / "out"), "losses": train_losses(tmp / "out"),
            "seconds": time.monotonic() - started}


def test_uninterrupted_run_is_repeatable(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    code = server.run(["train", str(tiny_run(tmp_path))], tmp_path / "log.txt")
    assert code == 0
    assert adapter_bytes(tmp_path / "out") == reference["adapter"]
    assert train_losses(tmp_path / "out") == reference["losses"]
    assert sorted(reference["losses"]) == list(range(1, 17))  # type: ignore[call-overload]


def test_random_sigkills_resume_bit_exact(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    """SIGKILL at random moments — some while a checkpoint file is half written — then the same command
    again, until the run finishes: the result equals the uninterrupted run's. Runs are repeated (each in a
    new output) until KILLS kills have landed."""
    chooser = random.Random(20261130)
    kills = in_write = rounds = 0
    # kill times are drawn within the uninterrupted run's duration; a run that finishes before its kill (the
    # machine got faster, or little was left after a resume) narrows the span, so that kills keep landing
    span = float(reference["seconds"])
    while kills < KILLS:
        rounds += 1
        assert rounds <= 6, f"only {kills} kills landed in {rounds - 1} runs"
        folder = tmp_path / f"round-{rounds}"
        folder.mkdir()
        args = ["train", str(tiny_run(folder))]
        for attempt in range(MAX_ATTEMPTS):
            log = folder / f"log-{attempt}.txt"
            if attempt % 3 == 2:
                # a kill in the middle of writing a file: the n-th of this process's writes to the run's storage
                code = server.run(args, log, kill_in_write=chooser.randint(2, 14))
                in_write += code == -signal.SIGKILL
            else:
                after_s = chooser.uniform(0.2, span)
                code, _ = server.run_and_signal(args, log, after_s=after_s)
                if code == 0:
                    span = max(1.0, 0.6 * after_s)
            if code == 0:
                break
            assert code == -signal.SIGKILL, log.read_text()[-3000:]
            kills += 1
        assert code == 0, "the run never finished"
        assert not list((folder / "out").rglob("*.tmp-*")), "half-written files left behind"
        assert adapter_bytes(folder / "out") == reference["adapter"]
        assert train_losses(folder / "out") == reference["losses"]
    assert in_write >= 1


def test_sigterm_saves_and_exits_75_then_resumes(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    config = tiny_run(tmp_path, **{"checkpoint.every_steps": 100})  # only the preemption checkpoint
    output = tmp_path / "out"

    def trained_three_steps() -> bool:
        metrics = output / "metrics.jsonl"
        return metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3

    code, seconds = server.signal_when(["train", str(config)], tmp_path / "log.txt", trained_three_steps,
                                       signal_number=signal.SIGTERM)
    assert code == 75, (tmp_path / "log.txt").read_text()[-3000:]
    assert seconds < 5
    saved = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert len(saved) == 1 and (output / "checkpoints" / saved[0] / "manifest.json").exists()
    events = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "preempted" and e.get("signal") == "SIGTERM" for e in events)
    assert "run the same command again" in " ".join((tmp_path / "log.txt").read_text().lower().split())

    code = server.run(["train", str(config)], tmp_path / "log2.txt")
    assert code == 0, (tmp_path / "log2.txt").read_text()[-3000:]
    assert "resumed from checkpoint" in " ".join((tmp_path / "log2.txt").read_text().split())
    assert adapter_bytes(output) == reference["adapter"]
    assert train_losses(output) == reference["losses"]


def test_signal_before_training_exits_75(server: ForkServer, tmp_path: Path) -> None:
    code, seconds = server.run_and_signal(["train", str(tiny_run(tmp_path))], tmp_path / "log.txt", after_s=0.05,
                                          signal_number=signal.SIGTERM)
    assert code == 75, (tmp_path / "log.txt").read_text()[-3000:]
    assert seconds < 5


def test_finished_run_says_so(server: ForkServer, reference: dict, tmp_path: Path) -> None:
    config = tiny_run(tmp_path, max_steps=2, **NO_EVAL)
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0
    assert server.run(["train", str(config)], tmp_path / "log2.txt") == 0
    assert "Already complete" in " ".join((tmp_path / "log2.txt").read_text().split())


def test_changed_config_is_refused_and_fresh_moves_aside(server: ForkServer, tmp_path: Path) -> None:
    config = tiny_run(tmp_path, max_steps=2, **NO_EVAL)
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0
    changed = tiny_run(tmp_path, max_steps=2, learning_rate=1e-3, **NO_EVAL)
    assert server.run(["train", str(changed)], tmp_path / "log2.txt") == 2
    message = " ".join((tmp_path / "log2.txt").read_text().split())
    assert "learning_rate" in message and "--fresh" in message
    harmless = tiny_run(tmp_path, max_steps=2, log_every_steps=5, **NO_EVAL)
    assert server.run(["train", str(harmless)], tmp_path / "log3.txt") == 0
    assert server.run(["train", str(changed), "--fresh"], tmp_path / "log4.txt") == 0
    assert len(list(tmp_path.glob("out.old-*"))) == 1


def test_checkpoints_on_object_storage_resume_bit_exact(server: ForkServer, reference: dict, s3_url: str,
                                                        s3_endpoint: str, tmp_path: Path) -> None:
    """The same run with its output on an S3 server (moto, on loopback): SIGTERM, resume, same result."""
    import fsspec
    from tests.s3server import FAKE_AWS_ENV

    server.env = {**FAKE_AWS_ENV, "TUNECAST_TEST_S3_ENDPOINT": s3_endpoint}
    config = tiny_run(tmp_path, output=s3_url)
    fs = fsspec.filesystem("s3")
    root = s3_url.removeprefix("s3://")

    def trained_four_steps() -> bool:
        fs.invalidate_cache()
        return any(p.rsplit("/", 1)[-1].startswith("step-") for p in fs.ls(f"{root}/checkpoints", detail=False)) \
            if fs.exists(f"{root}/checkpoints") else False

    try:
        code, _ = server.signal_when(["train", str(config)], tmp_path / "log.txt", trained_four_steps,
                                     signal_number=signal.SIGTERM)
        assert code == 75, (tmp_path / "log.txt").read_text()[-3000:]
        code = server.run(["train", str(config)], tmp_path / "log2.txt")
        assert code == 0, (tmp_path / "log2.txt").read_text()[-3000:]
    finally:
        server.env = {}
    fs.invalidate_cache()
    assert fs.cat(f"{root}/final/adapter_model.safetensors") == reference["adapter"]
    losses = {}
    for line in fs.cat(f"{root}/metrics.jsonl").decode().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            assert record["step"] not in losses
            losses[record["step"]] = record["loss"]
    assert losses == reference["losses"]
