"""The tools' own published example configs (tests/data/runners/published/README.md): every key accounted for, and
each run either read into a config that passes the checks `tunecast plan --from` makes (offline: no Hub, no trace),
or refused in one line naming the key. benchmarks/published_configs.py times the whole commands over the same files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.unit.runners.helpers import DATA, checked, reason

from tunecast.catalog.hub import HubAccess
from tunecast.catalog.store import Catalog
from tunecast.config.imported import Imported
from tunecast.config.load import LoadedSpec, load_spec
from tunecast.errors import TunecastError
from tunecast.runners import axolotl, torchtune
from tunecast.runners.imported import read_config

PUBLISHED = DATA / "published"
FILES = sorted(p.relative_to(PUBLISHED).as_posix() for p in PUBLISHED.rglob("*.y*ml"))

# Refused today: (the key the refusal names, text of its one line). A run of a stage that is not supervised
# fine-tuning, or of a multimodal model, may be refused; the last rows are supervised fine-tuning that the readers or
# the catalog cannot estimate yet (docs/benchmarks/published-configs.md lists every outcome).
REFUSED = {
    # stages that are not supervised fine-tuning
    "llamafactory/qwen3_lora_dpo.yaml": ("stage", "stage 'dpo'"),
    "llamafactory/qwen3_lora_kto.yaml": ("stage", "stage 'kto'"),
    "llamafactory/qwen3_lora_reward.yaml": ("stage", "stage 'rm'"),
    "llamafactory/v1/train_lora_dpo.yaml": ("train_dataset", "dataset 'dpo_zh_demo' holds chosen and rejected"),
    "axolotl/instruct-dpo-lora-8b.yml": ("rl", "rl 'dpo' trains by DPO"),
    "axolotl/qlora-1b-kto.yaml": ("rl", "rl 'kto' trains by KTO"),
    "axolotl/qwen2/reward-model.yaml": ("reward_model", "reward_model: true trains a reward model"),
    "torchtune/8B_lora_dpo_single_device.yaml": ("loss._component_", "trains by DPO"),
    "torchtune/llama3_2/8B_to_1B_KD_lora_single_device.yaml": ("teacher_model", "knowledge distillation"),
    "torchtune/mistral/7B_full_ppo_low_memory.yaml": ("policy_model", "policy_model is the policy of PPO"),
    "trl/zephyr-7b-beta/dpo_config_qlora.yaml": ("beta", "beta is a key of TRL's DPOConfig"),
    # multimodal models: axolotl's by its processor_type; offline, the other Trainer-based tools' only as models outside
    # the catalog
    "axolotl/gemma3/gemma-3-4b-vision-qlora.yml": ("processor_type", "processor_type 'AutoProcessor' trains a "
                                                                     "multimodal model"),
    "axolotl/qwen2_5-vl/lora-7b.yaml": ("processor_type", "processor_type 'AutoProcessor' trains a multimodal model"),
    "llamafactory/qwen3vl_lora_sft.yaml": ("model", "unknown model 'Qwen/Qwen3-VL-4B-Instruct'"),
    "llamafactory/v1/train_multimodal.yaml": ("model", "unknown model 'Qwen/Qwen3.5-0.8B'"),
    "torchtune/llama3_2_vision/11B_lora_single_device.yaml": ("model._component_", "is not one tunecast maps"),
    # supervised fine-tuning not estimated yet
    "llamafactory/llama3_lora_sft_awq.yaml": ("model", "AWQ checkpoint by its name"),  # pre-quantized weights
}
SFT_NOT_ESTIMATED = ["llamafactory/llama3_lora_sft_awq.yaml"]

# Files of the source repository a published config opens from where the tool runs (its repository root), which this
# corpus does not copy: for these the config is read at its path in the source repository, beside copies of them
# (tests/data/runners/llamafactory/v1/README.md: the same commit's data/v1_dpo_demo.yaml).
SOURCE_FILES = {
    "llamafactory/v1/train_lora_dpo.yaml": {"data/v1_dpo_demo.yaml": DATA / "llamafactory" / "v1" / "data" /
                                            "v1_dpo_demo.yaml"},
}

# Keys of files read today that the readers list as "not a key of the tool's documented config (misspelt?)" though
# the tool reads them: none now. Add an entry when a new file has one, and empty it when the reader learns the key.
# (axolotl/mixtral/mixtral.yml is read and estimated: its lora_dropout applies to the Linear layers' adapters only,
# tests/unit/train/test_training.py test_lora_dropout_on_an_moe_model_applies_where_peft_can_apply_it.)
UNKNOWN_KEYS: dict[str, list[str]] = {}

READ = [name for name in FILES if name not in REFUSED]


def _tool(name: str) -> str:
    return name.split("/")[0]


def _sources(column: int = 1) -> dict[str, str]:
    """The README's table: each file with what it trains (`| file | trains | repository | path | commit | …`), or
    another column."""
    rows = {}
    for line in (PUBLISHED / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].endswith((".yml", ".yaml")):
            rows[cells[0]] = cells[column]
    return rows


def _placed(name: str, root: Path) -> Path:
    """The published file to read: itself, or, for one in SOURCE_FILES, a copy at its path in the source repository
    under `root`, with the repository files it opens."""
    if name not in SOURCE_FILES:
        return PUBLISHED / name
    config = root / _sources(column=3)[name]
    config.parent.mkdir(parents=True)
    shutil.copyfile(PUBLISHED / name, config)
    for path, copy in SOURCE_FILES[name].items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(copy, root / path)
    return config


def _loaded(imported: Imported, catalog: Catalog) -> LoadedSpec:
    """The checks `tunecast plan --from` makes before estimating: the config validated, its model resolved offline."""
    return load_spec(None, [], catalog, hub=HubAccess(offline=True), imported=imported)


def test_every_file_has_its_source() -> None:
    assert sorted(_sources()) == FILES
    assert set(REFUSED) <= set(FILES)
    assert set(SOURCE_FILES) <= set(REFUSED) and all(copy.is_file() for files in SOURCE_FILES.values()
                                                     for copy in files.values())


def test_a_file_opened_from_the_repository_root_is_not_beside_the_published_copy(catalog: Catalog) -> None:
    """Without its repository around it, train_lora_dpo.yaml's dataset list is nowhere: read, the list unread."""
    imported = read_config("llamafactory", PUBLISHED / "llamafactory" / "v1" / "train_lora_dpo.yaml")
    assert "not a local dataset list" in reason(imported, "train_dataset")


@pytest.mark.parametrize("name", READ)
def test_read_into_a_valid_config(name: str, catalog: Catalog) -> None:
    imported = read_config(_tool(name), PUBLISHED / name)
    spec = checked(imported)
    assert spec.runner == _tool(name)
    assert [item.key for item in imported.unmapped if "misspelt" in item.reason] == UNKNOWN_KEYS.get(name, [])
    assert _loaded(imported, catalog).spec.model == spec.model


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_in_one_line_naming_the_key(name: str, catalog: Catalog, tmp_path: Path) -> None:
    key, text = REFUSED[name]
    path = _placed(name, tmp_path)
    with pytest.raises(TunecastError) as refused:
        _loaded(read_config(_tool(name), path), catalog)
    errors = [problem for problem in refused.value.problems if problem.severity == "error"]
    assert [problem.field for problem in errors] == [key]
    assert text in errors[0].message and "\n" not in errors[0].message


def test_refusals_kept_to_other_stages_and_multimodal_models() -> None:
    """Each refusal is of a stage that is not supervised fine-tuning or of a multimodal model, but for the supervised
    fine-tuning still to be estimated; every file read is of supervised fine-tuning or pre-training."""
    trains = _sources()
    assert sorted(name for name in REFUSED if trains[name] in ("sft", "pt")) == SFT_NOT_ESTIMATED
    assert all(trains[name] in ("sft", "pt") for name in READ)
    assert set(UNKNOWN_KEYS) <= set(READ)


def test_published_qlora_values() -> None:
    spec = checked(axolotl.read(PUBLISHED / "axolotl" / "qlora.yml"))
    assert (spec.method, spec.lora.rank, spec.lora.alpha, spec.seq_len, spec.packing) == ("qlora", 32, 16, 4096, True)
    assert (spec.optimizer, spec.micro_batch, spec.grad_accum, spec.attention) == ("paged-adamw", 2, 4, "flash")


def test_published_torchtune_full_recipe() -> None:
    spec = checked(torchtune.read(PUBLISHED / "torchtune" / "8B_full_single_device.yaml"))
    assert (spec.model, spec.optimizer, spec.optimizer_in_backward, spec.precision) == \
        ("meta-llama/Llama-3.1-8B", "paged-adamw-8bit", True, "bf16")



def test_published_keys_the_readers_learnt() -> None:
    """TRL's torch_dtype (the alignment-handbook writes ModelConfig's old name of dtype) loads bf16 weights; axolotl's
    tensor and context parallelism are named as not modelled, the estimate per GPU high."""
    imported = read_config("trl", PUBLISHED / "trl" / "zephyr-7b-beta" / "sft_config_full.yaml")
    assert (checked(imported).precision, imported.mapped["torch_dtype"]) == ("bf16", ("precision",))
    imported = read_config("axolotl", PUBLISHED / "axolotl" / "distributed-parallel" / "qwen3-8b-fsdp-tp-cp.yaml")
    checked(imported)
    for key in ("tensor_parallel_size", "context_parallel_size"):
        assert "estimate per GPU runs high" in reason(imported, key)
    assert "2 × context_parallel_size GPUs" in reason(imported, "dp_shard_size")


def test_published_phi3_lora_targets_the_fused_modules() -> None:
    """torchtune's Phi-3 splits qkv_proj and gate_up_proj; the Hugging Face model the estimate builds keeps them."""
    spec = checked(torchtune.read(PUBLISHED / "torchtune" / "phi3" / "mini_lora_single_device.yaml"))
    assert (spec.model, spec.lora.targets) == ("microsoft/Phi-3-mini-4k-instruct",
                                               ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])


def test_a_run_whose_data_cannot_be_counted_is_planned_per_million_tokens(catalog: Catalog) -> None:
    """axolotl's QLoRA example names a Hub dataset: offline its size is unknown, so the plan's workload is a million
    tokens in full-length sequences (the ranking is the whole run's; the hours and costs are per those tokens), said
    in words; with max_steps alone the run's own steps are planned."""
    from tunecast.plan.workload import UNSIZED_TOKENS, workload_for

    imported = read_config("axolotl", PUBLISHED / "axolotl" / "qlora.yml")
    loaded = _loaded(imported, catalog)
    workload = workload_for(loaded, catalog)
    seq = loaded.spec.seq_len
    assert workload.unsized is not None and "axolotl `datasets`" in workload.unsized
    assert workload.processed_tokens == -(-UNSIZED_TOKENS // seq) * seq
    assert workload.tokens_per_sequence(2) == seq and not workload.as_dict()["size_known"]
    by_steps = {key: value for key, value in imported.config.items() if key != "epochs"} | {"max_steps": 30}
    stepped = load_spec(None, [], catalog, hub=HubAccess(offline=True),
                        imported=imported.__class__(**{**imported.__dict__, "config": by_steps}))
    steps = workload_for(stepped, catalog)
    assert steps.length(stepped.spec.sequences_per_step, steps.max_steps).steps == 30
    assert steps.processed_tokens == 30 * stepped.spec.sequences_per_step * seq
