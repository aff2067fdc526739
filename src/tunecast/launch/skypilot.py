"""`tunecast export skypilot`: a SkyPilot task that runs this training on 1–K nodes, on spot capacity if asked,
and recovers from preemptions by resuming the same run.

What the task holds, and why:

* `resources.accelerators` in SkyPilot's form (`A100-80GB:8`: the GPUs of one node) and `num_nodes`;
* `use_spot` and `job_recovery`: on a preemption SkyPilot's managed jobs relaunch the task elsewhere
  (`strategy`), and `recover_on_exit_codes: [75]` relaunches it too when tunecast itself stopped on a
  preemption notice (SIGTERM before the machine goes) — the status tunecast exits with, "run the same
  command again";
* the checkpoint store: the run's bucket mounted at STORE (`file_mounts`, mode MOUNT), and the output of the
  run at `STORE/runs/$SKYPILOT_TASK_ID`. A managed job keeps its task id over every recovery, so each
  relaunch finds the run's checkpoints and resumes it;
* the config, written by the run script itself (the user's settings with the target's GPU count and
  strategy), and a local dataset file or model folder, uploaded by `file_mounts`;
* `setup`: install tunecast; `run`: torchrun across the nodes from SkyPilot's variables
  (`SKYPILOT_NODE_RANK`, `SKYPILOT_NODE_IPS`, `SKYPILOT_NUM_NODES`, `SKYPILOT_NUM_GPUS_PER_NODE`), each worker
  `tunecast train`. torchrun exits 1 whatever its workers' statuses, so each worker that stops for a
  preemption leaves a mark (`TUNECAST_EXIT_FILE`) and the script exits 75 when it finds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from tunecast.config.spec import DEEPSPEED_STRATEGIES, FSDP_EQUIVALENT, RunSpec
from tunecast.errors import TunecastError
from tunecast.plan.cost import GPUS_PER_NODE
from tunecast.train.signals import EXIT_PREEMPTED
from tunecast.version import __version__

STORE = "/tunecast-store"
CONFIG_AT = "/tunecast/run.yaml"
DATA_AT = "/tunecast/data"
MODEL_AT = "/tunecast/model"
MASTER_PORT = 29500
BUCKET_SCHEMES = ("s3://", "gs://", "r2://", "cos://", "oci://", "https://")  # SkyPilot storage sources
# SkyPilot's accelerator names for the catalog's GPUs (the `AcceleratorName` of its catalogs; RunPod calls its
# PCIe H100 `H100`, which tunecast's importer maps apart — see catalog/skypilot.py).
ACCELERATORS = {
    "rtx-3090": "RTX3090", "rtx-4080": "RTX4080", "rtx-4090": "RTX4090", "rtx-5090": "RTX5090",
    "rtx-a5000": "RTXA5000", "rtx-a6000": "RTXA6000", "rtx-6000-ada": "RTX6000-Ada", "rtx-pro-6000": "RTXPRO6000",
    "l4": "L4", "l40s": "L40S", "a10g": "A10G", "a40": "A40", "a100-40gb": "A100", "a100-80gb": "A100-80GB",
    "a100-80gb-pcie": "A100-80GB", "h100-sxm": "H100", "h100-pcie": "H100", "h100-nvl": "H100-NVL",
    "h200": "H200", "gh200": "GH200", "b200": "B200", "mi300x": "MI300X",
}


@dataclass(frozen=True)
class Target:
    """Where the run goes: a GPU, how many per node, how many nodes, spot or not."""

    gpu: str  # catalog slug
    gpus_per_node: int
    nodes: int
    spot: bool


def accelerator(slug: str) -> str:
    name = ACCELERATORS.get(slug)
    if name is None:
        raise TunecastError(f"no SkyPilot accelerator name is known for {slug}", field="--gpu",
                            hint="choose one of: " + ", ".join(sorted(ACCELERATORS)))
    return name


def split_count(total: int, nodes: int | None) -> tuple[int, int]:
    """(GPUs per node, nodes) for `total` GPUs: one node up to eight, else nodes of eight."""
    if nodes is None:
        nodes = 1 if total <= GPUS_PER_NODE else -(-total // GPUS_PER_NODE)
    if total % nodes:
        raise TunecastError(f"{total} GPUs do not split evenly over {nodes} nodes", field="--nodes",
                            hint="give a number of nodes that divides the GPU count (--gpus is the total)")
    return total // nodes, nodes


def _bucket(spec: RunSpec, bucket: str | None) -> str:
    source = bucket or (spec.output if spec.output and spec.output.startswith(BUCKET_SCHEMES) else None)
    if source is None:
        raise TunecastError("a SkyPilot run needs its checkpoints on storage that outlives the machines",
                            field="output", hint="set output to a bucket (s3://bucket/path, gs://…) or pass --bucket")
    if not source.startswith(BUCKET_SCHEMES):
        raise TunecastError(f"--bucket {source} is not a bucket URL", field="--bucket",
                            hint="give s3://bucket[/path], gs://bucket[/path] or r2://bucket[/path]")
    return source.rstrip("/")


def run_document(spec: RunSpec, model: Any, strategy: str, total_gpus: int) -> tuple[dict[str, Any],
                                                                                   dict[str, Any]]:
    """(the config the nodes train, the files they need uploaded): the user's settings, the strategy and GPU
    count of the target, and local files (dataset, model folder) at the paths they are uploaded to."""
    document = spec.model_dump(mode="json", exclude_unset=True)
    document.pop("output", None)  # set on the command line, under the task id
    document["gpus"] = {**document.get("gpus", {}), "count": total_gpus, "strategy": strategy}
    mounts: dict[str, Any] = {}
    dataset = spec.dataset.path
    if dataset is not None:  # a local file is uploaded, a bucket object copied to every node
        at = f"{DATA_AT}/{PurePosixPath(dataset).name}"
        mounts[at] = dataset
        document["dataset"] = {**document.get("dataset", {}), "path": at}
    if model.origin in ("directory", "file"):
        source = str(model.path.parent if model.origin == "directory" else model.path)
        at = MODEL_AT if model.origin == "directory" else f"{MODEL_AT}/{model.path.name}"
        mounts[at] = source
        document["model"] = at
    return document, mounts


def task(spec: RunSpec, model: Any, target: Target, *, strategy: str, bucket: str | None = None,
         name: str | None = None, recovery: str = "EAGER_NEXT_REGION", max_restarts_on_errors: int = 2
         ) -> dict[str, Any]:
    """The SkyPilot task (a YAML document) that trains `spec` on `target` with `strategy`."""
    import yaml

    if strategy in DEEPSPEED_STRATEGIES:
        raise TunecastError(f"{strategy} is DeepSpeed's, which tunecast train (what the task runs) does not run",
                            field="gpus.strategy", hint=f"set gpus.strategy to {FSDP_EQUIVALENT[strategy]}")

    store = _bucket(spec, bucket)
    document, uploads = run_document(spec, model, strategy, target.gpus_per_node * target.nodes)
    config_text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    extras = "qlora,s3" if spec.method == "qlora" else "s3"
    run = "\n".join([
        "set -u",
        f"mkdir -p {PurePosixPath(CONFIG_AT).parent}",
        f"cat > {CONFIG_AT} <<'TUNECAST_CONFIG'",
        config_text.rstrip("\n"),
        "TUNECAST_CONFIG",
        'export TUNECAST_EXIT_FILE="/tmp/tunecast-exit-$SKYPILOT_TASK_ID"',
        'rm -f "$TUNECAST_EXIT_FILE"',
        'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)',
        "torchrun --nnodes=$SKYPILOT_NUM_NODES --node_rank=$SKYPILOT_NODE_RANK "
        "--nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE --master_addr=$MASTER_ADDR "
        f"--master_port={MASTER_PORT} -m tunecast train {CONFIG_AT} "
        f'--set "output={STORE}/runs/$SKYPILOT_TASK_ID"',
        "status=$?",
        f'if [ -f "$TUNECAST_EXIT_FILE" ]; then exit {EXIT_PREEMPTED}; fi  # a worker stopped to be resumed',
        "exit $status",
    ]) + "\n"
    return {
        "name": name or f"tunecast-{_short(spec.model)}",
        "resources": {"accelerators": f"{accelerator(target.gpu)}:{target.gpus_per_node}", "use_spot": target.spot,
                      "job_recovery": {"strategy": recovery, "max_restarts_on_errors": max_restarts_on_errors,
                                       "recover_on_exit_codes": [EXIT_PREEMPTED]}},
        "num_nodes": target.nodes,
        "secrets": {"HF_TOKEN": None},  # gated models: `sky jobs launch --secret HF_TOKEN`
        "file_mounts": {STORE: {"source": store, "mode": "MOUNT"}, **uploads},
        "setup": f'pip install "tunecast[{extras}]=={__version__}"\n',
        "run": run,
    }


def _short(model: str) -> str:
    tail = model.rstrip("/").rsplit("/", 1)[-1].lower()
    cleaned = "".join(c if c.isalnum() else "-" for c in tail).strip("-")
    return cleaned[:40] or "run"
