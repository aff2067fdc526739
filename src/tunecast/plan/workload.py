"""How many tokens a run processes: from the dataset file (measured with the data module's own counting), or
from its declared size, times the epochs (or the steps).

The run's length is `tunecast train`'s (train/run.py `run_length`): ⌈epochs × steps per epoch⌉ optimizer steps,
steps per epoch being ⌈sequences / global batch⌉. `max_steps` ends it early when `epochs` is set too (the run is the
first max_steps steps of the epochs' run) and sets it alone otherwise (as many passes as the steps take). Whole-run
tokens, hours and cost follow the steps, not the epochs."""

from __future__ import annotations

import functools
import math
import random
import statistics
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec
from tunecast.errors import TunecastError
from tunecast.train.policy import evaluations_in_run

# Text of a declared dataset, for its storage: about 4 characters (bytes, for English) per token, as the
# generic tokenizer ratio of catalog/data/token_ratios.csv.
DECLARED_BYTES_PER_TOKEN = 4.0
# Example lengths assumed for a declared size, to compute its padding: as many as a measured file's statistics
# use, at evenly spaced quantiles of the distribution (deterministic).
DECLARED_SAMPLES = 4096
# A config read from another tool (`--from`) that names a dataset tunecast cannot count (a Hub dataset, offline) is
# planned for this many tokens, every sequence at full length: figures per million tokens, which rank the options as
# the whole run's would (every option processes the same tokens).
UNSIZED_TOKENS = 1_000_000


@dataclass
class Workload:
    """The dataset as the planner sees it: one epoch's tokens and how sequences are formed."""

    examples: int
    processed_tokens: int  # one epoch, after truncation, padding excluded
    trained_tokens: int
    epochs: float
    seq_len: int
    packed: bool
    measured: bool  # True when counted from the file, False for a declared size
    tokenizer: str
    dataset_bytes: int
    lengths: array[int] | None = None  # truncated tokens per example, when measured
    packing_efficiency: float = 1.0
    seed: int = 42
    eval_examples: int = 0  # evaluated each time (held out of a dataset file)
    length_sigma: float | None = None  # a declared size: the log-normal σ of example lengths assumed for padding
    sigma_source: str = "catalog row declared_length_sigma"  # where length_sigma comes from, in words
    max_steps: int | None = None  # the run's step limit
    epochs_set: bool = True  # `epochs` was set (RunSpec.fixed): with max_steps, the steps are the first of its run
    global_batch: int = 1  # the run's sequences per optimizer step, for the whole-run figures of as_dict
    unsized: str | None = None  # why the dataset's size is unknown, when it is planned per UNSIZED_TOKENS tokens
    # tokens_per_sequence by micro-batch: the planner asks for each micro-batch on every GPU and count
    _padded: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def mean_tokens(self) -> float:
        """Processed tokens of one example."""
        return self.processed_tokens / self.examples

    def length(self, global_batch: int, max_steps: int | None) -> RunSteps:
        """The run's optimizer steps at `global_batch` sequences a step, as `tunecast train` counts them."""
        per_epoch = max(1, math.ceil(self.sequences() / global_batch - 1e-9))
        by_epochs = max(1, math.ceil(self.epochs * per_epoch - 1e-9))
        if max_steps is None:
            steps = by_epochs
        elif self.epochs_set:
            steps = min(max_steps, by_epochs)
        else:
            steps = max_steps
        passes = self.epochs if steps == by_epochs else steps / per_epoch
        return RunSteps(steps, by_epochs, per_epoch, passes, self.epochs, max_steps, self.epochs_set)

    @property
    def total_processed_tokens(self) -> float:
        """Tokens processed over the whole run (padding excluded): the epochs', or fewer when max_steps ends it."""
        return self.processed_tokens * self.length(self.global_batch, self.max_steps).passes

    @property
    def total_trained_tokens(self) -> float:
        return self.trained_tokens * self.length(self.global_batch, self.max_steps).passes

    def sequences(self) -> float:
        """Sequences fed per epoch: packed sequences, or one per example."""
        if self.packed:
            return self.processed_tokens / (self.seq_len * self.packing_efficiency)
        return float(self.examples)

    def tokens_per_sequence(self, micro_batch: int) -> float:
        """Tokens computed per sequence, padding included: seq_len when packed; else the mean length a
        micro-batch of shuffled examples is padded to."""
        if self.packed:
            return float(self.seq_len)
        if self.lengths is None:
            if not self.length_sigma:
                return self.processed_tokens / self.examples
            if micro_batch not in self._padded:
                # declared: padded as examples of the assumed length distribution would be
                ratio = _declared_padding(self.mean_tokens, self.length_sigma, self.seq_len, self.seed, micro_batch)
                self._padded[micro_batch] = min(float(self.seq_len), self.mean_tokens * ratio)
            return self._padded[micro_batch]
        if micro_batch not in self._padded:
            order = _shuffled(len(self.lengths), self.seed)
            padded = 0
            for start in range(0, len(order), micro_batch):
                batch = order[start:start + micro_batch]
                padded += len(batch) * max(self.lengths[i] for i in batch)
            self._padded[micro_batch] = padded / len(order)
        return self._padded[micro_batch]

    def real_fraction(self, micro_batch: int) -> float:
        """Share of computed tokens that are real (not padding)."""
        computed = self.tokens_per_sequence(micro_batch) * self.sequences()
        return self.processed_tokens / computed

    def as_dict(self) -> dict[str, Any]:
        length = self.length(self.global_batch, self.max_steps)
        return {"examples": self.examples, "processed_tokens": round(self.total_processed_tokens),
                "trained_tokens": round(self.total_trained_tokens), "tokens_per_epoch": self.processed_tokens,
                "epochs": self.epochs, "max_steps": self.max_steps, "steps": length.steps,
                "steps_per_epoch": length.per_epoch, "passes": length.passes, "length": length.describe(),
                "seq_len": self.seq_len, "packed": self.packed, "measured": self.measured,
                "tokenizer": self.tokenizer, "eval_examples": self.eval_examples,
                "padding_assumption": self.padding_assumption(), "size_known": self.unsized is None}

    def padding_assumption(self) -> str | None:
        """How a declared size is padded, in words; None for a measured or packed dataset."""
        if self.measured or self.packed or self.length_sigma is None:
            return None
        if self.length_sigma == 0:
            return "examples of equal length (dataset.length_spread 0): no padding"
        return (f"example lengths log-normal around the declared mean (σ {self.length_sigma:g}: "
                f"{self.sigma_source})")


@dataclass(frozen=True)
class RunSteps:
    """A run's length in optimizer steps, and what set it."""

    steps: int  # trained
    epoch_steps: int  # the epochs' steps (the learning-rate schedule's, when the epochs set it)
    per_epoch: int
    passes: float  # passes over the data the steps make: the epochs, or fewer (more) when max_steps ends it
    epochs: float
    max_steps: int | None
    epochs_set: bool

    def describe(self) -> str:
        """The length in words, for a plan's header: '3 epochs (120 steps)', '6 steps (max_steps, of the 120 of 3
        epochs)', '500 steps (max_steps: 12.5 passes over the data)'."""
        def epochs_text(count: float) -> str:
            return f"{count:g} epoch{'' if count == 1 else 's'}"

        whole = f"{epochs_text(self.epochs)} ({self.steps:,} step{'' if self.steps == 1 else 's'})"
        if self.max_steps is None:
            return whole
        if not self.epochs_set:
            return (f"{self.steps:,} steps (max_steps: {self.passes:.3g} pass{'' if self.passes == 1 else 'es'} over "
                    "the data)")
        if self.steps < self.epoch_steps:
            return (f"{self.steps:,} step{'' if self.steps == 1 else 's'} (max_steps ends the run early: the first of "
                    f"the {self.epoch_steps:,} steps of {epochs_text(self.epochs)})")
        return f"{whole}; max_steps {self.max_steps:,} is beyond them"


def workload_for(loaded: LoadedSpec, catalog: Catalog) -> Workload:
    """The run's workload; a plan with neither a dataset file nor a declared size is an error."""
    spec = loaded.spec
    data = spec.dataset
    epochs = spec.epochs
    if data.path is not None:
        from tunecast.data.counters import spec_counter
        from tunecast.data.stats import measure

        stats = measure(data.path, spec_counter(loaded, catalog), seq_len=spec.seq_len, micro_batch=1,
                        layout=data.format, train_on=data.train_on, skip_invalid=data.skip_invalid, seed=spec.seed)
        size = Path(data.path).stat().st_size if Path(data.path).is_file() else 0
        held = spec.eval.examples
        if held >= stats.examples:
            raise TunecastError(f"eval.examples {held} holds out the whole dataset ({stats.examples} examples)",
                                field="eval.examples", hint="hold out fewer examples, for example 2% of them")
        kept = (stats.examples - held) / stats.examples  # held-out examples are average ones
        workload = Workload(stats.examples - held, round(stats.total_tokens * kept),
                            round(stats.trained_tokens * kept), epochs, spec.seq_len, spec.packing, True,
                            stats.tokenizer, size, stats.kept_lengths, stats.packing_efficiency, spec.seed, held)
    elif data.examples is not None and data.mean_tokens is not None:
        per_example = min(data.mean_tokens, spec.seq_len)
        trained = min(data.mean_trained_tokens or data.mean_tokens, per_example)
        processed = round(data.examples * per_example)
        workload = Workload(data.examples, processed, round(data.examples * trained), epochs, spec.seq_len,
                            spec.packing, False, "declared size (dataset.examples × dataset.mean_tokens)",
                            round((processed + spec.eval.examples * per_example) * DECLARED_BYTES_PER_TOKEN),
                            eval_examples=spec.eval.examples,
                            length_sigma=(data.length_spread if data.length_spread is not None
                                          else catalog.throughput.get("declared_length_sigma")),
                            sigma_source=("dataset.length_spread" if data.length_spread is not None
                                          else "catalog row declared_length_sigma"))
    elif loaded.imported is not None:
        return _unsized(loaded)
    else:
        raise TunecastError("the plan needs the dataset's size: no dataset.path and no declared size", field="dataset",
                            hint=SIZE_HINT)
    workload.max_steps, workload.epochs_set = spec.max_steps, spec.fixed("epochs")
    workload.global_batch = spec.sequences_per_step
    return workload


SIZE_HINT = ("set dataset.path to the training file, or dataset.examples and dataset.mean_tokens (for example "
             "--set dataset.examples=50000 --set dataset.mean_tokens=600)")


def _unsized(loaded: LoadedSpec) -> Workload:
    """The workload of another tool's config whose data tunecast cannot count: UNSIZED_TOKENS tokens in sequences of
    the full length (an upper bound on the compute of unpacked data, whose lengths are unknown), or the run itself
    where `max_steps` alone sets its length (its steps' sequences at full length, again an upper bound)."""
    spec = loaded.spec
    imported = loaded.imported
    named = [item.key for item in imported.unmapped if item.key.split(".")[0] in DATA_KEYS] if imported else []
    source = f"{imported.tool} `{named[0]}`" if imported and named else "the config"
    by_steps = spec.max_steps is not None and not spec.fixed("epochs")
    if by_steps:
        sequences = spec.max_steps * spec.sequences_per_step  # type: ignore[operator]
        basis = (f"max_steps {spec.max_steps:,} × {spec.sequences_per_step} sequences of up to {spec.seq_len:,} "
                 "tokens (each taken at full length: an upper bound)")
    else:
        sequences = math.ceil(UNSIZED_TOKENS / spec.seq_len)
        basis = f"figures per {UNSIZED_TOKENS:,} tokens, in sequences of {spec.seq_len:,} tokens"
    tokens = sequences * spec.seq_len
    why = f"the dataset's size is unknown ({source} names data tunecast cannot count here): {basis}"
    return Workload(sequences, tokens, tokens, 1.0, spec.seq_len, spec.packing, False, why,
                    round(tokens * DECLARED_BYTES_PER_TOKEN), max_steps=spec.max_steps if by_steps else None,
                    epochs_set=not by_steps, global_batch=spec.sequences_per_step, unsized=why)


# The keys under which the tools' configs name their data (axolotl, LLaMA-Factory v0/v1, TRL, torchtune).
DATA_KEYS = ("datasets", "dataset", "dataset_name", "dataset_mixture", "train_dataset", "data", "dataset_dir")


@functools.lru_cache(maxsize=1024)  # pure; a plan asks for each micro-batch, a server for each plan of a workload
def _declared_padding(mean: float, sigma: float, seq_len: int, seed: int, micro_batch: int) -> float:
    """Tokens computed per sequence over real ones, for micro-batches of shuffled examples of the lengths assumed for
    a declared size."""
    assumed = assumed_lengths(mean, sigma, seq_len)
    padded = Workload(len(assumed), sum(assumed), sum(assumed), 1, seq_len, False, True, "", 0, assumed,
                      seed=seed).tokens_per_sequence(micro_batch)
    return padded / (sum(assumed) / len(assumed))


@functools.lru_cache(maxsize=64)  # pure: the examples' order for the padding figures, the same for every micro-batch
def _shuffled(count: int, seed: int) -> tuple[int, ...]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return tuple(order)


def assumed_lengths(mean: float, sigma: float, seq_len: int) -> array[int]:
    """Example lengths log-normal with mean `mean` and shape `sigma`, at DECLARED_SAMPLES evenly spaced
    quantiles, truncated to `seq_len` (as the run truncates them)."""
    return array("i", (max(1, min(seq_len, length)) for length in _quantile_lengths(mean, sigma)))


@functools.lru_cache(maxsize=256)  # pure: the lengths before truncation, the same for every seq_len
def _quantile_lengths(mean: float, sigma: float) -> tuple[int, ...]:
    normal = statistics.NormalDist(math.log(mean) - sigma * sigma / 2, sigma)
    return tuple(round(math.exp(normal.inv_cdf((i + 0.5) / DECLARED_SAMPLES))) for i in range(DECLARED_SAMPLES))


def evaluations(workload: Workload, steps: int, global_batch: int, every_steps: int | None) -> int:
    """Evaluations over a run of `steps` optimizer steps, as the loop schedules them (train/policy.py): every
    `every_steps` steps, else at the end of every epoch, and after the last step; none without held-out examples."""
    if workload.eval_examples == 0:
        return 0
    return evaluations_in_run(steps, workload.length(global_batch, None).per_epoch, every_steps)


def optimizer_steps(workload: Workload, global_batch: int, max_steps: int | None) -> int:
    """Optimizer steps of the run (`Workload.length`): the epochs', capped by max_steps when both are set; max_steps
    alone when the epochs are not."""
    return workload.length(global_batch, max_steps).steps
