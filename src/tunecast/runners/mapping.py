"""What the readers of other tools' configs (axolotl.py, llamafactory.py, trl.py, torchtune.py) share.

A reader walks the tool's keys and, for each, either sets tunecast keys (`Mapper.put`) or says why not
(`Mapper.skip`); `Mapper.finish` then accounts for every leaf key no handler took as unknown, so no key of the file
is dropped silently. The value tables here (optimizer and schedule names, peft's default targets) are the tools'
documented names, listed with their sources in docs/research/runners.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tunecast.config.imported import Imported, Unmapped
from tunecast.errors import TunecastError, suggestion_text

NO_EFFECT = "no effect on memory, time or cost"
LOGGING = "logging and reporting: " + NO_EFFECT
HUB = "tunecast reads local files only: a Hub dataset cannot be counted; set dataset.path, or dataset.examples and " \
      "dataset.mean_tokens"
SEVERAL = "several datasets: tunecast counts one file; set dataset.path to the combined file, or dataset.examples " \
          "and dataset.mean_tokens"
LAUNCH_COUNT = "the number of GPUs is chosen at launch (accelerate, torchrun), not in this file: give gpus.count " \
               "(--gpus) for a multi-GPU estimate"

# transformers' OptimizerNames (axolotl, LLaMA-Factory and TRL take these) → tunecast's optimizer.
HF_OPTIMIZERS = {
    "adamw_torch_fused": "adamw", "adamw_torch": "adamw-foreach", "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit", "paged_adamw_32bit": "paged-adamw", "paged_adamw_8bit": "paged-adamw-8bit",
    "sgd": "sgd", "adafactor": "adafactor",
}
# transformers' SchedulerType names that tunecast's `schedule` runs alike.
SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup")
# peft's target_modules for an architecture when none are given (peft src/peft/utils/constants.py), by the
# model-name families that share it.
_PEFT_DEFAULT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen/qwen2", "qwen/qwen3", "gemma-2", "gemma2")
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt")

Handler = Callable[["Mapper", str, Any], None]


class Mapper:
    """The tunecast config being built from one tool file, with the account of every key."""

    def __init__(self, tool: str, label: str, source: Path, tool_lines: Mapping[str, int]) -> None:
        self.tool = tool
        self.label = label
        self.source = source
        self.base_dir = source.parent.resolve()
        self.tool_lines = tool_lines
        self.config: dict[str, Any] = {"runner": tool}
        self.mapped: dict[str, tuple[str, ...]] = {}
        self.unmapped: dict[str, Unmapped] = {}
        self.lines: dict[str, int] = {}
        self.notes: list[str] = []
        self.values: dict[str, Any] = {}  # the tool's value of each key put, for a key taken back (`drop`)

    def put(self, tool_key: str, key: str, value: Any) -> None:
        """Set tunecast's dotted `key` from the tool's `tool_key`."""
        self.values[tool_key] = value
        self._set(key, value)
        self.mapped[tool_key] = (*(k for k in self.mapped.get(tool_key, ()) if k != key), key)
        self.unmapped.pop(tool_key, None)
        line = self.line(tool_key)
        if line is not None:
            self.lines[key] = line

    def skip(self, tool_key: str, value: Any, reason: str) -> None:
        """Record why `tool_key` set nothing; the first reason given stays."""
        if tool_key not in self.mapped and tool_key not in self.unmapped:
            self.unmapped[tool_key] = Unmapped(tool_key, value, reason)

    def drop(self, key: str, tool_key: str, reason: str) -> None:
        """Take back tunecast's `key` that `tool_key` set, and say why it is not carried over."""
        *sections, leaf = key.split(".")
        self._section(sections).pop(leaf, None)
        self.lines.pop(key, None)
        remaining = tuple(k for k in self.mapped.get(tool_key, ()) if k != key)
        if remaining:
            self.mapped[tool_key] = remaining
        else:
            self.mapped.pop(tool_key, None)
            self.unmapped[tool_key] = Unmapped(tool_key, self.values.get(tool_key), reason)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _section(self, sections: list[str]) -> dict[str, Any]:
        """The part of the config at the dotted path `sections` (empty where nothing was put there)."""
        place = self.config
        for section in sections:
            place = place.get(section, {})
        return place

    def has(self, key: str) -> bool:
        *sections, leaf = key.split(".")
        return leaf in self._section(sections)

    def get(self, key: str) -> Any:
        *sections, leaf = key.split(".")
        return self._section(sections).get(leaf)

    def default(self, key: str, value: Any) -> None:
        """The tool's own default for a key its file left unset (never tunecast's default). No epochs beside
        max_steps: in the Trainer and these tools a number of steps overrides the epochs."""
        if key == "epochs" and self.has("max_steps"):
            return
        if not self.has(key):
            self._set(key, value)

    def _set(self, key: str, value: Any) -> None:
        *sections, leaf = key.split(".")
        place = self.config
        for section in sections:
            place = place.setdefault(section, {})
        place[leaf] = value

    def line(self, tool_key: str) -> int | None:
        """The line of `tool_key`; list items share their list's key in the YAML reader's lines."""
        parts = tool_key.split(".")
        while parts:
            found = self.tool_lines.get(".".join(p for p in parts if not p.isdigit()))
            if found is not None:
                return found
            parts.pop()
        return None

    def error(self, tool_key: str, message: str, hint: str) -> TunecastError:
        line = self.line(tool_key)
        where = f" (line {line})" if line is not None else ""
        return TunecastError(f"{self.source}: {self.label} `{tool_key}`{where}: {message}", field=tool_key, hint=hint)

    def finish(self, data: Mapping[str, Any], known: Iterable[str]) -> Imported:
        """The Imported result; every leaf of `data` that no handler took is reported as not a key of the tool."""
        candidates = list(known)
        for key, value in leaves(data):
            if not self._covered(key):
                close = suggestion_text(key.split(".")[-1], candidates)
                reason = f"not a key of {self.label}'s documented config (misspelt?)"
                self.unmapped[key] = Unmapped(key, value, f"{reason} {close}" if close else reason)
        return Imported(tool=self.tool, source=self.source, config=self.config, mapped=dict(self.mapped),
                        unmapped=tuple(self.unmapped.values()), lines=dict(self.lines), notes=tuple(self.notes))

    def _covered(self, key: str) -> bool:
        parts = key.split(".")
        prefixes = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
        return any(p in self.mapped or p in self.unmapped for p in prefixes)


def leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf key of a YAML document, dotted (`datasets.0.path`); a list of plain values is one leaf."""
    if isinstance(data, dict) and data:
        found: list[tuple[str, Any]] = []
        for key, value in data.items():
            found += leaves(value, f"{prefix}{key}.")
        return found
    if isinstance(data, list) and any(isinstance(item, dict) for item in data):
        found = []
        for index, item in enumerate(data):
            found += leaves(item, f"{prefix}{index}.")
        return found
    return [(prefix.rstrip("."), data)]


def read_config_text(path: Path, label: str, kind: str) -> str:
    """The text of another tool's config file (`kind`: YAML, TOML); a user error naming it where it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TunecastError(f"{label} config {path} does not exist", field="config",
                            hint=f"check the path to the tool's {kind} file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise TunecastError(f"cannot read {label} config {path}: {error}", field="config",
                            hint=f"give the tool's {kind} training config") from None


def put_optimizer(m: Mapper, key: str, value: Any, optimizers: dict[str, str]) -> None:
    """A tool's optimizer name carried over through `optimizers` (its lower-cased names → tunecast's), or listed as
    not modelled."""
    name = str(value).lower()
    if name in optimizers:
        m.put(key, "optimizer", optimizers[name])
    else:
        m.skip(key, value, f"optimizer {value!r} is not one tunecast models: estimated with AdamW's two fp32 states "
                           "per trained parameter (a small part of a LoRA run's peak)")


def start(tool: str, label: str, path: Path) -> tuple[Mapper, dict[str, Any]]:
    """The tool's YAML file read as the tool reads it (a key written twice: the last value, said in a note), and the
    Mapper that accounts for its keys; a user error when it cannot be a config."""
    from tunecast.config.yamlfile import read_yaml

    text = read_config_text(path, label, "YAML")
    data, lines, problems = read_yaml(text, last_wins=True)
    errors = [problem for problem in problems if problem.severity == "error"]
    if errors:
        first = errors[0]
        where = f" ({first.location})" if first.location else ""
        raise TunecastError(f"{path}{where}: {first.message}", field=first.field or "config", hint=first.hint)
    if not isinstance(data, dict):
        raise TunecastError(f"{path} is not a {label} config: it must hold a mapping of keys", field="config",
                            hint=f"give {label}'s YAML training config (key: value lines)")
    mapper = Mapper(tool, label, path, lines)
    for warning in problems:
        mapper.note(f"{warning.field} {warning.message}")
    worded = _yes_no_words(data)
    if worded:
        mapper.note(f"{', '.join(worded)}: a yes/no word in quotes, read as true or false as {label} reads it")
    return mapper, data


# Yes/no words a YAML file may quote ("true"), which then load as text: the transformers argument parser
# (string_to_bool) and pydantic's lax booleans (axolotl's schema) read them, in any case, as the booleans they name.
_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def _yes_no_words(data: Any, prefix: str = "") -> list[str]:
    """Replace every text value of `data` that is a yes/no word by its boolean, in place; the dotted keys replaced."""
    replaced: list[str] = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in list(items):
        dotted = f"{prefix}{key}"
        if isinstance(value, str) and value.strip().lower() in _WORDS:
            data[key] = _WORDS[value.strip().lower()]
            replaced.append(dotted)
        else:
            replaced += _yes_no_words(value, f"{dotted}.")
    return replaced


def run_handlers(m: Mapper, data: Mapping[str, Any], handlers: Mapping[str, Handler],
                 quiet: Mapping[str, str], prefix: str = "") -> None:
    """Each key of `data` to its handler, or to the unmapped list with its reason from `quiet`. Empty (null) values
    mean the tool's default unless a handler takes them."""
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key in handlers and (value is not None or getattr(handlers[key], "takes_null", False)):
            handlers[key](m, dotted, value)
        elif key in handlers or key in quiet:
            m.skip(dotted, value, f"left empty: {m.label}'s default applies" if value is None else quiet[key])


def takes_null(handler: Handler) -> Handler:
    """Mark a handler that gives an empty (null) value its own meaning."""
    handler.takes_null = True  # type: ignore[attr-defined]
    return handler


def to(key: str, convert: Callable[[Any], Any] = lambda value: value) -> Handler:
    """A handler that sets one tunecast key from the value as it is (or converted)."""
    def handle(m: Mapper, tool_key: str, value: Any) -> None:
        m.put(tool_key, key, convert(value))
    return handle


def flag(key: str) -> Handler:
    """A handler for a yes/no key."""
    return to(key, bool)


def trainer_max_steps(m: Mapper, tool_key: str, value: Any) -> None:
    """The transformers Trainer's `max_steps`: a number above 0 is the run's length; -1 (its default) or 0 leaves it
    to the epochs."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        m.put(tool_key, "max_steps", value)
    else:
        m.skip(tool_key, value, f"{value}: the number of epochs decides")


def steps_replace_epochs(m: Mapper, epochs_key: str) -> None:
    """The transformers Trainer's rule, which axolotl, LLaMA-Factory and TRL train with: a `max_steps` replaces the
    epochs (it trains that many steps, passing over the data as often as they take, on a schedule of those steps).
    tunecast's max_steps beside epochs would end the run at whichever comes first, so the file's epochs are not
    carried over: max_steps alone is the Trainer's run."""
    if m.has("max_steps") and m.has("epochs"):
        m.drop("epochs", epochs_key, f"max_steps {m.get('max_steps')} replaces the epochs in the transformers Trainer: "
                                     "the run is max_steps steps, however many epochs they make")


def four_bit(m: Mapper, tool_key: str, value: Any) -> None:
    """`load_in_4bit`: QLoRA when true."""
    if value:
        m.put(tool_key, "method", "qlora")
    else:
        m.skip(tool_key, value, "false: the base weights are not 4-bit")


def eight_bit(m: Mapper, tool_key: str, value: Any) -> None:
    """`load_in_8bit`: LoRA on an LLM.int8 base (transformers' BitsAndBytesConfig(load_in_8bit=True)) when true, which
    tunecast names method qlora with quantization.bits 8."""
    if value:
        m.put(tool_key, "method", "qlora")
        m.put(tool_key, "quantization.bits", 8)
    else:
        m.skip(tool_key, value, "false: the base weights are not 8-bit")


def hf_optimizer(m: Mapper, tool_key: str, value: Any, default: str) -> None:
    name = str(value).lower()
    if name in HF_OPTIMIZERS:
        m.put(tool_key, "optimizer", HF_OPTIMIZERS[name])
    else:
        m.skip(tool_key, value, f"optimizer {value!r} has no tunecast equivalent: estimated with "
                                f"{m.label}'s default ({default})")


def schedule(m: Mapper, tool_key: str, value: Any) -> None:
    if str(value) in SCHEDULES:
        m.put(tool_key, "schedule", str(value))
    else:
        m.skip(tool_key, value, f"schedule {value!r} has no tunecast equivalent: {NO_EFFECT} of the estimate "
                                "(the learning rate's shape only)")


def peft_default_targets(m: Mapper, model: str) -> None:
    """peft's own targets when the tool gives none: q_proj, v_proj for the Llama, Mistral, Qwen2/3 and Gemma-2
    families (peft src/peft/utils/constants.py); other architectures have their own lists."""
    if m.has("lora.targets"):
        return
    if any(family in model.lower() for family in _PEFT_DEFAULT_FAMILIES):
        m.default("lora.targets", ["q_proj", "v_proj"])
        m.note(f"LoRA targets not given: peft's default for this architecture (q_proj, v_proj) for {model}")
    else:
        m.note(f"LoRA targets not given: peft picks them by architecture; tunecast's all-linear is used for {model}, "
               "set lora.targets to match")


def dataset_file(m: Mapper, value: Any, base: Path | None = None) -> str | None:
    """An existing local file or folder (or one named with a data file suffix), as an absolute path resolved against
    the config's folder; None for a Hub name."""
    if not isinstance(value, str) or not value:
        return None
    candidate = Path(value).expanduser()
    if not candidate.is_absolute():
        candidate = (base or m.base_dir) / candidate
    if candidate.exists() or candidate.suffix.lower() in DATA_SUFFIXES:
        return str(candidate.resolve())
    return None


def run_folder(m: Mapper, value: Any) -> Path | None:
    """The folder a tool that opens a relative path from the folder it runs in would have to run in to find `value`:
    the config's own, else the nearest folder above the config from which the path names a file (a repository's
    examples/… configs run from the repository root, which holds their data/), else the current directory; None when
    none does, or for an absolute path that is no file."""
    if not isinstance(value, str) or not value:
        return None
    path = Path(value).expanduser()
    if path.is_absolute():
        return path.parent if path.is_file() else None
    return next((folder for folder in (m.base_dir, *m.base_dir.parents, Path.cwd()) if (folder / path).is_file()),
                None)


def deepspeed(m: Mapper, tool_key: str, value: Any) -> None:
    """A DeepSpeed JSON file (or its document): the ZeRO stage → gpus.strategy (zero1, zero2, zero3), what it
    offloads → gpus.offload, and the buffer sizes → gpus.deepspeed. Stage 0 is DDP (nothing sharded)."""
    document = value if isinstance(value, dict) else _deepspeed_file(m, value)
    if document is None:
        m.skip(tool_key, value, f"DeepSpeed file {value!r} not found next to the config: set gpus.strategy "
                                "(zero1, zero2, zero3) to the file's ZeRO stage")
        return
    zero = document.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage == 0:
        m.put(tool_key, "gpus.strategy", "ddp")
        m.note("DeepSpeed ZeRO stage 0 shards nothing: estimated as DDP")
        m.note(LAUNCH_COUNT)
        return
    if stage not in (1, 2, 3):
        m.skip(tool_key, value, f"ZeRO stage {stage!r} is none of DeepSpeed's (0 to 3): estimated as ddp")
        return
    m.put(tool_key, "gpus.strategy", f"zero{stage}")
    device = {key: (zero.get(key) or {}).get("device") for key in ("offload_param", "offload_optimizer")}
    if device["offload_param"] in ("cpu", "nvme") and stage == 3:
        m.put(tool_key, "gpus.offload", "params")
    elif device["offload_optimizer"] in ("cpu", "nvme"):
        m.put(tool_key, "gpus.offload", "optimizer")
    if "nvme" in device.values():
        m.note("DeepSpeed's NVMe offload is estimated as CPU offload: the host memory shown is then on the NVMe "
               "drive")
    for name in ("reduce_bucket_size", "overlap_comm", "stage3_prefetch_bucket_size",
                 "stage3_param_persistence_threshold"):
        if name in zero:
            setting = zero[name]
            number = isinstance(setting, (int, float)) and not isinstance(setting, bool)
            m.put(f"{tool_key}.zero_optimization.{name}", f"gpus.deepspeed.{name}",
                  int(setting) if number else setting)
    m.note(LAUNCH_COUNT)


def _deepspeed_file(m: Mapper, value: Any) -> dict[str, Any] | None:
    if not isinstance(value, str):
        return None
    path = Path(value).expanduser()
    for candidate in (path,) if path.is_absolute() else (m.base_dir / path, Path.cwd() / path):
        try:
            document = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(document, dict):
            return document
    return None
