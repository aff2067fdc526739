"""The web planner's HTTP application: the page, its files, and the JSON API (the OpenAPI spec is /openapi.json).

Every answer is a JSON document with `schema_version`, the one the CLI's `--json` prints for the same input. Errors
are documents too: a user error (a bad config or override, an unknown model or GPU) is 400 with the CLI's `--json`
error document, `{"error": {"message", "field", "hint", "problems"?}}`; a body that does not match the request
schema is 422 in the same shape; a route or method that does not exist is 404 or 405 in the same shape; a body over
the size the route takes is 413, a request that ran longer than the server allows one is 503, both in the same shape;
anything else is a bug in tunecast, 500, still `{"error": …}`.

No request holds up another: estimates run in the worker's threads (serve/jobs.py), each stopped when its client
leaves or its time runs out; the catalog, the model search and health are answered on the event loop from what the
server keeps, without waiting for a thread.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tunecast.catalog.store import Catalog, load_catalog
from tunecast.config.messages import dotted
from tunecast.errors import Problem, TunecastError, error_document
from tunecast.estimate import replays
from tunecast.paths import default_user_catalog_dir
from tunecast.report.html import SORTABLE_JS
from tunecast.serve.bodies import BreakevenBody, DataBody, ExportBody, MemoryBody, ModelBody, PlanBody
from tunecast.serve.jobs import Job, Worker, encoded, internal_error, status_of
from tunecast.serve.service import Answer, Service
from tunecast.version import __version__, stamped

STATIC = Path(__file__).resolve().parent / "static"
LOG = logging.getLogger("tunecast.serve")
# A run config, its overrides and a model's config.json are kilobytes (the largest catalog config is 30 kB): a
# megabyte is room for all of them, and a body a hundred times larger (100,000 override keys cost 45 s of CPU to
# check) is refused before anything reads it.
BODY_BYTES = 1_000_000
# A dataset sample (/api/data) carries examples: the page sends at most this much of a file, cut at a line, and the
# lengths of the first tens of thousands of examples say what the whole file's do.
SAMPLE_BYTES = 16_000_000
LARGER_BODIES = {"/api/data": SAMPLE_BYTES}
# The longest one request may run. A cold trace of a 70B model's settings on a laptop CPU takes minutes; what takes
# longer than this is work for `tunecast plan` on the command line, not for a page waiting on an answer.
REQUEST_SECONDS = 600.0
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "A user error, as `--json` reports it: {\"error\": {\"message\", \"field\", \"hint\", "
                         "\"problems\"?}}"},
    422: {"description": "The body does not match the request schema: {\"error\": {…}} as for 400"},
    413: {"description": "The body is larger than the route takes: {\"error\": {…}} as for 400"},
    500: {"description": "A bug in tunecast: {\"error\": {…}}"},
    503: {"description": "The request ran longer than the server allows one, and was stopped: {\"error\": {…}}"},
}
STREAM: dict[int | str, dict[str, Any]] = {
    200: {"description": "application/x-ndjson: {\"event\": \"progress\", \"message\", \"kind\"} lines, then "
                         "{\"event\": \"result\", \"document\"} or {\"event\": \"error\", \"status\", \"error\"}",
          "content": {"application/x-ndjson": {}}}}


def plotly_js() -> Path | None:
    """plotly.js as the installed `plotly` package ships it (the page's charts), found without importing plotly."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


def document(answer: Answer | dict[str, Any], status: int = 200) -> Response:
    body = answer.body if isinstance(answer, Answer) else encoded(answer)
    return Response(content=body, status_code=status, media_type="application/json")


def _error(status: int, message: str, hint: str, *, field: str | None = None,
           problems: list[Problem] | None = None) -> Response:
    body: dict[str, Any] = {"message": message, "field": field, "hint": hint}
    if problems:
        body["problems"] = [p.as_dict() for p in problems]
    return document(stamped({"error": body}), status)


def _schema_problems(error: RequestValidationError) -> list[Problem]:
    problems = []
    for item in error.errors():
        location = tuple(part for part in item.get("loc", ()) if part != "body")
        field = dotted(location) if location else "body"
        problems.append(Problem(field, str(item.get("msg", "is not valid")),
                                "see the request schema in /openapi.json"))
    return problems


def create_app(catalog_dir: Path | None = None, *, catalog: Catalog | None = None,
               allowed_hosts: list[str] | None = None, threads: int = 4,
               timeout_s: float | None = REQUEST_SECONDS, offline: bool = False) -> FastAPI:
    """The application: the catalog of `catalog_dir` (default: the user catalog, as the CLI's `--catalog`), or
    `catalog` itself, loaded once. With `allowed_hosts`, requests naming another host are refused (a server on
    loopback answers no page that a DNS-rebinding site points at it). `timeout_s`: the longest one request may run
    (None: no limit). `offline`: a model outside the catalog is never fetched from the Hugging Face Hub (HF_HUB_OFFLINE
    does the same); else its config.json is, as on the command line."""
    directory = (catalog_dir if catalog_dir is not None else default_user_catalog_dir()).expanduser().resolve()
    if catalog is None:
        catalog = load_catalog(directory)
    service = Service(catalog, directory, offline=offline)
    worker = Worker(threads, timeout_s=timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # the estimates' replays are kept in this process and written to the cache once, when the server stops, not
        # after every plan (a file each, rewritten whole: tens of milliseconds of every request)
        with replays.deferred():
            yield
        worker.close()

    # no /docs or /redoc: FastAPI's pages for them load scripts from a CDN; nothing here loads from the internet
    app = FastAPI(title="tunecast", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Plan, price and size LLM fine-tunes: the documents of `tunecast plan`, `memory`, "
                              "`data` and `breakeven --json`, for the web planner.")
    app.state.service = service
    app.state.worker = worker
    app.add_middleware(BodyLimit, limit=BODY_BYTES, larger=LARGER_BODIES)
    if allowed_hosts is not None:  # added last, so checked first
        app.add_middleware(KnownHosts, hosts=frozenset(h.lower() for h in allowed_hosts))

    @app.exception_handler(TunecastError)
    async def user_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, TunecastError)
        return document(stamped(error_document(error)), status_of(error))

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        problems = _schema_problems(error)
        noun = "problem" if len(problems) == 1 else "problems"
        return _error(422, f"the request body does not match the schema of {request.method} {request.url.path}: "
                           f"{len(problems)} {noun}", "send a JSON body as /openapi.json describes it",
                      field=problems[0].field if problems else None, problems=problems)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        hint = {404: "see /openapi.json for the API's routes", 405: "see /openapi.json for the methods of each route"}
        return _error(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                      hint.get(error.status_code, "see /openapi.json"))

    @app.exception_handler(Exception)
    async def internal(_: Request, error: Exception) -> Response:
        LOG.error("internal error", exc_info=error)
        return document(stamped(internal_error(error)), 500)

    async def answered(work: Callable[[Job], Answer]) -> Response:
        return document(await worker.run(work))

    def streamed(work: Callable[[Job], Answer]) -> StreamingResponse:
        return StreamingResponse(worker.stream(lambda job: work(job).body), media_type="application/x-ndjson")

    # The page

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return _file(STATIC / "index.html")

    @app.get("/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name == "plotly.min.js":
            bundled = plotly_js()
            if bundled is not None:
                return FileResponse(bundled, media_type="text/javascript")
        if name == "sortable.js":  # the reports' table sorting, one script for both
            return FileResponse(SORTABLE_JS, media_type="text/javascript")
        path = (STATIC / name).resolve()
        if STATIC not in path.parents:
            return _error(404, f"no file {name!r} among the page's files", "see /")
        return _file(path)

    # The API

    @app.get("/api/health", summary="The server is up: its version, its catalog's, and its limits")
    async def health() -> Response:
        return document({**service.health(), "limits": {"body_bytes": BODY_BYTES, "sample_bytes": SAMPLE_BYTES,
                                                        "request_seconds": timeout_s}})

    @app.get("/api/catalog", summary="Models and GPUs as `tunecast models --json` and `gpus --json` list them; "
                                     "the offers' providers", responses=ERRORS)
    async def catalog_rows() -> Response:
        return document(service.catalog_answer())  # kept once made: answered here, never behind an estimate

    @app.get("/api/models", summary="`tunecast models --search TEXT --json`: catalog models matching what a person "
                                    "types (any case; spaces, dashes and dots alike; with or without the vendor)",
             responses=ERRORS)
    async def search_models(search: str = "", limit: int = 20) -> Response:
        return document(service.search_models(search, limit))

    @app.post("/api/models", summary="Add a dropped config.json to the catalog, as `tunecast models add` does; the "
                                     "answer's `model` goes in `model:`", responses=ERRORS)
    async def add_model(body: ModelBody) -> Response:
        return await answered(lambda _: Answer.of(service.add_model(body.config_json, body.name, body.file_name)))

    @app.post("/api/plan", summary="`tunecast plan --json` of the run", responses=ERRORS)
    async def plan(body: PlanBody) -> Response:
        return await answered(lambda job: service.plan(body.run(), body.options.model_dump(), job))

    @app.post("/api/plan/stream", summary="/api/plan with progress, cancelled when the connection closes",
              responses={**ERRORS, **STREAM})
    async def plan_stream(body: PlanBody) -> StreamingResponse:
        return streamed(lambda job: service.plan(body.run(), body.options.model_dump(), job))

    @app.post("/api/memory", summary="`tunecast memory --json` of the run", responses=ERRORS)
    async def memory(body: MemoryBody) -> Response:
        return await answered(lambda job: service.memory(body.run(), body.options.model_dump(), job))

    @app.post("/api/memory/stream", summary="/api/memory with progress, cancelled when the connection closes",
              responses={**ERRORS, **STREAM})
    async def memory_stream(body: MemoryBody) -> StreamingResponse:
        return streamed(lambda job: service.memory(body.run(), body.options.model_dump(), job))

    @app.post("/api/data", summary="`tunecast data --json` of a sample file, counted as the run says",
              responses=ERRORS)
    async def data(body: DataBody) -> Response:
        return await answered(lambda job: service.data(body.run(), body.sample.name, body.sample.text, job))

    @app.post("/api/breakeven", summary="`tunecast breakeven --json`; with a run, `--run` of it", responses=ERRORS)
    async def breakeven(body: BreakevenBody) -> Response:
        return await answered(lambda job: service.breakeven(body.run(), body.options.model_dump(), job))

    @app.post("/api/export", summary="The run as a YAML file that `tunecast plan FILE` plans identically",
              responses=ERRORS)
    async def export(body: ExportBody) -> Response:
        return await answered(lambda _: service.export(body.run(), body.options.model_dump()))

    return app


class BodyLimit:
    """Refuses a request body over `limit` bytes (`larger` for the paths that take more) with a JSON 413, before the
    application parses it: by its Content-Length when it says, else as it arrives. A body within the limit is handed
    on whole."""

    def __init__(self, app: ASGIApp, limit: int, larger: dict[str, int]) -> None:
        self.app = app
        self.limit = limit
        self.larger = larger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.larger.get(scope["path"], self.limit)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, int(declared), limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(scope, receive, send, size, limit)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        handed = False

        async def replayed() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client leaving (a stream's cancel)

        await self.app(scope, replayed, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, size: int, limit: int) -> None:
        refused = _error(413, f"the request body is over the {limit:,} bytes that {scope['method']} {scope['path']} "
                              f"takes ({size:,} or more)", "send a smaller body: a run config and its overrides are "
                              "a few kilobytes, a model's config.json tens; a dataset sample is cut at a line",
                         field="body")
        await refused(scope, receive, send)


class KnownHosts:
    """Refuses a request whose Host header names another host than the server's (JSON 400): a page elsewhere that
    a DNS-rebinding name points at a loopback server gets no answer from it."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            named = host_name(Headers(scope=scope).get("host", ""))
            if named not in self.hosts:
                refused = _error(400, f"this server answers for {', '.join(sorted(self.hosts))}, not {named!r}",
                                 "open the page at the address `tunecast serve` printed", field="Host")
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(header: str) -> str:
    """The host a Host header names, without its port: `127.0.0.1:8000` → `127.0.0.1`, `[::1]:8000` → `::1`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _file(path: Path) -> Response:
    if not path.is_file():
        return _error(404, f"{path.name} is not among the page's files", "reinstall tunecast: the page ships with it")
    return FileResponse(path)

