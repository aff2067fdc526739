"""Past one process: DDP and FSDP2 runs of the tiny model on two CPU processes (gloo) train, checkpoint, are
stopped — SIGTERM to every rank, or SIGKILL of one — and resume to the same final weights as an uninterrupted
two-process run; a two-process checkpoint resumes in one process; the global batch is the config's whatever
the number of processes; `tunecast train --gpus 2` starts its own workers.

The workers are forked from a warm server with the variables torchrun sets (tests/forkserver.py), so that a
kill is a real signal to a real process without paying for torch's import at every start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.trainruns import NO_EVAL, REPO, ForkServer, adapter_bytes, tiny_run, train_losses

STRATEGIES = ["ddp", "fsdp"]


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    forks = ForkServer.start()
    yield forks
    forks.stop()


def _log(log: Path, ranks: int = 2) -> str:
    return "\n".join(f"--- rank {rank}\n" + Path(f"{log}.rank{rank}").read_text()[-2500:] for rank in range(ranks)
                     if Path(f"{log}.rank{rank}").exists())


def _train_lines(output: Path) -> int:
    metrics = output / "metrics.jsonl"
    return metrics.read_text().count('"kind": "train"') if metrics.exists() else 0


def _signal_ranks_when(server: ForkServer, args: list[str], log: Path, ready, *, signal_number: int,  # type: ignore[no-untyped-def]
                       ranks: list[int], timeout_s: float = 180.0) -> tuple[list[int], float]:
    """Start two workers, send `signal_number` to the workers `ranks` once `ready()`; their statuses and the seconds
    from the signal until both ended."""
    pids = server.start_ranks(args, log, 2)
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"never ready:\n{_log(log)}"
        time.sleep(0.05)
    sent = time.monotonic()
    for rank in ranks:
        os.kill(pids[rank], signal_number)
    codes = server.wait_ranks()
    return codes, time.monotonic() - sent


@pytest.fixture(scope="module")
def references(server: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """The uninterrupted two-process run of each strategy: its adapter and losses."""
    found = {}
    for strategy in STRATEGIES:
        tmp = tmp_path_factory.mktemp(f"reference-{strategy}")
        codes = server.run_ranks(["train", str(tiny_run(tmp, **{"gpus.strategy": strategy}))], tmp / "log", 2)
        assert codes == [0, 0], _log(tmp / "log")
        found[strategy] = {"adapter": adapter_bytes(tmp / "out"), "losses": train_losses(tmp / "out")}
    return found


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stopped_and_killed_runs_resume_bit_exact(server: ForkServer, references: dict, strategy: str,
                                                  tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone: both ranks save together and exit 75. SIGKILL of rank 1: rank 0 stops promptly
    with 75 and no new checkpoint. Each time the same command resumes; the end equals the uninterrupted run's."""
    config = tiny_run(tmp_path, **{"gpus.strategy": strategy})
    output = tmp_path / "out"
    args = ["train", str(config)]

    codes, seconds = _signal_ranks_when(server, args, tmp_path / "log1", lambda: _train_lines(output) >= 3,
                                        signal_number=signal.SIGTERM, ranks=[1])
    assert codes == [75, 75], _log(tmp_path / "log1")
    assert seconds < 10
    assert "SIGTERM (on another rank): saving step" in " ".join(Path(f"{tmp_path / 'log1'}.rank0").read_text().split())
    stopped = json.loads((output / "checkpoints").joinpath(
        sorted(p.name for p in (output / "checkpoints").iterdir())[-1], "manifest.json").read_text())
    assert stopped["world_size"] == 2 and stopped["layout"] == "dcp"
    assert {"state/__0_0.distcp", "state/__1_0.distcp", "state/.metadata", "rng-rank000.pt",
            "rng-rank001.pt"} <= set(stopped["files"])

    codes, seconds = _signal_ranks_when(server, args, tmp_path / "log2", lambda: _train_lines(output) >= 9,
                                        signal_number=signal.SIGKILL, ranks=[1])
    assert codes == [75, -signal.SIGKILL], _log(tmp_path / "log2")
    assert seconds < 30, "the surviving rank did not stop promptly"
    assert "Another worker was lost" in " ".join(Path(f"{tmp_path / 'log2'}.rank0").read_text().split())

    codes = server.run_ranks(args, tmp_path / "log3", 2)
    assert codes == [0, 0], _log(tmp_path / "log3")
    assert not list(output.rglob("*.tmp-*")), "half-written files left behind"
    assert adapter_bytes(output) == references[strategy]["adapter"]
    assert train_losses(output) == references[strategy]["losses"]


def test_a_two_process_checkpoint_resumes_in_one(server: ForkServer, tmp_path: Path) -> None:
    config = tiny_run(tmp_path, **{"gpus.strategy": "fsdp"})
    output = tmp_path / "out"
    codes, _ = _signal_ranks_when(server, ["train", str(config)], tmp_path / "log", lambda: _train_lines(output) >= 5,
                                  signal_number=signal.SIGTERM, ranks=[0, 1])
    assert codes == [75, 75], _log(tmp_path / "log")
    code = server.run(["train", str(config), "--gpus", "1"], tmp_path / "one.txt")
    text = " ".join((tmp_path / "one.txt").read_text().split())
    assert code == 0, text[-3000:]
    assert "resumed from checkpoint" in text and "written by 2 process(es), this run has 1" in text
    assert sorted(train_losses(output)) == list(range(1, 17))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(output / "base"))
    PeftModel.from_pretrained(base, str(output / "final"))


def test_the_global_batch_is_the_configs(server: ForkServer, tmp_path: Path) -> None:
    """Without dropout, two processes at grad_accum 2 train what one process does at grad_accum 4: the same
    sequences per step (sharded without overlap or loss), the same losses and weights up to rounding."""
    import torch
    from safetensors.torch import load

    plain = {"lora.dropout": 0.0, "max_steps": 4, "checkpoint.every_steps": 100, **NO_EVAL}
    (tmp_path / "one").mkdir()
    one = tiny_run(tmp_path / "one", grad_accum=4, **plain)
    assert server.run(["train", str(one)], tmp_path / "one.txt") == 0, (tmp_path / "one.txt").read_text()[-3000:]
    runs = {"one": tmp_path / "one"}
    for strategy in STRATEGIES:
        folder = tmp_path / strategy
        folder.mkdir()
        config = tiny_run(folder, **plain, **{"gpus.strategy": strategy})
        assert server.run_ranks(["train", str(config)], folder / "log", 2) == [0, 0], _log(folder / "log")
        runs[strategy] = folder
    # global_batch is over every process: 8 sequences a step on two is micro-batch 2 × accumulation 2 on each
    (tmp_path / "global").mkdir()
    config = tiny_run(tmp_path / "global", **plain, global_batch=8, grad_accum=None)
    assert server.run_ranks(["train", str(config)], tmp_path / "global" / "log", 2) == [0, 0]
    start = next(json.loads(line) for line in (tmp_path / "global" / "out" / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line).get("event") == "start")
    assert (start["micro_batch"], start["grad_accum"], start["processes"]) == (2, 2, 2)

    def lines(folder: Path) -> list[dict]:
        return [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "train"]

    expected = lines(runs["one"])
    assert [r["tokens"] for r in lines(tmp_path / "global")] == [r["tokens"] for r in expected]
    weights = load(adapter_bytes(runs["one"] / "out"))
    for strategy in STRATEGIES:
        got = lines(runs[strategy])
        assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
        theirs = load(adapter_bytes(runs[strategy] / "out"))
        assert theirs.keys() == weights.keys()
        for name, tensor in weights.items():
            torch.testing.assert_close(theirs[name], tensor, rtol=1e-4, atol=1e-6)


def test_train_gpus_starts_its_own_workers(tmp_path: Path) -> None:
    """`tunecast train --gpus 2` as a user runs it: two worker processes, one JSON document, exit 0."""
    config = tiny_run(tmp_path, max_steps=2, **NO_EVAL)
    script = Path(sys.executable).with_name("tunecast")
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([str(script), "train", str(config), "--gpus", "2", "--json"], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(done.stdout)
    assert document["finished"] and document["processes"] == 2 and document["steps"] == 2
    assert "starting 2 worker processes" in done.stderr
    meta = json.loads((tmp_path / "out" / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert meta["world_size"] == 2


def test_under_torchrun_a_stopped_run_leaves_its_mark_and_accelerate_launch_resumes_it(tmp_path: Path) -> None:
    """torchrun's own exit status is 1 whatever its workers said; the workers' 75 reaches the file
    TUNECAST_EXIT_FILE names (what the exported SkyPilot script reads). accelerate launch then resumes the run
    (on this CPU machine its launcher starts one process: several CPU processes need MPI there; on GPUs its
    multi-GPU launcher is torchrun, whose variables the test above uses)."""
    from tunecast.launch.local import free_port

    config = tiny_run(tmp_path)
    output = tmp_path / "out"
    marker = tmp_path / "exit-mark"
    env = {**os.environ, "TUNECAST_EXIT_FILE": str(marker)}
    log = (tmp_path / "torchrun.txt").open("w")
    torchrun = subprocess.Popen([str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2",
                                 f"--master_port={free_port()}", "-m", "tunecast", "train", str(config)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while _train_lines(output) < 3:
        assert torchrun.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.txt").read_text()[-3000:]
        time.sleep(0.1)
    torchrun.send_signal(signal.SIGTERM)
    assert torchrun.wait(timeout=60) != 0
    log.close()
    assert marker.read_text().strip() == "75", (tmp_path / "torchrun.txt").read_text()[-3000:]
    env.pop("TUNECAST_EXIT_FILE")
    done = subprocess.run([str(Path(sys.executable).with_name("accelerate")), "launch", "--num_processes", "1",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m",
                           "tunecast", "train", str(config)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from checkpoint" in " ".join(done.stderr.split())
    assert sorted(train_losses(output)) == list(range(1, 17))


def test_one_launched_process_runs_fsdp2(server: ForkServer, tmp_path: Path) -> None:
    """A launcher's only process (torchrun --nproc_per_node 1) joins a process group of one and shards with FSDP2:
    the smoke test of the strategy on a single device."""
    config = tiny_run(tmp_path, max_steps=4, **{"gpus.strategy": "fsdp"}, **NO_EVAL)
    assert server.run_ranks(["train", str(config)], tmp_path / "log", 1) == [0], _log(tmp_path / "log", 1)
    text = " ".join(Path(f"{tmp_path / 'log'}.rank0").read_text().split())
    assert "× 1 process (FSDP2 full shard)" in text
    manifest = json.loads((tmp_path / "out" / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and "state/__0_0.distcp" in manifest["files"]


@pytest.mark.parametrize(("method", "strategy"), [("full", "fsdp"), ("full", "ddp"), ("qlora", "ddp")])
def test_every_method_trains_on_two_processes(server: ForkServer, tmp_path: Path, method: str, strategy: str) -> None:
    config = tiny_run(tmp_path, method=method, max_steps=2, **{"gpus.strategy": strategy}, **NO_EVAL)
    assert server.run_ranks(["train", str(config)], tmp_path / "log", 2) == [0, 0], _log(tmp_path / "log")
    final = tmp_path / "out" / "final"
    assert (final / ("model.safetensors" if method == "full" else "adapter_model.safetensors")).exists()
    losses = train_losses(tmp_path / "out")
    assert sorted(losses) == [1, 2] and all(loss == loss for loss in losses.values())


def test_qlora_cannot_be_sharded(server: ForkServer, tmp_path: Path) -> None:
    config = tiny_run(tmp_path, method="qlora", max_steps=2, **{"gpus.strategy": "fsdp"}, **NO_EVAL)
    assert server.run_ranks(["train", str(config)], tmp_path / "log", 2) == [2, 2]
    rank0 = " ".join(Path(f"{tmp_path / 'log'}.rank0").read_text().split())
    assert "gpus.strategy" in rank0 and "ddp" in rank0
    assert Path(f"{tmp_path / 'log'}.rank1").read_text().strip() == ""  # rank 0 reports for the run
