"""The web planner's answers, apart from HTTP: each is the document the CLI's `--json` prints for the same input,
made by the same library functions (`load_spec_text` is `load_spec` for a config sent as text).

What is kept between requests, and why the answers stay the CLI's:

* the catalog, loaded once when the server starts (restart it to see a catalog edited since);
* the answers themselves, in a bounded LRU keyed by everything a command's answer depends on: the resolved RunSpec
  and the keys it sets, the model's config, the options, the dataset file's size and time, and the date;
* each model's memory estimates, shared by its plans (`make_plan(estimates=…)`): an estimate is a pure function of
  its key (the settings that shape a step, the GPU architecture, micro-batch, checkpointing) given the model's config
  and the catalog, so a plan that changes prices, the dataset or the schedule recomputes none;
* below that, what the estimator keeps in every process (profiles, templates, replays, tunecast/estimate/).

One estimate runs at a time (the estimator's process-wide caches are not built for two threads at once, and two
cores gain nothing from it under the GIL); a request waits for the one before it, and stops waiting when cancelled.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from tunecast.catalog.hub import HubAccess
from tunecast.catalog.store import Catalog
from tunecast.config.load import LoadedSpec, Override, imported_part, load_spec_text, merged_document, overrides_from
from tunecast.errors import TunecastError
from tunecast.estimate.progress import progress
from tunecast.plan.planner import Estimates
from tunecast.serve.jobs import Job, encoded
from tunecast.version import __version__, stamped

K = TypeVar("K")
V = TypeVar("V")

ANSWERS_KEPT = 64  # answers kept, encoded (a plan over the whole catalog is about 0.5 MB of JSON)
MODELS_KEPT = 8  # models whose estimates are kept
ESTIMATES_KEPT = 5_000  # estimates kept per model (a plan makes about 200; each is a few kilobytes)
DECLARED_SIZE = ("examples", "mean_tokens", "mean_trained_tokens", "length_spread")  # dataset keys of a declared size


class Lru(Generic[K, V]):
    """A bounded mapping that forgets the least recently used entry first; safe to share between threads."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class Answer:
    """A document as the response's body, encoded once (an answer given again is not serialized again)."""

    body: bytes

    @classmethod
    def of(cls, document: dict[str, Any]) -> Answer:
        return cls(encoded(stamped(document)))


@dataclass(frozen=True)
class RunRequest:
    """What every run-based endpoint is sent: a RunSpec as YAML text ("" for none) and dotted overrides."""

    config: str
    overrides: dict[str, Any]


class Service:
    """The answers of one server: its catalog (and the user catalog directory a dropped model is added to), what it
    keeps between requests, and the lock estimates run under."""

    def __init__(self, catalog: Catalog, catalog_dir: Path | None = None, *, offline: bool = False) -> None:
        self.catalog = catalog
        self.catalog_dir = catalog_dir
        # a model outside the catalog has its config.json fetched as on the command line (unless `serve --offline` or
        # HF_HUB_OFFLINE), said as the request's progress: the request's job hears what an estimate says
        self.hub = HubAccess(offline, progress=progress)
        self.answers: Lru[str, Answer] = Lru(ANSWERS_KEPT)
        self._estimates: Lru[str, Estimates] = Lru(MODELS_KEPT)
        self._estimating = threading.Lock()
        self._catalog_answer: Answer | None = None
        self._models: list[dict[str, Any]] | None = None

    # Reading a request's run

    def load(self, run: RunRequest, extra: list[Override] | None = None) -> LoadedSpec:
        """The run as `tunecast plan FILE --set …` reads it: validated, names resolved; a ConfigError listing every
        problem otherwise, each located by line or by `overrides.KEY`."""
        return load_spec_text(run.config, overrides_from(run.overrides) + (extra or []), self.catalog, hub=self.hub)

    def _key(self, kind: str, loaded: LoadedSpec, options: Any) -> str:
        """Everything `kind`'s answer for `loaded` depends on but the catalog (fixed for the server's life)."""
        from tunecast.catalog import store

        spec = loaded.spec
        stamp = None
        if spec.dataset.path and Path(spec.dataset.path).is_file():
            status = Path(spec.dataset.path).stat()
            stamp = [status.st_size, status.st_mtime_ns]
        payload = json.dumps({"kind": kind, "spec": spec.model_dump(mode="json"),
                              "set": spec.model_dump(mode="json", exclude_unset=True), "model": loaded.model.data,
                              "model_name": loaded.model.name, "params": loaded.model.params,
                              "imported": imported_part(loaded), "options": options, "dataset": stamp,
                              "today": store.today().isoformat()}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode("utf-8", errors="surrogatepass")).hexdigest()

    def _model_estimates(self, loaded: LoadedSpec) -> Estimates:
        digest = hashlib.sha256(json.dumps(loaded.model.data, sort_keys=True, default=str)
                                .encode("utf-8", errors="surrogatepass")).hexdigest()
        estimates = self._estimates.get(digest)
        if estimates is None or len(estimates) > ESTIMATES_KEPT:
            estimates = {}
            self._estimates.put(digest, estimates)
        return estimates

    @contextmanager
    def _estimate(self, job: Job) -> Iterator[None]:
        """Hold the estimator: one estimate at a time; a cancelled job stops waiting."""
        if not self._estimating.acquire(blocking=False):
            job.hear("progress", "waiting for the estimate before this one")
            while not self._estimating.acquire(timeout=0.1):
                job.check()
        try:
            yield
        finally:
            self._estimating.release()

    def _answer(self, key: str, job: Job, make: Callable[[], dict[str, Any]]) -> Answer:
        answer = self.answers.get(key)
        if answer is None:
            with self._estimate(job):
                answer = self.answers.get(key)  # made while this request waited
                if answer is None:
                    answer = Answer.of(make())
                    self.answers.put(key, answer)
        return answer

    # The answers

    def health(self) -> dict[str, Any]:
        return stamped({"version": __version__, "catalog": self.catalog.version})

    def catalog_answer(self) -> Answer:
        """The catalog's models and GPUs as `tunecast models --json` and `tunecast gpus --json` list them, and the
        offers' providers (made once; again only when a dropped model joins the catalog)."""
        from tunecast.catalog.listing import listed_gpus, provider_documents

        answer = self._catalog_answer
        if answer is None:
            answer = Answer.of({"models": stamped(self._model_documents()),
                                "gpus": stamped([g.document() for g in listed_gpus(self.catalog)]),
                                "providers": provider_documents(self.catalog)})
            self._catalog_answer = answer
        return answer

    def _model_documents(self) -> list[dict[str, Any]]:
        from tunecast.catalog.listing import model_documents

        documents = self._models
        if documents is None:
            documents = self._models = model_documents(self.catalog)
        return documents

    def search_models(self, text: str, limit: int) -> dict[str, Any]:
        """`tunecast models --search TEXT --json`, the first `limit` (the best first), from the documents kept."""
        from tunecast.catalog.models import search_names

        documents = {d["name"]: d for d in self._model_documents()}
        found = search_names(list(documents), text)
        return stamped({"search": text, "count": len(found),
                        "models": [documents[name] for name in found[:max(0, limit)]]})

    def plan(self, run: RunRequest, options: dict[str, Any], job: Job) -> Answer:
        """`tunecast plan --json` of the run, with `--optimize`, `--budget`, `--deadline` and
        `--preemptions-per-hour` from `options`."""
        from tunecast.catalog import store
        from tunecast.plan.report import PlanRequest, make_plan

        loaded = self.load(run)
        request = PlanRequest(options["optimize"], options["budget_usd"], options["deadline_hours"],
                              options["preemptions_per_hour"]).over(loaded.spec)

        def make() -> dict[str, Any]:
            document = make_plan(loaded, self.catalog, request, today=store.today(),
                                 progress=lambda gpu: job.hear("progress", f"planning {gpu}"),
                                 estimates=self._model_estimates(loaded), cache=False, check=job.check)
            return {**document, **imported_part(loaded)}

        return self._answer(self._key("plan", loaded, request.__dict__), job, make)

    def memory(self, run: RunRequest, options: dict[str, Any], job: Job) -> Answer:
        """`tunecast memory --json` of the run on `options["device"]`."""
        from tunecast.estimate.answer import answer_memory

        loaded = self.load(run)
        device = options["device"]

        def make() -> dict[str, Any]:
            answer = answer_memory(loaded, self.catalog, device=device)
            return {**answer.as_dict(loaded), **imported_part(loaded)}

        return self._answer(self._key("memory", loaded, device), job, make)

    def data(self, run: RunRequest, sample_name: str, sample_text: str, job: Job) -> Answer:
        """`tunecast data --json` of a sample file, counted as the run says (the model's tokenizer or the
        estimate of its family, dataset.format, seq_len, micro_batch, dataset.train_on, skip_invalid, seed)."""
        from tunecast.data.counters import spec_counter
        from tunecast.data.stats import measure
        from tunecast.serve.uploads import with_sample

        def count(path: Path) -> Answer:
            # the sample is the run's dataset, in place of its file or its declared size
            loaded = self.load(run, [Override("dataset.path", str(path), "sample")]
                               + [Override(f"dataset.{key}", None, "sample") for key in DECLARED_SIZE])
            spec, data = loaded.spec, loaded.spec.dataset
            with self._estimate(job):
                stats = measure(str(path), spec_counter(loaded, self.catalog), seq_len=spec.seq_len,
                                micro_batch=spec.micro_batch_size, layout=data.format, train_on=data.train_on,
                                skip_invalid=data.skip_invalid, seed=spec.seed,
                                progress=lambda n: job.hear("progress", f"reading the sample: {n:,} examples"))
            return Answer.of(replace(stats, source=path.name).as_dict())

        answer: Answer = with_sample(sample_name, sample_text, count)
        return answer

    def breakeven(self, run: RunRequest, options: dict[str, Any], job: Job) -> Answer:
        """`tunecast breakeven --json` with `options` as its flags; with a run config, `--run` of it."""
        from tunecast.catalog import store
        from tunecast.plan.breakeven import BreakEvenOptions, answer_break_even

        given = BreakEvenOptions(**options)
        loader = None
        if run.config.strip() or run.overrides:  # a run, as the page sends one (its keys as overrides); else none
            self.load(run)  # the run is checked before anything is planned, as `--run FILE` is read first

            def loader(overrides: list[Override]) -> LoadedSpec:
                return self.load(run, overrides)

        with self._estimate(job):
            answer = answer_break_even(self.catalog, given, run=loader, today=store.today())
        return Answer.of(answer.as_dict())

    def export(self, run: RunRequest, options: dict[str, Any] | None = None) -> Answer:
        """A RunSpec YAML that `tunecast plan FILE` plans as this request's run: the config as sent with the
        overrides set in it, the plan's ranking, budget and deadline (`options`, as /api/plan takes them) in its
        `plan:` section, paths written as the server resolved them (absolute)."""
        import yaml

        loaded = self.load(run)
        document = merged_document(run.config, overrides_from(run.overrides))
        chosen = {key: value for key, value in (options or {}).items()
                  if key in ("optimize", "budget_usd", "deadline_hours") and value is not None}
        if chosen:
            section = document.get("plan")
            document["plan"] = {**(section if isinstance(section, dict) else {}), **chosen}
            self.load(RunRequest(yaml.safe_dump(document), {}))  # what is written is a run `plan` reads
        if loaded.model.origin in ("file", "directory"):
            model_path = loaded.model.path if loaded.model.origin == "file" else loaded.model.path.parent
            document["model"] = str(model_path)
        dataset = document.get("dataset")
        if isinstance(dataset, dict):
            for key in ("path", "tokenizer"):
                if dataset.get(key) is not None:
                    dataset[key] = getattr(loaded.spec.dataset, key)
        if document.get("output") is not None:
            document["output"] = loaded.spec.output
        text = ("# exported by `tunecast serve`; plan it with: tunecast plan THIS_FILE\n"
                + yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
        return Answer.of({"yaml": text})

    def add_model(self, config_json: dict[str, Any], name: str | None, file_name: str | None) -> dict[str, Any]:
        """Add a dropped config.json to the user's catalog as `tunecast models add` does, under the name it says
        (`dropped_model_name`) and with its exact parameter count, so that `model:` names it: here, in a link and in
        an exported config alike. The same config dropped again is the same model, and so is a catalog model's own
        config; another config under a name already taken gets that name with its digest."""
        from tunecast.catalog.user import add_model
        from tunecast.serve.uploads import checked_model_config, dropped_model_name, model_digest, same_model
        from tunecast.step.shape import build_meta_model, count_parameters

        config = checked_model_config(config_json)
        wanted = dropped_model_name(config, name, file_name)
        taken = wanted
        for candidate in (wanted, f"{wanted}-{model_digest(config)[:8]}"):
            known = self.catalog.models.find(candidate)
            if known is not None and same_model(known.data, config):
                return stamped({"model": known.name, "added": False, **self._model_document(known.name)})
            taken = candidate
            if known is None:
                break
        try:
            params = count_parameters(build_meta_model(config, name=taken))
        except TunecastError as error:
            raise TunecastError(error.message, field="config_json", hint=error.hint) from None
        except Exception as error:  # the config is the user's: what transformers makes of it is about the config
            raise TunecastError(f"transformers cannot build a model from this config.json: {type(error).__name__}: "
                                f"{error}", field="config_json", hint="drop the config.json of a causal language "
                                "model that transformers builds (AutoModelForCausalLM)") from None
        entry, path = add_model(config, name=taken, params=params, user_dir=self.catalog_dir,
                                source=f"dropped on the web planner (tunecast serve) as {file_name or 'config.json'}")
        # the server's catalog gains the model as the user catalog on disk did (the rest stays as the server loaded it)
        self.catalog = replace(self.catalog, models=self.catalog.models.with_entry(entry, path))
        self._models = None
        self._catalog_answer = None
        return stamped({"model": taken, "added": True, **self._model_document(taken)})

    def _model_document(self, name: str) -> dict[str, Any]:
        """The model's row as `tunecast models --json` lists it: its shape, exact parameter count and source."""
        return next(d for d in self._model_documents() if d["name"] == name)
