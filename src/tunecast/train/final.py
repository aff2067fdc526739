"""`final/`: what a finished run leaves for people and tools — the trained adapter (or the full model) in the
layout `PeftModel.from_pretrained` / `from_pretrained` loads, the tokenizer, and a short model card.

It is written like a checkpoint (files first, manifest last), so a run killed while writing it resumes at
its last step and writes it again, and a `final/` with a valid manifest means the run is done.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from tunecast.config.load import LoadedSpec
from tunecast.storage.store import Storage, write_set
from tunecast.train.batches import TrainData
from tunecast.train.loop import Session
from tunecast.train.model import BASE_SAVED, folder_files, save_tokenizer
from tunecast.train.run import FINAL
from tunecast.units import SECONDS_PER_HOUR


def base_reference(loaded: LoadedSpec, storage: Storage) -> str:
    """What the adapter's `base_model_name_or_path` names: the run's saved base (random weights), the model
    directory, or the Hub id."""
    if storage.exists(BASE_SAVED):
        return storage.url_of(BASE_SAVED)
    if loaded.model.origin == "directory":
        return str(loaded.model.path.parent)
    return loaded.model.name


def write_final(session: Session[TrainData], storage: Storage, loaded: LoadedSpec) -> None:
    """Every rank calls it: under FSDP2 the whole weights are gathered from the shards first; rank 0 writes."""
    engine = session.engine
    model = engine.unwrap(session.model)
    spec = session.spec
    state = None
    if engine.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=spec.method != "full"))
    if engine.world.main:
        with tempfile.TemporaryDirectory(prefix="tunecast-final-") as temporary:
            folder = Path(temporary)
            if spec.method != "full":
                for config in model.peft_config.values():
                    config.base_model_name_or_path = base_reference(loaded, storage)
            model.save_pretrained(str(folder), **({"state_dict": state} if state is not None else {}))
            save_tokenizer(session.tokenizer, folder)
            (folder / "README.md").write_text(model_card(session, loaded, base_reference(loaded, storage)))
            write_set(storage, FINAL, folder_files(folder), {"kind": "final", "step": session.progress.step,
                                                             "schedule_steps": session.schedule_steps})
    engine.barrier()


def model_card(session: Session[TrainData], loaded: LoadedSpec, base: str) -> str:
    spec, progress, data = session.spec, session.progress, session.data
    what = "a full fine-tune" if spec.method == "full" else (
        f"a {'QLoRA' if spec.method == 'qlora' else 'LoRA'} adapter (rank {spec.lora.rank}, alpha {spec.lora.alpha}, "
        f"targets {spec.lora.targets if isinstance(spec.lora.targets, str) else ', '.join(spec.lora.targets)})")
    load = ("```python\nfrom transformers import AutoModelForCausalLM\n"
            f"model = AutoModelForCausalLM.from_pretrained({'FINAL_DIR'!r})\n```") if spec.method == "full" else (
        "```python\nfrom peft import AutoPeftModelForCausalLM\n"
        f"model = AutoPeftModelForCausalLM.from_pretrained({'FINAL_DIR'!r})  # base: {base}\n```")
    lines: list[Any] = [
        f"# {loaded.model.name} — {spec.method} fine-tune by tunecast",
        "",
        f"{what[0].upper()}{what[1:]} of `{loaded.model.name}` (base: `{base}`).",
        "",
        "| | |", "|---|---|",
        f"| precision, optimizer | {spec.precision}, {spec.optimizer} (learning rate {spec.learning_rate:g}, "
        f"{spec.schedule}, {session.warmup_steps} warm-up steps) |",
        f"| batch | micro-batch {session.micro_batch} × accumulation {session.grad_accum}"
        f"{f' × {session.engine.world.size} processes' if session.engine.world.size > 1 else ''} × "
        f"{spec.seq_len} tokens |",
        f"| data | `{spec.dataset.path}`: {data.examples:,} training examples, {data.eval_examples} held out; "
        f"{data.detection} |",
        f"| trained | {progress.step:,} optimizer steps, {progress.tokens:,} tokens "
        f"({progress.trained_tokens:,} in the loss) |",
        f"| time, cost | {progress.elapsed_s / SECONDS_PER_HOUR:.3f} hours, ${progress.cost_usd:,.2f} at "
        f"${session.usd_per_hour:g}/h |",
        f"| seed | {spec.seed} |",
        "",
        "Load it (FINAL_DIR is this folder):",
        "",
        load,
        "",
        "The run's `config.yaml` and `metrics.jsonl` sit beside this folder.",
        "",
    ]
    return "\n".join(str(line) for line in lines)
