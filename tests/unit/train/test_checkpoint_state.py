"""What a checkpoint's state holds (train/state.py): the weights that train and the optimizer, by name, through
torch.distributed.checkpoint in one process; restored bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tunecast.train.state import STATE, Progress, _state, capture_rng, checkpoint_files, restore


class _Optimizer:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.optimizers = [torch.optim.AdamW(params, lr=1e-2)]


def _model() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    return get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear"))


def test_only_what_trains_is_saved_even_a_tied_head_is_not() -> None:
    model = _model()
    saved = _state(model, None)["model"]
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == trains and not any("lm_head" in name or "embed" in name for name in saved)


def test_a_checkpoint_restores_weights_and_optimizer_bit_for_bit(tmp_path: Path) -> None:
    model = _model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = _Optimizer(trainable)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.optimizers[0].step()
    files = checkpoint_files(tmp_path / "scratch", rank=0, model=model, optimizer=optimizer, schedule={}, scaler=None,
                             rng=capture_rng(), progress=Progress(step=1), config_yaml="")
    assert any(name.startswith(f"{STATE}/") for name in files)
    expected = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    moments = {name: state["exp_avg"].clone() for name, state in zip(
        [n for n, p in model.named_parameters() if p.requires_grad], optimizer.optimizers[0].state.values(),
        strict=True)}

    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            if p.requires_grad:
                p.add_(1.0)
    fresh_optimizer = _Optimizer([p for p in fresh.parameters() if p.requires_grad])

    def read(name: str) -> bytes:
        value = files[name]
        return value.read_bytes() if isinstance(value, Path) else value

    restored = restore(read, tmp_path / "scratch" / STATE, {"world_size": 1, "optimizer_state": True}, rank=0,
                       world_size=1, model=fresh, optimizer=fresh_optimizer, scaler=None, seed=0)
    assert restored.progress.step == 1 and restored.rng_restored
    for name, p in fresh.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), expected[name]), name
    names = [n for n, p in fresh.named_parameters() if p.requires_grad]
    for name, state in zip(names, fresh_optimizer.optimizers[0].state.values(), strict=True):
        assert torch.equal(state["exp_avg"], moments[name]), name
