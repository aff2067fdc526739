"""The API's request bodies (their schema is the OpenAPI spec's). A body of the wrong shape is answered 422; what
is inside a well-shaped body (the RunSpec, the overrides, an option's value) is checked by the library functions
themselves, with the CLI's messages, and answered 400."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tunecast.serve.service import RunRequest

# More keys than anyone sets: a RunSpec has fewer than a hundred; past this, an override list is a mistake or an
# attack (each unknown key costs a search for close matches: 100,000 of them took 45 s of CPU).
MAX_OVERRIDES = 256


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RunBody(_Body):
    """A run: a RunSpec as YAML text, and dotted keys set over it."""

    config: str = Field("", description="A RunSpec as YAML text, what `tunecast plan FILE` reads; empty for none "
                                        "(the overrides alone, as flags without a file).",
                        examples=["model: meta-llama/Llama-3.1-8B\nmethod: lora\nseq_len: 2048\n"])
    overrides: dict[str, Any] = Field(default_factory=dict, max_length=MAX_OVERRIDES,
                                      description="Dotted keys and their values, set over the config as `--set "
                                                  f"KEY=VALUE` does; at most {MAX_OVERRIDES}.",
                                      examples=[{"seq_len": 4096, "pricing.spot": False}])

    def run(self) -> RunRequest:
        return RunRequest(self.config, self.overrides)


class PlanOptions(_Body):
    """`tunecast plan`'s options beside the run."""

    optimize: str | None = Field(None, description="Rank by total `cost` or by `time` (--optimize); default: the "
                                                   "run's plan.optimize.")
    budget_usd: float | None = Field(None, description="Only runs costing at most this (--budget); default: the run's "
                                                       "plan.budget_usd.")
    deadline_hours: float | None = Field(None, description="Only runs done within this (--deadline); default: the "
                                                           "run's plan.deadline_hours.")
    preemptions_per_hour: float | None = Field(None, description="Spot preemption rate to assume for every offer "
                                                                 "(--preemptions-per-hour).")


class PlanBody(RunBody):
    options: PlanOptions = Field(default_factory=PlanOptions)


class ExportBody(RunBody):
    """A run to export, with the plan options to write in its `plan:` section (the rest of them are no run's)."""

    options: PlanOptions = Field(default_factory=PlanOptions)


class MemoryOptions(_Body):
    """`tunecast memory`'s options beside the run."""

    device: str = Field("cuda", description="cuda or cpu (--device).")


class MemoryBody(RunBody):
    options: MemoryOptions = Field(default_factory=MemoryOptions)


class Sample(_Body):
    """A dataset file's contents, as the page read it from a file the user picked."""

    name: str = Field(min_length=1, max_length=255, description="The file's name; its suffix (.jsonl, .json, .csv, "
                                                                ".tsv) says how it is read.", examples=["train.jsonl"])
    text: str = Field(description="The file's text (UTF-8).")


class DataBody(RunBody):
    sample: Sample


class BreakevenOptions(_Body):
    """`tunecast breakeven`'s flags, by the same names."""

    gpu: str | None = Field(None, description="The card you would buy: its catalog price and power (--gpu).")
    purchase_usd: float | None = Field(None, description="Purchase price (--purchase-usd).")
    rent_usd_per_hour: float | None = Field(None, description="Rental price per hour (--rent-usd-per-hour).")
    rent_gpu: str | None = Field(None, description="Rent this card instead: its cheapest on-demand offer "
                                                   "(--rent-gpu).")
    hours_per_month: float = Field(200.0, description="Hours of use per month (--hours-per-month).")
    power_w: float | None = Field(None, description="Power draw while training, watts (--power-w).")
    usd_per_kwh: float | None = Field(None, description="Electricity price (--usd-per-kwh).")
    resale_usd: float = Field(0.0, description="What the card sells for later (--resale-usd).")


class BreakevenBody(RunBody):
    """With a config (or overrides), in runs of it: `--run`."""

    options: BreakevenOptions = Field(default_factory=BreakevenOptions)


class ModelBody(_Body):
    """A model's config.json, dropped on the page."""

    config_json: dict[str, Any] = Field(description="The Hugging Face config.json's contents.")
    name: str | None = Field(None, max_length=200, description="The name to list it under, `org/name` (default: "
                                                               "its `_name_or_path`, else its architecture, else "
                                                               "the file's name).")
    file_name: str | None = Field(None, max_length=255, description="The dropped file's name, the last source of a "
                                                                    "name (`config.json` says nothing).")
