"""A DeepSpeed JSON, as axolotl, LLaMA-Factory and TRL configs name it: its stage, offload and buffers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.unit.runners.helpers import checked

from tunecast.config.spec import RunSpec
from tunecast.runners import axolotl, llamafactory
from tunecast.runners.export import deepspeed_document, to_axolotl, to_llamafactory


def _axolotl_with(tmp_path: Path, deepspeed: dict) -> RunSpec:
    (tmp_path / "ds.json").write_text(json.dumps(deepspeed), encoding="utf-8")
    config = tmp_path / "run.yml"
    config.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nsequence_len: 2048\nmicro_batch_size: 1\n"
                      "deepspeed: ds.json\n", encoding="utf-8")
    return checked(axolotl.read(config))


@pytest.mark.parametrize(("zero", "strategy", "offload"), [
    ({"stage": 1}, "zero1", "none"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "zero2", "optimizer"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "zero3", "params"),
    ({"stage": 0}, "ddp", "none"),
])
def test_the_stage_and_offload(tmp_path: Path, zero: dict, strategy: str, offload: str) -> None:
    spec = _axolotl_with(tmp_path, {"zero_optimization": zero, "bf16": {"enabled": "auto"}})
    assert (spec.gpus.strategy, spec.gpus.offload) == (strategy, offload)


def test_the_buffers_auto_kept(tmp_path: Path) -> None:
    spec = _axolotl_with(tmp_path, {"zero_optimization": {
        "stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 0}})
    settings = spec.gpus.deepspeed
    assert (settings.reduce_bucket_size, settings.overlap_comm) == ("auto", True)
    assert (settings.stage3_prefetch_bucket_size, settings.stage3_param_persistence_threshold) == (50_000_000, 0)


@pytest.mark.parametrize("offload", ["none", "optimizer", "params"])
def test_exported_configs_carry_the_deepspeed_settings_back(tmp_path: Path, offload: str) -> None:
    spec = RunSpec.model_validate({
        "model": "meta-llama/Llama-3.1-8B", "method": "full", "runner": "axolotl",
        "gpus": {"count": 8, "strategy": "zero3", "offload": offload,
                 "deepspeed": {"reduce_bucket_size": "auto", "stage3_param_persistence_threshold": 0}}})
    assert deepspeed_document(spec)["zero_optimization"]["stage"] == 3
    for tool, export in ((axolotl, to_axolotl), (llamafactory, to_llamafactory)):
        path = tmp_path / f"{tool.__name__.rpartition('.')[2]}.yml"
        path.write_text(json.dumps(export(spec)), encoding="utf-8")  # JSON is YAML
        back = checked(tool.read(path))
        assert (back.gpus.strategy, back.gpus.offload) == ("zero3", offload)
        assert back.gpus.deepspeed == spec.gpus.deepspeed
