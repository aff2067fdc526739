"""`tunecast serve`'s page (src/tunecast/serve/static/) in headless Chromium against a real server, started once for
the module as users start it: the page asks nothing of anywhere but the server and logs no error, plans as its
inputs change, restores a state from its URL, exports a YAML that `tunecast plan` plans identically, shows each API
error next to the input it names, measures a sample file and takes a dropped config.json, and cancels a long
estimate. Screenshots are kept in test-artifacts/ (tests/browser.py ARTIFACTS).

The model is Qwen/Qwen3-0.6B: its step templates ship with tunecast, so a plan takes a couple of seconds on two
cores; the long estimate is a DoRA run of it, which has no shipped template and traces for about a minute."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlparse

import pytest
from tests.browser import ARTIFACTS, CHARTS, chromium
from tests.conftest import PYTHON, REPO

MODEL = "Qwen/Qwen3-0.6B"
BASE = {"model": MODEL, "dataset.examples": "20000", "dataset.mean_tokens": "600"}
LONG = "lora:\n  dora: true\n"  # no shipped template: the estimate traces the model for about a minute
CHART_NAMES = {"memory-selected", "memory-per-gpu", "cost-vs-time", "rent-vs-buy"}
PLAN_MS = 90_000  # milliseconds a plan may take on a busy 2-core machine (about 3 s alone)
STATIC = REPO / "src" / "tunecast" / "serve" / "static"


@dataclass
class Server:
    url: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`tunecast serve --port PORT --no-open` in its own process, with its own empty catalog and cache (as every
    test's, tests/conftest.py); stopped after the module."""
    from tunecast.launch.local import free_port

    home = tmp_path_factory.mktemp("serve-home")
    env = {key: value for key, value in os.environ.items() if key not in ("TUNECAST_DEBUG", "HF_TOKEN")}
    env.update({"TUNECAST_CATALOG": str(home / "catalog"), "TUNECAST_CACHE": str(home / "cache")})
    port = free_port()
    log_path = home / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([PYTHON, "-m", "tunecast", "serve", "--port", str(port), "--no-open"], env=env,
                                   cwd=home, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, f"tunecast serve exited: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"tunecast serve did not answer: {log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(url + "/api/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        yield Server(url, env)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class Tab:
    page: Any
    server: Server
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions

    def open(self, query: dict[str, str]) -> dict[str, Any]:
        """Load the page with this query string and return the plan document it showed."""
        self.page.goto(self.server.url + "/?" + urlencode(query))
        return planned(self.page, 0)

    def foreign(self) -> list[str]:
        """Requests to anywhere but the server (a download's blob: URL and a data: URL are the page's own)."""
        own = urlparse(self.server.url).netloc
        return [url for url in self.requests
                if not (urlparse(url).netloc == own or url.startswith(f"blob:{self.server.url}/")
                        or url.startswith("data:"))]

    def errors_but_bad_requests(self) -> list[str]:
        """Console errors, less Chromium's own line for each answer of status 400 (an API error the page shows)."""
        return [error for error in self.errors if "status of 400" not in error]

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture
def tab(browser: Any, server: Server) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    opened = Tab(page, server)
    page.on("request", lambda request: opened.requests.append(request.url))
    page.on("console", lambda message: opened.errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: opened.errors.append(str(error)))
    try:
        yield opened
    finally:
        context.close()


def plans(page: Any) -> int:
    return int(page.evaluate("Number(document.body.dataset.plans || 0)"))


def planned(page: Any, before: int) -> dict[str, Any]:
    """Wait for the page to show a plan newer than its `before`-th, and return that plan's document."""
    page.wait_for_function(f"Number(document.body.dataset.plans || 0) > {before} && "
                           "document.body.dataset.status === 'done'", timeout=PLAN_MS)
    return page.evaluate("window.tunecastPage.plan")  # type: ignore[no-any-return]


def failed(page: Any) -> None:
    page.wait_for_function("document.body.dataset.status === 'error'", timeout=PLAN_MS)


def rows(page: Any) -> list[list[str]]:
    return page.evaluate("""Array.from(document.querySelectorAll('table[data-table=options] tbody tr'))
                            .map(r => Array.from(r.cells).map(c => c.textContent))""")  # type: ignore[no-any-return]


def priced(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in document["options"] if o["total_usd"] is not None]


def gpus_text(option: dict[str, Any]) -> str:
    from tunecast.plan.planner import gpus_text as text

    return text(option)


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


def test_the_static_files_name_nothing_to_load_from_elsewhere() -> None:
    for name in ("index.html", "app.js", "app.css"):
        text = (STATIC / name).read_text()
        assert "http://" not in text and "https://" not in text and "@import" not in text, name


def test_the_page_plans_offline_and_draws_every_chart(tab: Tab) -> None:
    document = tab.open(BASE)
    page = tab.page
    assert document["model"]["name"] == MODEL and document["dataset"]["examples"] == 20000
    options = priced(document)
    shown = rows(page)
    assert len(shown) == min(50, len(options)) and len(options) > 10
    for row, option in zip(shown, options, strict=False):
        assert row[1] == gpus_text(option) and row[2] == option["provider"]
        assert row[10] == f"${option['total_usd']:,.2f}" and row[9] == f"{option['hours']:.2f}"
        assert row[5] == f"{option['micro_batch']}×{option['grad_accum']}"
    assert page.locator("#recommendations p").all_inner_texts() == document["recommendations"]
    page.wait_for_function("window.tunecastPage.breakeven !== null")
    page.wait_for_timeout(300)  # the last chart draws as its answer arrives
    charts = {chart["name"]: chart for chart in page.evaluate(CHARTS)}
    assert set(charts) == CHART_NAMES
    for name, drawn in charts.items():
        assert drawn["width"] > 300 and drawn["height"] > 150 and drawn["marks"] > 0, (name, drawn)
    best = options[0]
    title = page.locator("#memory-title").inner_text()
    assert gpus_text(best) in title and f"{best['device_total_gib']:.1f} of {best['capacity_gib']:.1f} GiB" in title
    breakeven = page.evaluate("window.tunecastPage.breakeven")
    assert breakeven["purchase_usd"] > 0 and breakeven["work"]["owned_hours_per_run"] > 0
    text = page.locator("#rent-text").inner_text()
    assert f"pays for itself after {breakeven['breakeven_hours']:,.0f} hours of use" in text
    assert f"buying pays off after {breakeven['work']['breakeven_runs']:.1f} runs" in text
    assert tab.shot("serve-page").stat().st_size > 50_000
    page.locator("table[data-table=options] th", has_text="hours").click()  # report/sortable.js, the reports' own
    hours = [float(row[9]) for row in rows(page)]
    assert hours == sorted(hours) and hours != [float(row[9]) for row in shown]
    assert tab.foreign() == [] and tab.errors == []
    assert any(url.endswith("/static/plotly.min.js") for url in tab.requests)


def test_changing_inputs_changes_the_ranking(tab: Tab) -> None:
    page = tab.page
    first = tab.open({**BASE, "method": "lora"})
    first_rows = rows(page)

    before = plans(page)
    page.select_option("#method", "qlora")
    qlora = planned(page, before)
    assert qlora["spec"]["method"] == "qlora" and "method=qlora" in page.url
    assert priced(qlora)[0]["memory_breakdown_gib"]["weights"] < priced(first)[0]["memory_breakdown_gib"]["weights"]
    assert rows(page) != first_rows

    assert any(o["spot"] for o in priced(qlora)), "the catalog has spot offers for this run"
    before = plans(page)
    page.select_option("#spot", "false")
    on_demand = planned(page, before)
    assert on_demand["spec"]["pricing"]["spot"] is False and "pricing.spot=false" in page.url
    assert not any(o["spot"] for o in on_demand["options"])
    assert {row[3] for row in rows(page)} == {"on-demand"}

    before = plans(page)
    page.locator("#seq-len").press_sequentially("2048", delay=60)  # one plan for the four keys (debounced)
    longer = planned(page, before)
    assert longer["spec"]["seq_len"] == 2048 and plans(page) == before + 1
    assert priced(longer)[0]["device_total_gib"] != priced(on_demand)[0]["device_total_gib"] or \
        priced(longer)[0]["hours"] != priced(on_demand)[0]["hours"]

    before = plans(page)
    page.fill("#model", "Qwen/Qwen3-1.7B")
    bigger = planned(page, before)
    assert bigger["model"]["name"] == "Qwen/Qwen3-1.7B" and bigger["model"]["params"] > first["model"]["params"]
    assert rows(page)[0][10] == f"${priced(bigger)[0]['total_usd']:,.2f}"
    assert page.locator("#model-facts").inner_text().startswith("1.72 B parameters · 28 layers")

    cheapest = priced(bigger)[0]["total_usd"]
    budget = round(cheapest * 1.5, 2)
    before = plans(page)
    page.fill("#budget", str(budget))
    within = planned(page, before)
    assert within["filtered_out"] > 0 and f"plan.budget_usd={budget}" in page.url
    assert max(o["total_usd"] for o in priced(within)) <= budget and len(rows(page)) == len(priced(within))
    tab.shot("serve-page-changed")
    assert tab.foreign() == [] and tab.errors == []


def test_a_url_restores_its_state(tab: Tab, browser: Any) -> None:
    page = tab.page
    tab.open({**BASE, "lora.rank": "16"})
    before = plans(page)
    page.select_option("#method", "qlora")
    planned(page, before)
    before = plans(page)
    page.locator("#providers-box summary").click()
    page.locator("#providers input[value=runpod]").check()
    page.locator("#providers input[value=lambda]").check()
    document = planned(page, before)
    assert {o["provider"] for o in priced(document)} <= {"runpod", "lambda"}
    page.locator("table[data-table=options] tbody tr").nth(2).click()
    selected_key = page.locator("table[data-table=options] tbody tr.selected").get_attribute("data-key")
    title = page.locator("#memory-title").inner_text()
    assert gpus_text(priced(document)[2]) in title
    url = page.url

    again = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    again.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    try:
        again.goto(url)
        restored = planned(again, 0)
        again.wait_for_function("window.tunecastPage.catalog !== null")  # the providers' boxes come with it
        assert restored["options"] == document["options"] and restored["spec"] == document["spec"]
        assert again.input_value("#method") == "qlora" and again.input_value("#lora-rank") == "16"
        assert again.input_value("#model") == MODEL and again.input_value("#examples") == "20000"
        assert again.evaluate("Array.from(document.querySelectorAll('#providers input:checked')).map(b => b.value)"
                              ".sort()") == ["lambda", "runpod"]
        assert again.locator("table[data-table=options] tbody tr.selected").get_attribute("data-key") == selected_key
        assert again.locator("#memory-title").inner_text() == title
        assert errors == []
    finally:
        again.close()

    before = plans(page)
    page.go_back()  # the state before the providers were chosen: its URL, its inputs, its plan
    back = planned(page, before)
    assert "pricing.providers" not in page.url and back["spec"]["pricing"]["providers"] == []
    assert page.input_value("#method") == "qlora"
    assert tab.foreign() == [] and tab.errors == []


def test_export_yaml_plans_the_same_with_tunecast_plan(tab: Tab, tmp_path: Path) -> None:
    """The export is the page's whole plan: with its ranking by hours and its budget (a link from before they were
    RunSpec keys names them `optimize` and `budget_usd`: still read), `tunecast plan` on it lists the same options in
    the same order."""
    page = tab.page
    shape = {**BASE, "method": "qlora", "lora.rank": "16", "lora.alpha": "32", "seq_len": "2048",
             "global_batch": "16", "pricing.spot": "false"}
    everything = tab.open(shape)
    totals = sorted(o["total_usd"] for o in priced(everything))
    document = tab.open({**shape, "optimize": "time", "budget_usd": str(totals[len(totals) // 3])})
    assert page.input_value("#optimize") == "time" and document["optimize"] == "time"
    assert document["filtered_out"] > 0 and document["spec"]["plan"]["budget_usd"] == totals[len(totals) // 3]
    with page.expect_download() as download:
        page.click("#export")
    text = Path(download.value.path()).read_text()
    assert text == page.evaluate("window.tunecastPage.exported") == page.locator("#export-yaml").inner_text()
    config = tmp_path / "run.yaml"
    config.write_text(text)
    done = subprocess.run([PYTHON, "-m", "tunecast", "plan", str(config), "--json"], capture_output=True, text=True,
                          env=tab.server.env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    cli = json.loads(done.stdout)
    assert len(cli["options"]) == len(document["options"]) < len(everything["options"])
    assert cli["options"] == document["options"] and cli["recommendations"] == document["recommendations"]
    assert cli["spec"] == document["spec"] and cli["dataset"] == document["dataset"]
    # the page's plan is the API's: the streamed document is the one POST /api/plan answers to the same request
    assert post(tab.server, "/api/plan", page.evaluate("window.tunecastPage.planBody"))["options"] == \
        document["options"]
    tab.shot("serve-page-exported")
    assert tab.foreign() == [] and tab.errors == []


def test_api_errors_show_next_to_the_input_they_name(tab: Tab) -> None:
    page = tab.page
    tab.open(BASE)
    page.fill("#seq-len", "0")
    failed(page)
    slot = page.locator("[data-error-for=seq_len]")
    assert slot.is_visible() and "must be ≥ 1" in slot.inner_text() and "seq_len" in slot.inner_text()
    assert page.get_attribute("#seq-len", "aria-invalid") == "true"
    assert page.locator("#general-error").is_hidden()

    page.fill("#seq-len", "")
    page.fill("#model", "Qwen/Qwen3-0.6Bx")
    failed(page)
    slot = page.locator("[data-error-for=model]")
    assert "unknown model" in slot.inner_text() and "Did you mean 'Qwen/Qwen3-0.6B'" in slot.inner_text()
    assert page.locator("[data-error-for=seq_len]").is_hidden()

    page.fill("#model", MODEL)
    page.fill("#examples", "")
    failed(page)
    assert "is needed with dataset.mean_tokens" in page.locator("[data-error-for='dataset.examples']").inner_text()
    page.fill("#mean-tokens", "")
    failed(page)
    assert "dataset's size" in page.locator("[data-error-for=dataset]").inner_text()
    tab.shot("serve-page-error")

    before = plans(page)
    page.fill("#examples", "20000")
    page.fill("#mean-tokens", "600")
    planned(page, before)
    assert page.locator(".field-error:visible").count() == 0
    assert tab.foreign() == [] and tab.errors_but_bad_requests() == []


def test_a_sample_file_and_a_dropped_config_json(tab: Tab) -> None:
    page = tab.page
    tab.open(BASE)
    lines = [json.dumps({"prompt": f"Question {i}: " + "word " * (5 * i), "completion": " answer" * (20 + i)})
             for i in range(40)]
    before = plans(page)
    page.set_input_files("#sample-file", files=[{"name": "train.jsonl", "mimeType": "application/x-ndjson",
                                                 "buffer": ("\n".join(lines) + "\n").encode()}])
    document = planned(page, before)
    sample = page.evaluate("window.tunecastPage.sample")
    assert sample["examples"] == 40 and sample["format"] == "prompt-completion"
    assert page.locator("#sample-stats").is_visible() and "prompt-completion" in page.locator("#sample-stats").inner_text()
    mean = round(sample["total_tokens"] / sample["examples"], 1)
    assert page.input_value("#mean-tokens") == f"{mean:g}" and document["spec"]["dataset"]["mean_tokens"] == mean
    assert page.input_value("#examples") == "20000", "a sample is not the whole dataset: its declared size is kept"

    # the catalog's config of the model, saved under another name (as a copy of it would be)
    catalog_config = json.loads((REPO / "src" / "tunecast" / "catalog" / "data" / "models" /
                                 "Qwen__Qwen3-0.6B.json").read_text())
    before = plans(page)
    copy = json.dumps({**catalog_config, "_name_or_path": "my-org/qwen-copy"}).encode()
    page.set_input_files("#config-file", files=[{"name": "config.json", "mimeType": "application/json",
                                                 "buffer": copy}])
    dropped = planned(page, before)
    assert page.input_value("#model") == "my-org/qwen-copy" and "model=my-org%2Fqwen-copy" in page.url
    assert dropped["model"] == {"name": "my-org/qwen-copy", "params": document["model"]["params"]}
    assert page.locator("#model-facts").inner_text().startswith("0.60 B parameters · 28 layers")
    # the catalog's own config.json of the same model: the same memory and speed on every card
    def estimates(plan: dict[str, Any]) -> dict[tuple[str, int], tuple[float, float]]:
        return {(o["gpu"], o["gpu_count"]): (o["device_total_gib"], o["tokens_per_second"]) for o in priced(plan)}

    assert estimates(dropped) == estimates(document)
    assert tab.foreign() == [] and tab.errors == []


def test_a_long_estimate_shows_progress_and_cancels(tab: Tab) -> None:
    page = tab.page
    page.goto(tab.server.url + "/?" + urlencode({**BASE, "config": LONG}))
    page.wait_for_function("document.body.dataset.status === 'busy'", timeout=30_000)
    assert page.locator("#base-config").input_value() == LONG and page.locator("#cancel").is_visible()
    page.wait_for_function("document.querySelector('#status-text').textContent !== 'Planning…'", timeout=60_000)
    tab.shot("serve-page-progress")
    page.click("#cancel")
    page.wait_for_function("document.body.dataset.status === 'cancelled'", timeout=5_000)
    assert page.locator("#cancel").is_hidden() and page.evaluate("window.tunecastPage.plan") is None

    started = time.monotonic()
    page.fill("#base-config", "")
    document = planned(page, 0)
    assert document["spec"]["lora"]["dora"] is False
    assert time.monotonic() - started < 60, "the cancelled estimate no longer holds the server"
    assert tab.foreign() == [] and tab.errors == []


def test_on_a_phone_a_search_old_prices_ticks_and_a_huge_batch(browser: Any, server: Server) -> None:
    """One page load at a phone's width: the page never scrolls sideways, a model typed as people type it is found,
    old prices are marked, the log axes say their units, and a global batch of 32 billion (a typo away from 32) holds
    up neither the catalog nor the corrected plan."""
    context = browser.new_context(viewport={"width": 375, "height": 800}, is_mobile=True)
    page = context.new_page()
    opened = Tab(page, server)
    page.on("console", lambda message: opened.errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: opened.errors.append(str(error)))
    try:
        document = opened.open(BASE)
        page.wait_for_timeout(300)  # the charts draw as their answers arrive
        assert page.evaluate("document.documentElement.scrollWidth") <= 375, "the page scrolls sideways"
        ticks = page.evaluate("Array.from(document.querySelectorAll('#chart-cost-vs-time .xtick text'))"
                              ".map(t => t.textContent)")
        costs = page.evaluate("Array.from(document.querySelectorAll('#chart-cost-vs-time .ytick text'))"
                              ".map(t => t.textContent)")
        assert ticks and all(t.endswith(" h") for t in ticks), ticks
        assert costs and all(t.startswith("$") for t in costs), costs
        stale = [o for o in priced(document)[:50] if o["price_stale"]]
        assert stale, "the bundled catalog has list prices older than 30 days (thunder-compute's, of 2026-06-21)"
        marked = [row for row in rows(page) if row[4].endswith("*")]
        assert len(marked) == len(stale) and page.locator("#stale-note").is_visible()
        assert "a list price's after 30 days" in page.locator("#stale-note").inner_text()
        opened.shot("serve-page-phone")

        page.fill("#model", "")
        page.locator("#model").press_sequentially("Llama 3.1 8B", delay=20)
        first = page.locator("#model-matches button").first
        first.wait_for(timeout=10_000)
        assert first.get_attribute("data-name") == "meta-llama/Llama-3.1-8B"
        before = plans(page)
        first.click()
        assert page.input_value("#model") == "meta-llama/Llama-3.1-8B" and page.locator("#model-matches").is_hidden()
        assert planned(page, before)["model"]["name"] == "meta-llama/Llama-3.1-8B"

        before = plans(page)
        page.fill("#global-batch", "32000000000")
        page.wait_for_function("document.body.dataset.status === 'busy' || document.body.dataset.status === 'error'",
                               timeout=10_000)
        started = time.monotonic()
        assert page.evaluate("fetch('/api/catalog').then(r => r.status)") == 200
        assert time.monotonic() - started < 1.0, "the catalog waited for the huge plan"
        page.fill("#global-batch", "32")
        corrected = planned(page, before)
        assert corrected["global_batch"] == 32 and time.monotonic() - started < 30
        assert opened.errors_but_bad_requests() == []
    finally:
        context.close()
