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
            if kills >= KILLS:
                # enough kills have landed: the run is let finish (under load a run can take longer than every kill
                # time drawn, and then no attempt would end by itself)
                code = server.run(args, log)
            elif attempt % 3 == 2:
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


def _said(log: Path) -> str:
    """The log with its lines joined (rich wraps long lines); empty before the run has written to it."""
    return " ".join(log.read_text().split()) if log.exists() else ""


def test_resume_decisions_are_said_before_training(server: ForkServer, tmp_path: Path) -> None:
    """Which checkpoint, what was skipped and why, what changed: said as the run opens its output, so a run that
    dies before its first step (here: SIGKILL) has said them."""
    import shutil

    config = tiny_run(tmp_path, max_steps=6, **NO_EVAL)
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0
    output = tmp_path / "out"
    shutil.rmtree(output / "final")  # as if killed while final/ was written
    damaged = next((output / "checkpoints" / "step-00000006" / "state").glob("*.distcp"))
    damaged.write_bytes(damaged.read_bytes()[:100])
    changed = tiny_run(tmp_path, max_steps=6, log_every_steps=2, **NO_EVAL)

    code, _ = server.signal_when(["train", str(changed)], tmp_path / "log2.txt",
                                 lambda: "log_every_steps" in _said(tmp_path / "log2.txt"),
                                 signal_number=signal.SIGKILL)

    assert code == -signal.SIGKILL
    said = _said(tmp_path / "log2.txt")
    assert (f"checkpoints/step-00000006: skipped: state/{damaged.name} has 100 bytes, the manifest says "
            in said and "(truncated) → it was left by an interrupted or damaged write; checkpoint step 4 is used "
            "instead" in said)
    assert "resuming from checkpoint step 4 (checkpoints/step-00000004, the newest that verifies)" in said
    assert "log_every_steps: changed since the checkpoint (1 → 2); it does not change training" in said
    assert "step 5/6" not in said  # all of it before training


def test_damaged_checkpoints_are_not_overwritten_by_a_fresh_start(server: ForkServer, tmp_path: Path) -> None:
    config = tiny_run(tmp_path, max_steps=4, **NO_EVAL)
    assert server.run(["train", str(config)], tmp_path / "log.txt") == 0
    output = tmp_path / "out"
    for progress in (output / "checkpoints").glob("step-*/progress.json"):
        flipped = bytearray(progress.read_bytes())
        flipped[len(flipped) // 2] ^= 0x01  # a bit flipped on the disk
        progress.write_bytes(bytes(flipped))
    damaged = {path: path.read_bytes() for path in (output / "checkpoints").rglob("*") if path.is_file()}

    assert server.run(["train", str(config)], tmp_path / "log2.txt") == 2
    said = _said(tmp_path / "log2.txt")
    assert (f"error: no checkpoint in {output} verifies (step-00000004: progress.json does not match its SHA-256 "
            "(corrupted); step-00000002: progress.json does not match its SHA-256 (corrupted)): starting from step 0 "
            "would overwrite them") in said
    assert "pass --fresh to start over" in said
    assert {path: path.read_bytes() for path in (output / "checkpoints").rglob("*") if path.is_file()} == damaged

    assert server.run(["train", str(config), "--fresh"], tmp_path / "log3.txt") == 0
    moved = next(tmp_path.glob("out.old-*"))
    assert (moved / "checkpoints" / "step-00000004" / "progress.json").read_bytes() == \
        damaged[output / "checkpoints" / "step-00000004" / "progress.json"]


def test_max_steps_ends_a_run_of_epochs_early_and_a_rerun_continues_it(server: ForkServer, tmp_path: Path) -> None:
    """With both set, the epochs set the schedule and max_steps ends the run: its steps are the first steps of
    the run of the epochs alone, and the same output run again without max_steps continues it to the same
    result, bit for bit."""
    alone = tmp_path / "alone"
    alone.mkdir()
    assert server.run(["train", str(tiny_run(alone, max_steps=None, epochs=1))], alone / "log.txt") == 0
    reference = train_losses(alone / "out")
    assert sorted(reference) == list(range(1, 10))  # 36 examples, 4 a step

    capped = tiny_run(tmp_path, max_steps=4, epochs=1)
    assert server.run(["train", str(capped)], tmp_path / "log.txt") == 0, _said(tmp_path / "log.txt")[-3000:]
    assert ("max_steps 4 ends the run at step 4 of the 9 steps of 1 epoch; the learning-rate schedule follows the "
            "1 epoch") in _said(tmp_path / "log.txt")
    assert train_losses(tmp_path / "out") == {step: reference[step] for step in range(1, 5)}
    assert server.run(["train", str(capped)], tmp_path / "log2.txt") == 0
    assert "Already complete" in _said(tmp_path / "log2.txt")

    longer = tiny_run(tmp_path, name="longer.yaml", max_steps=None, epochs=1)
    assert server.run(["train", str(longer)], tmp_path / "log3.txt") == 0, _said(tmp_path / "log3.txt")[-3000:]
    said = _said(tmp_path / "log3.txt")
    assert "resuming from checkpoint step 4" in said and "max_steps: changed since the checkpoint (4 → None)" in said
    assert train_losses(tmp_path / "out") == reference
    assert adapter_bytes(tmp_path / "out") == adapter_bytes(alone / "out")
    assert server.run(["train", str(capped)], tmp_path / "log4.txt") == 0
    assert "Already complete" in _said(tmp_path / "log4.txt") and "at step 9" in _said(tmp_path / "log4.txt")
