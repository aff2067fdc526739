"""The launcher's status rules and rank variables, the SkyPilot task (read back by SkyPilot's own parser), the
accelerate config, and the dealing of a step's micro-batches to ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from tests.trainruns import REPO

from tunecast.cli.export_cmds import block_yaml
from tunecast.config.spec import RunSpec
from tunecast.errors import TunecastError
from tunecast.launch.accelerate import accelerate_config, contradiction
from tunecast.launch.local import Ended, combined_status, rank_env
from tunecast.launch.skypilot import ACCELERATORS, Target, accelerator, split_count, task
from tunecast.train.batches import Unit, rank_passes


@pytest.mark.parametrize(("codes", "status"), [
    ([0, 0], 0),
    ([75, 75], 75),
    ([0, 75], 75),  # one finished its last step as the other was stopped: resume (the run is not done)
    ([75, -signal.SIGKILL], 128 + signal.SIGKILL),  # a rank killed: its status, not "resume me"
    ([1, 75], 1),
    ([75, 2, 1], 2),  # the first failure in rank order
])
def test_the_run_status_is_the_first_failure_else_75_else_0(codes: list[int], status: int) -> None:
    assert combined_status([Ended(rank, code) for rank, code in enumerate(codes)]) == status


def test_each_worker_gets_torchruns_variables_and_a_share_of_the_cores() -> None:
    env = rank_env(1, 4, 29555, {"PATH": "/bin"})
    assert {k: env[k] for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT")} == {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1",
                                                    "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                                                    "MASTER_PORT": "29555"}
    assert int(env["OMP_NUM_THREADS"]) >= 1 and env["PATH"] == "/bin"
    assert rank_env(0, 2, 1, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"  # the user's setting stands


@pytest.mark.parametrize(("micro", "world"), [(7, 2), (8, 2), (1, 2), (5, 3), (4, 1), (9, 4)])
def test_every_micro_batch_of_a_step_goes_to_exactly_one_rank(micro: int, world: int) -> None:
    chunks = [[Unit([k], [k], None)] for k in range(micro)]
    shares = [rank_passes(chunks, rank=rank, world=world) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1, "every rank runs as many passes"
    dealt = [chunk[0].input_ids[0] for share in shares for chunk in share if chunk is not None]
    assert sorted(dealt) == list(range(micro))
    assert rank_passes(chunks, rank=0, world=1) == chunks  # one process: all of them, in order


def test_gpus_split_into_nodes_of_eight() -> None:
    assert split_count(8, None) == (8, 1)
    assert split_count(16, None) == (8, 2)
    assert split_count(4, 2) == (2, 2)
    with pytest.raises(TunecastError) as caught:
        split_count(6, 4)
    assert caught.value.field == "--nodes"


def _spec(tmp_path: Path, **changes: object) -> RunSpec:
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    return RunSpec.model_validate({"model": "meta-llama/Llama-3.1-8B", "method": "lora",
                                   "dataset": {"path": str(data)}, "output": "s3://bucket/runs/x", **changes})


class _Model:
    origin = "catalog"
    path = Path("/nowhere")


# SkyPilot's parser, run in SkyPilot's own environment (the Makefile's .venv-sky: SkyPilot pins click below what
# huggingface_hub needs, so it cannot share tunecast's); it prints what it read as JSON.
SKY_PYTHON = Path(os.environ.get("TUNECAST_SKYPILOT_PYTHON", str(REPO / ".venv-sky" / "bin" / "python")))
READ_TASK = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
(resources,) = list(task.resources)
print(json.dumps({"num_nodes": task.num_nodes, "accelerators": resources.accelerators,
                  "use_spot": resources.use_spot, "job_recovery": resources.job_recovery,
                  "storage_mounts": sorted(task.storage_mounts), "file_mounts": task.file_mounts,
                  "run": task.run, "setup": task.setup}))
"""


def test_the_skypilot_task_reads_back_through_skypilots_parser(tmp_path: Path) -> None:
    if not SKY_PYTHON.exists():
        pytest.fail(f"SkyPilot's environment is missing ({SKY_PYTHON}): `make test` creates it")
    document = task(_spec(tmp_path), _Model(), Target("a100-80gb", 8, 2, spot=True), strategy="fsdp")
    path = tmp_path / "task.yaml"
    path.write_text(block_yaml(document))
    done = subprocess.run([str(SKY_PYTHON), "-c", READ_TASK, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed["num_nodes"] == 2
    assert parsed["accelerators"] == {"A100-80GB": 8} and parsed["use_spot"]
    assert parsed["job_recovery"]["recover_on_exit_codes"] == [75]
    assert parsed["storage_mounts"] == ["/tunecast-store"]
    assert parsed["file_mounts"] == {"/tunecast/data/train.jsonl": str(tmp_path / "train.jsonl")}
    run = parsed["run"]
    for variable in ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_TASK_ID"):
        assert variable in run
    assert "torchrun" in run and "-m tunecast train /tunecast/run.yaml" in run
    assert "output=/tunecast-store/runs/$SKYPILOT_TASK_ID" in run
    assert "exit 75" in run and "pip install" in parsed["setup"]
    config = run.split("<<'TUNECAST_CONFIG'\n", 1)[1].split("\nTUNECAST_CONFIG", 1)[0]
    trained = RunSpec.model_validate(yaml.safe_load(config))  # the config the nodes train is a valid one
    assert (trained.gpus.count, trained.gpus.strategy, trained.dataset.path) == (16, "fsdp",
                                                                                  "/tunecast/data/train.jsonl")


def test_a_skypilot_run_needs_a_bucket(tmp_path: Path) -> None:
    with pytest.raises(TunecastError) as caught:
        task(_spec(tmp_path, output="/local/runs"), _Model(), Target("h100-sxm", 8, 1, False), strategy="ddp")
    assert caught.value.field == "output"
    document = task(_spec(tmp_path, output="/local/runs"), _Model(), Target("h100-sxm", 8, 1, False),
                    strategy="ddp", bucket="gs://mine/tunecast")
    assert document["file_mounts"]["/tunecast-store"] == {"source": "gs://mine/tunecast", "mode": "MOUNT"}


def test_every_catalog_gpu_has_a_skypilot_name() -> None:
    from tunecast.catalog.store import load_catalog

    assert {gpu.slug for gpu in load_catalog(None).gpus} <= set(ACCELERATORS)
    assert accelerator("h100-sxm") == "H100"
    with pytest.raises(TunecastError):
        accelerator("no-such-gpu")


def test_accelerate_config_says_the_strategy(tmp_path: Path) -> None:
    ddp = accelerate_config(_spec(tmp_path), gpus_per_node=4, nodes=1)
    assert (ddp["distributed_type"], ddp["num_processes"], ddp["num_machines"]) == ("MULTI_GPU", 4, 1)
    assert "fsdp_config" not in ddp
    fsdp = accelerate_config(_spec(tmp_path, gpus={"strategy": "fsdp-grad-op"}), gpus_per_node=8, nodes=2)
    assert fsdp["distributed_type"] == "FSDP" and fsdp["num_processes"] == 16
    assert fsdp["fsdp_config"]["fsdp_version"] == 2 and fsdp["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert accelerate_config(_spec(tmp_path), gpus_per_node=2, nodes=1, on_cpu=True)["distributed_type"] == "MULTI_CPU"
    assert contradiction("ddp", {"ACCELERATE_USE_FSDP": "true"})
    assert contradiction("fsdp", {"ACCELERATE_USE_FSDP": "true"}) is None
    assert contradiction("ddp", {}) is None
