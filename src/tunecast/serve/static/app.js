/* The planner page of `tunecast serve`: inputs → the JSON API (the same documents as `tunecast … --json`) → the
   ranked options, memory, cost against time, rent or buy.

   How the page holds together:
   * The state is the form. Every input carries `name` (its RunSpec key as `--set` takes it: `lora.rank`, and the
     ranking, budget and deadline as `plan.optimize`, `plan.budget_usd`, `plan.deadline_hours`, so that an exported
     config plans as the page does) and `data-group`: `set` (sent as `overrides`), `config` (the base YAML the
     overrides apply to) or `breakeven` (rent or buy). An empty input is a key left unset: the page writes no default
     of its own; after a plan, each input's placeholder shows the value the plan resolved (`spec` of the plan
     document).
   * The URL's query string is the state: the inputs' names and values, and `option` for the selected row. Loading a
     URL fills the inputs and plans; each committed change is a history entry.
   * A change waits DEBOUNCE_MS for the next; then one plan request, on the NDJSON stream endpoint so that its progress
     shows and Cancel can abort it (closing the connection stops the estimate on the server). A newer request aborts
     the older, and an answer to anything but the newest request is dropped.
   * A 400 answer carries the CLI's error document: each problem is shown next to the input its `field` names
     (`[data-error-for]`), or above the results when no input matches.
   Colours: the Okabe–Ito palette, as the HTML reports (src/tunecast/report/html.py). */
(function () {
  "use strict";

  var PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#F0E442", "#000000"];
  // memory categories: the palette but black (the capacity line's), then grey; one colour per category in both charts
  var CATEGORY_COLOURS = PALETTE.slice(0, 7).concat(["#999999", "#7f3b08", "#2d004b"]);
  var DEBOUNCE_MS = 400;
  var TABLE_ROWS = 50;
  var MONTHS_SHOWN = 36;  // the plan report's rent-or-buy horizon
  var MATCHES_SHOWN = 8;  // catalog models listed under the model input as it is typed
  // query names of links made before the ranking inputs became RunSpec keys: still read
  var OLD_NAMES = {"optimize": "plan.optimize", "budget_usd": "plan.budget_usd", "deadline_hours": "plan.deadline_hours"};
  var PLOT_CONFIG = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["sendDataToCloud"]};

  var $ = function (selector) { return document.querySelector(selector); };
  var $$ = function (selector) { return Array.prototype.slice.call(document.querySelectorAll(selector)); };

  // What the page knows; `window.tunecastPage` lets a test (or a curious reader in the console) see it.
  var page = {
    catalog: null,  // GET /api/catalog
    plan: null,  // the last plan document shown
    planBody: null,  // the request it answered
    breakeven: null,  // the last rent-or-buy document shown
    exported: null,  // the last exported YAML
    sample: null,  // the last sample's statistics (POST /api/data)
    limits: null,  // the server's limits (GET /api/health): the largest sample it takes
    plans: 0,  // plans rendered so far
  };
  window.tunecastPage = page;

  var timer = null, breakevenTimer = null;
  var planSeq = 0, planAbort = null;
  var breakevenSeq = 0, breakevenAbort = null;
  var showAll = false;

  // ---------------------------------------------------------------------------------------------------- the state

  function inputs(group) {
    return $$("[data-group]").filter(function (el) { return !group || el.dataset.group === group; });
  }

  // The value an input stands for, typed as the API wants it; undefined when empty (the key is left unset).
  function valueOf(el) {
    var raw = el.value.trim();
    if (raw === "") { return undefined; }
    switch (el.dataset.type) {
      case "int": return /^-?\d+$/.test(raw) ? parseInt(raw, 10) : raw;
      case "float": return isNaN(Number(raw)) ? raw : Number(raw);
      case "bool": return raw === "true";
      default: return el.dataset.group === "config" ? el.value : raw;
    }
  }

  // The providers ticked; before the catalog has listed them, the ones the URL named.
  function checkedProviders() {
    var boxes = $$("#providers input");
    if (!boxes.length) { return (page.wantedProviders || []).slice(); }
    return boxes.filter(function (box) { return box.checked; }).map(function (box) { return box.value; });
  }

  function readState() {
    var state = {config: "", set: {}, options: {}, breakeven: {}, option: page.selectedKey || null};
    inputs().forEach(function (el) {
      var value = valueOf(el);
      if (value === undefined) { return; }
      if (el.dataset.group === "config") { state.config = value; } else { state[el.dataset.group][el.name] = value; }
    });
    var providers = checkedProviders();
    if (providers.length) { state.set["pricing.providers"] = providers; }
    return state;
  }

  function runBody(state) {
    return {config: state.config, overrides: state.set};
  }

  // The plan's ranking, budget and deadline are RunSpec keys among the overrides: no options beside them.
  function planBody(state) {
    var body = runBody(state);
    body.options = {};
    return body;
  }

  // state ⇄ query string: an input's name and its text as typed; providers as a comma list
  function toQuery(state) {
    var params = new URLSearchParams();
    inputs().forEach(function (el) {
      var first = el.tagName === "SELECT" ? el.options[0].value : "";
      if (el.value.trim() !== "" && el.value !== first) {
        params.set(el.name, el.dataset.group === "config" ? el.value : el.value.trim());
      }
    });
    var providers = checkedProviders();
    if (providers.length) { params.set("pricing.providers", providers.join(",")); }
    if (state.option) { params.set("option", state.option); }
    var text = params.toString();
    return text ? "?" + text : location.pathname;
  }

  function fromQuery(search) {
    var params = new URLSearchParams(search);
    Object.keys(OLD_NAMES).forEach(function (old) {
      if (params.has(old) && !params.has(OLD_NAMES[old])) { params.set(OLD_NAMES[old], params.get(old)); }
    });
    inputs().forEach(function (el) {
      var value = params.get(el.name);
      if (el.tagName === "SELECT") {
        if (value !== null && !Array.prototype.some.call(el.options, function (o) { return o.value === value; })) {
          addOption(el, value, value);  // a GPU the catalog has not listed yet; the plan says if it is unknown
        }
        el.value = value === null ? el.options[0].value : value;
      } else {
        el.value = value === null ? "" : value;
      }
    });
    var providers = (params.get("pricing.providers") || "").split(",").filter(Boolean);
    var boxes = $$("#providers input");
    page.wantedProviders = boxes.length ? null : providers;
    if (boxes.length) {
      providers.forEach(function (name) {
        if (!boxes.some(function (box) { return box.value === name; })) { boxes.push(providerBox(name, null)); }
      });
    }
    boxes.forEach(function (box) { box.checked = providers.indexOf(box.value) >= 0; });
    providersSummary();
    page.selectedKey = params.get("option");
    if (params.get("config")) { $("#base-box").open = true; }
    showLora();
    modelFacts();
  }

  function addOption(select, value, text) {
    var option = document.createElement("option");
    option.value = value;
    option.textContent = text;
    select.appendChild(option);
    return option;
  }

  // --------------------------------------------------------------------------------------------------- requests

  function postJson(url, body, signal) {
    return fetch(url, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
                       signal: signal}).then(function (response) {
      return response.text().then(function (text) {
        var doc;
        try { doc = JSON.parse(text); } catch (e) {
          doc = {error: {message: "tunecast answered " + response.status + " with something that is not JSON",
                         field: null, hint: text.slice(0, 200)}};
        }
        return {ok: response.ok, status: response.status, doc: doc};
      });
    });
  }

  // POST to an NDJSON endpoint: `onProgress(message)` for each progress line; resolves {document} or {error}.
  function postStream(url, body, signal, onProgress) {
    return fetch(url, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
                       signal: signal}).then(function (response) {
      if (!response.ok) {
        return response.text().then(function (text) {
          try { return {error: JSON.parse(text).error, status: response.status}; } catch (e) {
            return {error: {message: "tunecast answered " + response.status, field: null, hint: text.slice(0, 200)},
                    status: response.status};
          }
        });
      }
      var reader = response.body.getReader();
      var decoder = new TextDecoder();
      var buffer = "";
      function handle(line) {
        if (!line.trim()) { return null; }
        var event = JSON.parse(line);
        if (event.event === "progress") { onProgress(event.message); return null; }
        if (event.event === "result") { return {document: event.document}; }
        if (event.event === "error") { return {error: event.error, status: event.status}; }
        return null;
      }
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) {
            var last = handle(buffer + decoder.decode());
            if (last) { return last; }
            throw new Error("the answer ended before its result");
          }
          buffer += decoder.decode(chunk.value, {stream: true});
          var lines = buffer.split("\n");
          buffer = lines.pop();
          for (var i = 0; i < lines.length; i++) {
            var outcome = handle(lines[i]);
            if (outcome) { reader.cancel().catch(function () {}); return outcome; }
          }
          return pump();
        });
      }
      return pump();
    });
  }

  // ------------------------------------------------------------------------------------------------ the status

  function setStatus(kind, text) {
    document.body.dataset.status = kind;  // idle | pending | busy | done | error | cancelled
    $("#status").classList.toggle("busy", kind === "busy");
    $("#status-text").textContent = text;
    $("#cancel").hidden = kind !== "busy";
    $("#replan").hidden = kind !== "cancelled" && kind !== "error";
    $("#results").classList.toggle("stale", kind !== "done" && kind !== "idle");
  }

  // ---------------------------------------------------------------------------------------------------- errors

  // The `[data-error-for]` slot a problem's field belongs to, within `scope` (the plan's inputs, or a panel's).
  function slotFor(field, location, scope) {
    if (scope === "breakeven") { return $("[data-error-for=breakeven]"); }
    if (scope === "sample") { return $("[data-error-for=sample]"); }
    if (scope === "model-file") { return $("[data-error-for=config_json]"); }
    if (location && /^line\b/.test(location) && $("#base-config").value.trim()) {
      return $("[data-error-for=config]");  // a problem in the base YAML, not in an input
    }
    if (!field) { return null; }
    var key = String(field).replace(/\[[^\]]*\]/g, "").replace(/^--/, "");
    var flag = key.replace(/-/g, "_");
    var tries = [key, flag];
    var parts = key.split(".");
    for (var n = parts.length - 1; n > 0; n--) { tries.push(parts.slice(0, n).join(".")); }
    for (var i = 0; i < tries.length; i++) {
      var exact = document.querySelector('[data-error-for="' + CSS.escape(tries[i]) + '"]');
      if (exact) { return exact; }
    }
    var under = $$("[data-error-for]").filter(function (slot) { return slot.dataset.errorFor.indexOf(key + ".") === 0; });
    return under.length ? under[0] : null;
  }

  function clearErrors(scope) {
    var slots = scope === "breakeven" ? ["breakeven"] : scope === "sample" ? ["sample"] :
      scope === "model-file" ? ["config_json"] : null;
    $$("[data-error-for]").forEach(function (slot) {
      var mine = slots ? slots.indexOf(slot.dataset.errorFor) >= 0 :
        ["breakeven", "sample", "config_json"].indexOf(slot.dataset.errorFor) < 0;
      if (mine) { slot.hidden = true; slot.textContent = ""; slot.className = "field-error"; }
    });
    if (!slots) {
      $$("[aria-invalid]").forEach(function (el) { el.removeAttribute("aria-invalid"); });
      $("#general-error").hidden = true;
      $("#general-error").textContent = "";
    }
  }

  function problemLine(problem, warning) {
    var line = document.createElement("span");
    line.className = "problem";
    var what = document.createElement("strong");
    var where = problem.location && /^line\b/.test(problem.location) ? problem.location + ": " : "";
    what.textContent = where + (problem.field ? problem.field + ": " : "") + problem.message;
    line.appendChild(what);
    if (problem.hint) {
      var hint = document.createElement("span");
      hint.className = "hint";
      hint.textContent = "→ " + problem.hint;
      line.appendChild(hint);
    }
    line.dataset.kind = warning ? "warning" : "error";
    return line;
  }

  function inputOf(slot) {
    var key = slot.dataset.errorFor;
    return key === "pricing.providers" ? $("#providers-box") : document.querySelector('[name="' + CSS.escape(key) + '"]');
  }

  function showProblems(error, scope, warning) {
    var problems = error.problems && error.problems.length ? error.problems : [error];
    problems.forEach(function (problem) {
      var slot = slotFor(problem.field, problem.location, scope);
      if (!slot) { slot = $("#general-error"); }
      slot.appendChild(problemLine(problem, warning));
      slot.hidden = false;
      if (slot.classList.contains("field-error") && warning) { slot.className = "field-warning"; }
      var el = slot.dataset.errorFor ? inputOf(slot) : null;
      if (el && !warning) { el.setAttribute("aria-invalid", "true"); }
      if (el && el.closest("details")) { el.closest("details").open = true; }
    });
  }

  // ------------------------------------------------------------------------------------------------- planning

  function hasModel(state) {
    return state.set.model !== undefined || /^\s*model\s*:/m.test(state.config);
  }

  function schedule() {
    clearTimeout(timer);
    setStatus("pending", "Waiting for the inputs to settle…");
    timer = setTimeout(commit, DEBOUNCE_MS);
  }

  function commit() {
    clearTimeout(timer);
    var state = readState();
    var query = toQuery(state);
    if (query !== location.search && !(query === location.pathname && !location.search)) {
      history.pushState(null, "", query);
    }
    plan(state);
  }

  function plan(state) {
    var seq = ++planSeq;
    if (planAbort) { planAbort.abort(); }
    if (breakevenAbort) { breakevenAbort.abort(); }
    clearErrors("plan");
    if (!hasModel(state)) {
      planAbort = null;
      setStatus("idle", "Pick a model and declare the dataset (examples × mean tokens) to see a plan.");
      return Promise.resolve();
    }
    var controller = new AbortController();
    planAbort = controller;
    var body = planBody(state);
    setStatus("busy", "Planning…");
    return postStream("/api/plan/stream", body, controller.signal, function (message) {
      if (seq === planSeq) { setStatus("busy", message); }
    }).then(function (outcome) {
      if (seq !== planSeq) { return; }  // a newer request is on its way: this answer is stale
      planAbort = null;
      if (outcome.error) {
        showProblems(outcome.error, "plan");
        setStatus("error", "The plan could not be made: " + outcome.error.message);
        return;
      }
      page.plan = outcome.document;
      page.planBody = body;
      render(outcome.document);
      page.plans += 1;
      document.body.dataset.plans = String(page.plans);
      setStatus("done", "Planned " + new Date().toLocaleTimeString() + ".");
    }).catch(function (failure) {
      if (seq !== planSeq) { return; }
      planAbort = null;
      if (failure.name === "AbortError") {
        setStatus("cancelled", "Cancelled: the results below are from the inputs before. Change an input, or plan again.");
        return;
      }
      showProblems({message: "could not reach tunecast: " + failure.message, field: null,
                    hint: "is `tunecast serve` still running?"}, "plan");
      setStatus("error", "No answer from tunecast.");
    });
  }

  function cancel() {
    if (planAbort) { planAbort.abort(); }
  }

  // ------------------------------------------------------------------------------------------------ formatting

  function staleText(option) {
    return "price from " + option.price_as_of + ", " + option.price_age_days + " days old: check it";
  }
  function usd(value) {
    return "$" + value.toLocaleString("en-US", {minimumFractionDigits: 2, maximumFractionDigits: 2});
  }
  function whole(value) { return Math.round(value).toLocaleString("en-US"); }
  function megabytes(bytes) { return (bytes / 1e6).toFixed(bytes < 1e7 ? 1 : 0) + " MB"; }
  function gpusText(option) {  // as plan/planner.py gpus_text: `2×h100-sxm fsdp`
    var strategy = option.gpu_count > 1 && option.strategy ? " " + option.strategy : "";
    return option.gpu_count + "×" + option.gpu + strategy;
  }
  function label(option) {
    return gpusText(option) + " · " + option.provider + (option.spot ? " spot" : "");
  }
  function keyOf(option) {
    return [option.gpu_count, option.gpu, option.provider, option.spot ? "spot" : "on-demand",
            option.usd_per_hour_total].join("|");
  }
  function getPath(object, dotted) {
    return dotted.split(".").reduce(function (node, part) { return node == null ? undefined : node[part]; }, object);
  }
  function el(tag, text, className) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) { node.textContent = text; }
    if (className) { node.className = className; }
    return node;
  }

  // ----------------------------------------------------------------------------------------------- rendering

  function priced() {
    return page.plan ? page.plan.options.filter(function (o) { return o.total_usd !== null; }) : [];
  }

  function selected() {
    var all = priced();
    var chosen = all.filter(function (o) { return keyOf(o) === page.selectedKey; })[0];
    return chosen || all[0] || null;
  }

  // A colour for each memory category, in the order the plan's options first name them.
  function categoryColours(doc) {
    var colours = {};
    var count = 0;
    doc.options.forEach(function (option) {
      Object.keys(option.memory_breakdown_gib || {}).forEach(function (name) {
        if (!(name in colours)) { colours[name] = CATEGORY_COLOURS[count++ % CATEGORY_COLOURS.length]; }
      });
    });
    return colours;
  }

  function render(doc) {
    if (page.selectedKey && !priced().some(function (o) { return keyOf(o) === page.selectedKey; })) {
      page.selectedKey = null;  // that option is not in this plan: the best is shown
    }
    ["#recommendation-section", "#options-section", "#memory-section", "#cost-section", "#rent-section"]
      .forEach(function (id) { $(id).hidden = false; });
    page.colours = categoryColours(doc);
    resolvedDefaults(doc);
    renderRecommendations(doc);
    renderTable();
    renderSelection();
    renderCostTime();
    renderMemoryPerGpu(doc.options);
    rentOrBuy();
  }

  // Each input's placeholder shows what the plan used for it, so a left-unset key still says its value.
  function resolvedDefaults(doc) {
    inputs("set").forEach(function (input) {
      var value = input.name === "global_batch" ? doc.global_batch : getPath(doc.spec, input.name);
      var text = value === null || value === undefined ? "" : Array.isArray(value) ? value.join(",") : String(value);
      if (input.tagName === "SELECT") {
        var first = input.options[0];
        if (first.dataset.default) {
          var chosen = Array.prototype.filter.call(input.options, function (o) { return o.value === text; })[0];
          first.textContent = "default (" + (chosen ? chosen.textContent : text) + ")";
        }
      } else {
        input.placeholder = text;
      }
    });
  }

  function renderRecommendations(doc) {
    var box = $("#recommendations");
    box.textContent = "";
    (doc.recommendations.length ? doc.recommendations : ["No option fits and is priced: see the warnings, or widen " +
      "the providers, budget or deadline."]).forEach(function (line) { box.appendChild(el("p", line, "recommendation")); });
    var data = doc.dataset;
    var count = priced().length;
    $("#plan-summary").textContent = whole(data.processed_tokens) + " tokens processed (" + whole(data.trained_tokens) +
      " trained) over " + data.length + ", global batch " + doc.global_batch + " × " + doc.spec.seq_len + "; " +
      count + " priced options, ranked by " + (doc.optimize === "time" ? "hours" : "total cost") +
      (doc.filtered_out ? "; " + doc.filtered_out + " over the budget or deadline left out" : "") + ". Tokens: " +
      data.tokenizer + "." + (doc.model.params ? " " + doc.model.name + ": " + whole(doc.model.params) + " parameters." : "");
    var warnings = $("#warnings");
    warnings.textContent = "";
    (doc.warnings || []).forEach(function (warning) {
      warnings.appendChild(el("p", (warning.field ? warning.field + ": " : "") + warning.message, "field-warning"));
      if (warning.field && slotFor(warning.field, warning.location, "plan")) {
        showProblems({field: warning.field, message: warning.message, hint: warning.hint}, "plan", true);
      }
    });
  }

  var COLUMNS = [
    ["rank", function (o, rank) { return [String(rank), rank]; }],
    ["GPUs", function (o) { return [gpusText(o)]; }],
    ["provider", function (o) { return [o.provider]; }],
    ["capacity", function (o) { return [o.spot ? "spot" : "on-demand"]; }],
    ["$/h", function (o) { return [usd(o.usd_per_hour_total) + (o.price_stale ? "*" : ""), o.usd_per_hour_total]; }],
    ["mb×acc", function (o) { return [o.micro_batch + "×" + o.grad_accum]; }],
    ["ckpt", function (o) { return [o.grad_checkpointing ? "yes" : ""]; }],
    ["GiB", function (o) { return [o.device_total_gib.toFixed(1), o.device_total_gib]; }],
    ["tok/s", function (o) { return [whole(o.tokens_per_second), o.tokens_per_second]; }],
    ["hours", function (o) { return [o.hours.toFixed(2), o.hours]; }],
    ["total", function (o) { return [usd(o.total_usd), o.total_usd]; }],
    ["Pareto", function (o) { return [o.pareto ? "★" : ""]; }],
  ];

  function renderTable() {
    var all = priced();
    var shown = showAll ? all : all.slice(0, TABLE_ROWS);
    var body = $("table[data-table=options] tbody");
    body.textContent = "";
    $$("table[data-table=options] th").forEach(function (head) { head.removeAttribute("aria-sort"); });
    var chosen = selected();
    shown.forEach(function (option, index) {
      var row = document.createElement("tr");
      row.dataset.key = keyOf(option);
      if (index === 0) { row.classList.add("best"); }
      if (option === chosen) { row.classList.add("selected"); row.setAttribute("aria-selected", "true"); }
      COLUMNS.forEach(function (column) {
        var cell = column[1](option, index + 1);
        var td = el("td", cell[0], cell.length > 1 ? "num" : "");
        if (cell.length > 1) { td.dataset.value = String(cell[1]); }
        if (column[0] === "$/h" && option.price_stale) {
          td.classList.add("stale");
          td.title = staleText(option);
        }
        row.appendChild(td);
      });
      body.appendChild(row);
    });
    var stale = all.filter(function (o) { return o.price_stale; });
    $("#stale-note").hidden = !stale.length;
    var oldest = stale.map(function (o) { return o.price_as_of; }).sort()[0];
    $("#stale-note").textContent = stale.length ? "* the price of " + stale.length + " of the " + all.length +
      " options is old (a marketplace's after " + page.plan.price_stale_after_days.marketplace + " day, a list " +
      "price's after " + page.plan.price_stale_after_days.list + " days; the oldest from " + oldest + "): it may " +
      "have moved. `tunecast offers --refresh` fetches today's; `tunecast offers` lists every price's date and " +
      "source." : "";
    $("#options-note").textContent = all.length > shown.length ? "The first " + shown.length + " of " + all.length + "." :
      all.length + " options.";
    $("#show-all").hidden = all.length <= TABLE_ROWS;
    $("#show-all").textContent = showAll ? "Show the first " + TABLE_ROWS : "Show all " + all.length;
  }

  function select(key) {
    page.selectedKey = key;
    $$("table[data-table=options] tbody tr").forEach(function (row) {
      var on = row.dataset.key === key;
      row.classList.toggle("selected", on);
      if (on) { row.setAttribute("aria-selected", "true"); } else { row.removeAttribute("aria-selected"); }
    });
    history.replaceState(null, "", toQuery(readState()));
    renderSelection();
    renderCostTime();
    rentOrBuy();
  }

  function renderSelection() {
    var option = selected();
    if (!option) {
      $("#memory-title").textContent = "No priced option: nothing selected.";
      Plotly.purge("chart-memory-selected");
      return;
    }
    $("#memory-title").textContent = "Selected: " + label(option) + " — " + usd(option.total_usd) + " in " +
      option.hours.toFixed(2) + " h at " + usd(option.usd_per_hour_total) + "/h" +
      (option.price_stale ? " (" + staleText(option) + ")" : "") + "; micro-batch " + option.micro_batch +
      " × accumulation " + option.grad_accum + (option.grad_checkpointing ? ", gradient checkpointing" : "") + "; " +
      option.device_total_gib.toFixed(1) + " of " + option.capacity_gib.toFixed(1) + " GiB per GPU (" +
      option.engine + ", " + option.basis + ").";
    var name = gpusText(option);
    var traces = Object.keys(option.memory_breakdown_gib).map(function (category) {
      return {type: "bar", orientation: "h", name: category, y: [name], x: [option.memory_breakdown_gib[category]],
              marker: {color: page.colours[category]},
              hovertemplate: category + ": %{x:.2f} GiB<extra></extra>"};
    });
    var layout = baseLayout({barmode: "stack", xaxis: {ticksuffix: " GiB", rangemode: "tozero"},
                             yaxis: {automargin: true}, legend: {orientation: "h", y: -0.3, yanchor: "top"},
                             margin: {l: 110, r: 20, t: 24, b: 30},
                             shapes: [{type: "line", x0: option.capacity_gib, x1: option.capacity_gib, y0: -0.5,
                                       y1: 0.5, line: {color: "#000000", width: 3}}],
                             annotations: [{x: option.capacity_gib, y: 0.5, text: "usable " +
                               option.capacity_gib.toFixed(1) + " GiB", showarrow: false, yanchor: "bottom"}]});
    Plotly.react("chart-memory-selected", traces, layout, PLOT_CONFIG);
  }

  function baseLayout(extra) {
    var layout = {paper_bgcolor: "#ffffff", plot_bgcolor: "#ffffff", colorway: PALETTE, font: {size: 13},
                  margin: {l: 60, r: 20, t: 30, b: 50}, hovermode: "closest"};
    Object.keys(extra).forEach(function (key) { layout[key] = extra[key]; });
    ["xaxis", "yaxis"].forEach(function (axis) {
      layout[axis] = Object.assign({gridcolor: "#e5e5e5", zerolinecolor: "#cccccc"}, layout[axis] || {});
    });
    return layout;
  }

  // Ticks of a log axis that say their value whole ("0.3 h", not a bare "3" between decades): 1, 2, 3 and 5 of each
  // decade when the values span less than one, 1, 2 and 5 up to four, only the powers of ten past that.
  function logTicks(values, text) {
    var low = Math.min.apply(null, values), high = Math.max.apply(null, values);
    var first = Math.floor(Math.log10(low)), last = Math.ceil(Math.log10(high));
    var span = Math.log10(high / low);
    var steps = span > 4 ? [1] : span > 1 ? [1, 2, 5] : [1, 2, 3, 5];
    var ticks = {tickvals: [], ticktext: []};
    for (var power = first; power <= last; power++) {
      steps.forEach(function (step) {
        var value = step * Math.pow(10, power);
        if (value >= low / 1.5 && value <= high * 1.5) {
          ticks.tickvals.push(value);
          ticks.ticktext.push(text(Number(value.toPrecision(1))));
        }
      });
    }
    return ticks;
  }
  function hoursTick(value) { return value < 1 ? value + " h" : whole(value) + " h"; }
  function usdTick(value) { return value < 1 ? "$" + value : "$" + whole(value); }

  function renderCostTime() {
    var all = priced();
    var chart = "chart-cost-vs-time";
    var empty = $("#cost-empty");
    var free = all.filter(function (o) { return !(o.total_usd > 0); });
    empty.hidden = !all.length || free.length < all.length;
    empty.textContent = "No cost to chart: every priced option costs $0 (a price of $0 per hour). Their hours are in " +
      "the table above.";
    $("#cost-caption").parentNode.hidden = !all.length || !empty.hidden;
    if (!all.length || !empty.hidden) { Plotly.purge(chart); return; }
    function points(options, extra) {
      return Object.assign({type: "scatter", x: options.map(function (o) { return o.hours; }),
                            y: options.map(function (o) { return o.total_usd; }),
                            text: options.map(label), customdata: options.map(keyOf),
                            hovertemplate: "%{text}<br>%{x:.2f} h · $%{y:,.2f}<extra></extra>"}, extra);
    }
    var traces = [];
    [[false, "circle", "on-demand"], [true, "diamond", "spot"]].forEach(function (kind) {
      var chosen = all.filter(function (o) { return o.spot === kind[0]; });
      if (chosen.length) {
        traces.push(points(chosen, {mode: "markers", name: kind[2],
                                    marker: {symbol: kind[1], size: 8, opacity: 0.55}}));
      }
    });
    var front = all.filter(function (o) { return o.pareto; }).sort(function (a, b) { return a.hours - b.hours; });
    traces.push(points(front, {mode: "lines+markers", name: "Pareto front", line: {color: "#D55E00", width: 2},
                               marker: {size: 10, color: "#D55E00"}}));
    traces.push(points([all[0]], {mode: "markers+text", name: "recommended", texttemplate: "recommended",
                                  textposition: "top center", marker: {symbol: "star", size: 18, color: "#000000"}}));
    var chosen = selected();
    if (chosen && chosen !== all[0]) {
      traces.push(points([chosen], {mode: "markers", name: "selected",
                                    marker: {symbol: "circle-open", size: 20, line: {width: 3}, color: "#0072B2"}}));
    }
    // a run that costs $0 has no place on a log scale: then the cost axis is linear, from $0
    var costAxis = free.length ? {title: {text: "whole run, USD"}, rangemode: "tozero", tickprefix: "$"} :
      Object.assign({title: {text: "whole run, USD"}, type: "log"},
                    logTicks(all.map(function (o) { return o.total_usd; }), usdTick));
    Plotly.react(chart, traces, baseLayout({
      xaxis: Object.assign({title: {text: "hours (wall clock)"}, type: "log"},
                           logTicks(all.map(function (o) { return o.hours; }), hoursTick)),
      yaxis: costAxis, legend: {orientation: "h", y: -0.2}}), PLOT_CONFIG);
    var div = document.getElementById(chart);
    if (!div.dataset.clicks) {
      div.dataset.clicks = "on";
      div.on("plotly_click", function (event) {
        var point = event.points && event.points[0];
        if (point && point.customdata) { select(point.customdata); }
      });
    }
  }

  function renderMemoryPerGpu(options) {
    var chart = "chart-memory-per-gpu";
    var perGpu = {};
    options.forEach(function (option) {  // ranked: of a card's fewest GPUs, the first option
      if (!option.memory_breakdown_gib) { return; }
      var kept = perGpu[option.gpu];
      if (!kept || option.gpu_count < kept.gpu_count) { perGpu[option.gpu] = option; }
    });
    var gpus = Object.keys(perGpu).sort(function (a, b) { return perGpu[a].capacity_gib - perGpu[b].capacity_gib; });
    if (!gpus.length) { Plotly.purge(chart); return; }
    var categories = [];
    gpus.forEach(function (slug) {
      Object.keys(perGpu[slug].memory_breakdown_gib).forEach(function (name) {
        if (categories.indexOf(name) < 0) { categories.push(name); }
      });
    });
    var labels = gpus.map(function (slug) {
      return perGpu[slug].gpu_count + "×" + slug + (perGpu[slug].fits ? "" : " (does not fit)");
    });
    var traces = categories.map(function (name) {
      return {type: "bar", name: name, x: labels, marker: {color: page.colours[name]},
              y: gpus.map(function (slug) { return perGpu[slug].memory_breakdown_gib[name] || 0; }),
              hovertemplate: name + ": %{y:.2f} GiB<extra></extra>"};
    });
    traces.push({type: "scatter", mode: "markers", name: "usable memory", x: labels,
                 y: gpus.map(function (slug) { return perGpu[slug].capacity_gib; }),
                 marker: {symbol: "line-ew-open", size: 34, color: "#000000", line: {width: 3, color: "#000000"}},
                 hovertemplate: "usable: %{y:.1f} GiB<extra></extra>"});
    Plotly.react(chart, traces, baseLayout({barmode: "stack", yaxis: {title: {text: "GiB per GPU"}},
                                            xaxis: {tickangle: -40}, legend: {orientation: "h", y: -0.45},
                                            margin: {l: 60, r: 20, t: 20, b: 90}}), PLOT_CONFIG);
  }

  // ------------------------------------------------------------------------------------------------ rent or buy

  function purchasable(slug) {
    var gpu = page.catalog && page.catalog.gpus.filter(function (g) { return g.slug === slug; })[0];
    return !!(gpu && gpu.purchase_usd);
  }

  // Which card to buy and which offer to rent: the selected option when it is one on-demand GPU; otherwise the
  // best one-GPU on-demand option (of the chosen card, or of a card the catalog has a price for), as the report.
  function rentAndBuy(state) {
    var single = priced().filter(function (o) { return o.gpu_count === 1 && !o.spot && o.usd_per_hour_total > 0; });
    var chosen = selected();
    var wanted = state.breakeven.buy_gpu;
    var rent = single.indexOf(chosen) >= 0 ? chosen :
      wanted ? single.filter(function (o) { return o.gpu === wanted; })[0] || single[0] :
      single.filter(function (o) { return purchasable(o.gpu); })[0] || single[0];
    var buy = wanted || (rent && purchasable(rent.gpu) ? rent.gpu : null);
    return {rent: rent || null, buy: buy};
  }

  function rentOrBuy() {
    var seq = ++breakevenSeq;
    if (breakevenAbort) { breakevenAbort.abort(); }
    clearErrors("breakeven");
    var state = readState();
    var pair = rentAndBuy(state);
    var chart = "chart-rent-vs-buy";
    if (!pair.rent || !pair.buy) {
      page.breakeven = null;
      Plotly.purge(chart);
      $("#rent-caption").textContent = "";
      $("#rent-text").textContent = !pair.rent ? "No one-GPU on-demand option to rent: nothing to compare." :
        pair.rent.gpu + " has no purchase price in the catalog: choose a card to buy.";
      return Promise.resolve();
    }
    var options = {gpu: pair.buy, rent_gpu: pair.rent.gpu, rent_usd_per_hour: pair.rent.usd_per_hour_total};
    ["hours_per_month", "usd_per_kwh", "resale_usd"].forEach(function (key) {
      if (state.breakeven[key] !== undefined) { options[key] = state.breakeven[key]; }
    });
    var body = runBody(state);
    body.options = options;
    var controller = new AbortController();
    breakevenAbort = controller;
    $("#rent-text").textContent = "Comparing…";
    return postJson("/api/breakeven", body, controller.signal).then(function (answer) {
      if (seq !== breakevenSeq) { return; }
      breakevenAbort = null;
      if (!answer.ok) {
        page.breakeven = null;
        Plotly.purge(chart);
        $("#rent-text").textContent = "";
        $("#rent-caption").textContent = "";
        showProblems(answer.doc.error, "breakeven");
        return;
      }
      page.breakeven = answer.doc;
      drawRentOrBuy(answer.doc, pair);
    }).catch(function (failure) {
      if (seq !== breakevenSeq || failure.name === "AbortError") { return; }
      showProblems({message: "could not reach tunecast: " + failure.message, field: null}, "breakeven");
    });
  }

  function drawRentOrBuy(doc, pair) {
    var months = [];
    var horizon = Math.max(MONTHS_SHOWN, doc.breakeven_months ? Math.ceil(doc.breakeven_months * 1.25) : 0);
    for (var m = 0; m <= Math.min(horizon, 240); m++) { months.push(m); }
    var rentLine = months.map(function (m) { return doc.rent_usd_per_hour * doc.hours_per_month * m; });
    var buyLine = months.map(function (m) {
      return doc.purchase_usd - doc.resale_usd + doc.power_usd_per_hour * doc.hours_per_month * m;
    });
    var traces = [
      {type: "scatter", mode: "lines", x: months, y: rentLine, name: "rent (" + label(pair.rent) + ")",
       line: {color: "#0072B2", width: 3}},
      {type: "scatter", mode: "lines", x: months, y: buyLine, name: "buy " + pair.buy + (doc.power_usd_per_hour ?
        " (+ power)" : ""), line: {color: "#E69F00", width: 3, dash: "dash"}},
    ];
    var text = "renting stays cheaper";
    if (doc.breakeven_months !== null) {
      var at = doc.breakeven_months;
      traces.push({type: "scatter", mode: "markers+text", x: [at], name: "break-even",
                   y: [doc.purchase_usd - doc.resale_usd + doc.power_usd_per_hour * doc.hours_per_month * at],
                   marker: {symbol: "x", size: 14, color: "#000000"}, text: ["break-even: " + at.toFixed(1) + " months"],
                   textposition: "bottom right"});
      text = "buying pays for itself after " + whole(doc.breakeven_hours) + " hours of use, " + at.toFixed(1) + " months";
    }
    Plotly.react("chart-rent-vs-buy", traces, baseLayout({
      xaxis: {title: {text: "months at " + doc.hours_per_month + " hours of use each"}},
      yaxis: {title: {text: "cumulative USD"}}, legend: {orientation: "h", y: -0.25}}), PLOT_CONFIG);
    var line = "Buying a " + pair.buy + " for " + usd(doc.purchase_usd) + (doc.resale_usd ? " (resale " +
      usd(doc.resale_usd) + ")" : "") + " against renting " + label(pair.rent) + " at " + usd(doc.rent_usd_per_hour) +
      "/h" + (doc.power_usd_per_hour ? ", power " + usd(doc.power_usd_per_hour) + "/h" : "") + ": " + text + ".";
    if (doc.work) {
      line += " This run takes " + doc.work.owned_hours_per_run.toFixed(2) + " h on the owned card, " +
        doc.work.rented_hours_per_run.toFixed(2) + " h and " + usd(doc.work.rented_usd_per_run) + " rented" +
        (doc.work.breakeven_runs !== null ? "; buying pays off after " + doc.work.breakeven_runs.toFixed(1) +
          " runs like it." : ".");
    }
    $("#rent-text").textContent = line;
    $("#rent-caption").textContent = "Cumulative cost of renting against buying (purchase less resale, plus " +
      "electricity when a price per kWh is given), from `tunecast breakeven`.";
  }

  // --------------------------------------------------------------------------------------------------- export

  function exportYaml() {
    var state = readState();
    clearErrors("plan");
    return postJson("/api/export", runBody(state)).then(function (answer) {
      if (!answer.ok) { showProblems(answer.doc.error, "plan"); return; }
      var text = answer.doc.yaml;
      page.exported = text;
      $("#export-section").hidden = false;
      $("#export-yaml").textContent = text;
      var link = $("#export-download");
      if (link.href.indexOf("blob:") === 0) { URL.revokeObjectURL(link.href); }
      link.href = URL.createObjectURL(new Blob([text], {type: "application/x-yaml"}));
      link.click();
      $("#export-section").scrollIntoView({block: "nearest"});
    }).catch(function (failure) {
      showProblems({message: "could not export: " + failure.message, field: null}, "plan");
    });
  }

  // ------------------------------------------------------------------------------------------- model and data

  function modelFacts() {
    var name = $("#model").value.trim();
    var box = $("#model-facts");
    if (!name || !page.catalog) { box.textContent = ""; return; }
    var row = page.catalog.models.filter(function (m) { return m.name.toLowerCase() === name.toLowerCase(); })[0];
    if (!row) {
      box.textContent = "Not a catalog name: a local model folder or config file (checked when planning).";
      return;
    }
    box.textContent = (row.params / 1e9).toFixed(2) + " B parameters · " + row.num_layers + " layers · hidden " +
      row.hidden_size + " · vocabulary " + whole(row.vocab_size) + (row.num_experts ? " · " + row.num_experts +
      " experts" : "") + " · " + row.model_type + (row.max_position_embeddings ? " · context " +
      whole(row.max_position_embeddings) : "");
  }

  function dropConfig(file) {
    clearErrors("model-file");
    return file.text().then(function (text) {
      var config;
      try { config = JSON.parse(text); } catch (e) {
        showProblems({message: file.name + " is not JSON: " + e.message, field: null,
                      hint: "drop a model's config.json (its architecture, sizes, vocabulary)"}, "model-file");
        return;
      }
      // the server names it (its _name_or_path, the file's name, its architecture) and counts its parameters
      $("#model-facts").textContent = "Reading " + file.name + "…";
      return postJson("/api/models", {config_json: config, file_name: file.name}).then(function (answer) {
        if (!answer.ok) { modelFacts(); showProblems(answer.doc.error, "model-file"); return; }
        var row = answer.doc;
        if (page.catalog && !page.catalog.models.some(function (m) { return m.name === row.model; })) {
          page.catalog.models.push(row);
        }
        $("#model").value = row.model;
        modelFacts();
        schedule();
      });
    });
  }

  function measureSample(file) {
    clearErrors("sample");
    var state = readState();
    var overrides = {};
    Object.keys(state.set).forEach(function (key) {  // the sample is the data: no declared size next to it
      if (key.indexOf("dataset.") !== 0 || ["dataset.format", "dataset.train_on", "dataset.tokenizer"].indexOf(key) >= 0) {
        overrides[key] = state.set[key];
      }
    });
    var box = $("#sample-stats");
    // the server takes a sample of at most `sample_bytes` (GET /api/health): a file of lines (JSONL, CSV) larger
    // than that is measured on its first lines, cut at a line; a JSON document cannot be cut
    // (0.6: JSON writes each quote of a JSONL line as two bytes, and a quarter of such text can be quotes)
    var room = Math.floor(((page.limits && page.limits.sample_bytes) || 16e6) * 0.6);
    var cut = file.size > room;
    if (cut && /\.json$/i.test(file.name)) {
      showProblems({message: file.name + " is " + megabytes(file.size) + ", more than the " + megabytes(room) +
                    " a sample may be", field: null, hint: "save its first examples as JSON Lines (.jsonl): a " +
                    "longer file of lines is measured on its first " + megabytes(room)}, "sample");
      return Promise.resolve();
    }
    box.hidden = false;
    box.textContent = "Counting " + file.name + (cut ? " (its first " + megabytes(room) + ")" : "") + "…";
    return file.slice(0, cut ? room : file.size).text().then(function (text) {
      if (cut) { text = text.slice(0, text.lastIndexOf("\n") + 1); }
      return postJson("/api/data", {config: state.config, overrides: overrides, sample: {name: file.name, text: text}});
    }).then(function (answer) {
      if (!answer.ok) { box.hidden = true; showProblems(answer.doc.error, "sample"); return; }
      var doc = answer.doc;
      page.sample = doc;
      box.textContent = "";
      var mean = doc.total_tokens / doc.examples;
      var trained = doc.trained_tokens / doc.examples;
      var facts = [
        ["examples", whole(doc.examples) + " (" + doc.format + ")"],
        ["tokens", whole(doc.total_tokens) + " processed, " + whole(doc.trained_tokens) + " trained"],
        ["per example", mean.toFixed(1) + " processed, " + trained.toFixed(1) + " trained"],
        ["lengths", "p50 " + doc.length_percentiles.p50 + " · p90 " + doc.length_percentiles.p90 + " · max " +
          doc.length_percentiles.max],
        ["truncated", doc.truncated_examples + " examples at " + doc.seq_len + " tokens"],
        ["packing", (100 * doc.packing_efficiency).toFixed(1) + "% efficient"],
        ["tokenizer", doc.tokenizer],
      ];
      var list = el("dl", null, "facts");
      facts.forEach(function (pair) { list.appendChild(el("dt", pair[0])); list.appendChild(el("dd", pair[1])); });
      box.appendChild(list);
      box.appendChild(el("p", (cut ? "Measured on the first " + megabytes(room) + " of " + megabytes(file.size) +
        ". " : "") + "Mean tokens per example set from this sample; set Examples to the size of the whole " +
        "dataset.", "muted"));
      $("#mean-tokens").value = String(Math.round(mean * 10) / 10);
      $("#mean-trained").value = String(Math.round(trained * 10) / 10);
      if (!$("#examples").value) { $("#examples").value = String(doc.examples); }
      schedule();
    }).catch(function (failure) {
      box.hidden = true;
      showProblems({message: "could not read the sample: " + failure.message, field: null}, "sample");
    });
  }

  // ------------------------------------------------------------------------------------------------- catalog

  function fillCatalog(catalog) {
    page.catalog = catalog;
    var gpu = $("#gpu"), buy = $("#buy-gpu");
    var keepGpu = gpu.value, keepBuy = buy.value;
    catalog.gpus.forEach(function (row) {
      var text = row.slug + " · " + row.memory_gib + " GiB";
      if (!Array.prototype.some.call(gpu.options, function (o) { return o.value === row.slug; })) {
        addOption(gpu, row.slug, text);
      }
      if (row.purchase_usd && !Array.prototype.some.call(buy.options, function (o) { return o.value === row.slug; })) {
        addOption(buy, row.slug, row.slug + " · " + usd(row.purchase_usd));
      }
    });
    gpu.value = keepGpu;
    buy.value = keepBuy;
    var wanted = checkedProviders();
    var listed = catalog.providers.map(function (entry) {
      return typeof entry === "string" ? {name: entry, count: null} :
        {name: entry.provider || entry.name, count: entry.offers !== undefined ? entry.offers : entry.count};
    });
    wanted.forEach(function (name) {  // one the catalog does not list stays asked for: the plan says what is wrong
      if (!listed.some(function (entry) { return entry.name === name; })) { listed.push({name: name, count: null}); }
    });
    listed.forEach(function (entry) { providerBox(entry.name, entry.count).checked = wanted.indexOf(entry.name) >= 0; });
    page.wantedProviders = null;
    providersSummary();
    modelFacts();
  }

  // The catalog models a person typing the model input means (GET /api/models?search=: case, spaces, dashes and
  // dots alike, the vendor optional), listed under it to pick from; none when the input names one already.
  var searchTimer = null, searchSeq = 0;
  function searchModels() {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(function () {
      var text = $("#model").value.trim();
      var seq = ++searchSeq;
      var exact = page.catalog && page.catalog.models.some(function (m) {
        return m.name.toLowerCase() === text.toLowerCase();
      });
      if (!text || exact || /[\\/.]json$|^[.~\/]/.test(text)) { showMatches([]); return; }
      fetch("/api/models?" + new URLSearchParams({search: text, limit: String(MATCHES_SHOWN)}))
        .then(function (r) { return r.json(); })
        .then(function (doc) { if (seq === searchSeq) { showMatches(doc.models || []); } })
        .catch(function () { showMatches([]); });
    }, 120);
  }

  function showMatches(models) {
    var list = $("#model-matches");
    list.textContent = "";
    models.forEach(function (model) {
      var item = el("li");
      var pick = el("button", model.name, "match");
      pick.type = "button";
      pick.setAttribute("role", "option");
      pick.dataset.name = model.name;
      pick.appendChild(el("span", " " + (model.params / 1e9).toFixed(1) + " B · " + model.model_type, "muted"));
      item.appendChild(pick);
      list.appendChild(item);
    });
    list.hidden = !models.length;
    $("#model").setAttribute("aria-expanded", models.length ? "true" : "false");
  }

  function pickModel(name) {
    $("#model").value = name;
    showMatches([]);
    modelFacts();
    schedule();
    $("#model").focus();
  }

  // A provider's checkbox, with how many offers it has when the catalog says.
  function providerBox(name, count) {
    var row = el("label");
    var check = document.createElement("input");
    check.type = "checkbox";
    check.value = name;
    row.appendChild(check);
    row.appendChild(document.createTextNode(name + (count !== null && count !== undefined ? " (" + count + ")" : "")));
    $("#providers").appendChild(row);
    return check;
  }

  function providersSummary() {
    var chosen = checkedProviders();
    $("#providers-summary").textContent = chosen.length ? "(" + chosen.join(", ") + ")" : "(all)";
  }

  function showLora() {
    $("#lora-settings").hidden = $("#method").value === "full";
  }

  // ------------------------------------------------------------------------------------------------- wiring

  function wire() {
    var form = $("#inputs");
    form.addEventListener("submit", function (event) { event.preventDefault(); commit(); });
    form.addEventListener("input", function (event) {
      var target = event.target;
      if (target.type === "file") { return; }
      if (target.id === "model") { modelFacts(); searchModels(); }
      if (target.id === "method") { showLora(); }
      if (target.closest("#providers")) { providersSummary(); }
      schedule();
    });
    $$("#rent-section [data-group=breakeven]").forEach(function (input) {
      input.addEventListener("input", function () {
        clearTimeout(breakevenTimer);
        breakevenTimer = setTimeout(function () {
          history.replaceState(null, "", toQuery(readState()));
          rentOrBuy();
        }, DEBOUNCE_MS);
      });
    });
    $("#model-matches").addEventListener("click", function (event) {
      var pick = event.target.closest("button[data-name]");
      if (pick) { pickModel(pick.dataset.name); }
    });
    $("#model").addEventListener("keydown", function (event) {
      var first = $("#model-matches button");
      if (event.key === "ArrowDown" && first && !$("#model-matches").hidden) { event.preventDefault(); first.focus(); }
      if (event.key === "Escape") { showMatches([]); }
    });
    $("#model-matches").addEventListener("keydown", function (event) {
      var current = event.target.closest("li");
      if (!current) { return; }
      var next = event.key === "ArrowDown" ? current.nextElementSibling : event.key === "ArrowUp" ?
        current.previousElementSibling : null;
      if (next) { event.preventDefault(); next.querySelector("button").focus(); }
      if (event.key === "ArrowUp" && !current.previousElementSibling) { event.preventDefault(); $("#model").focus(); }
      if (event.key === "Escape") { showMatches([]); $("#model").focus(); }
    });
    $("#cancel").addEventListener("click", cancel);
    $("#replan").addEventListener("click", commit);
    $("#export").addEventListener("click", exportYaml);
    $("#copy-link").addEventListener("click", function () {
      var done = function () { $("#copy-link").textContent = "Link copied"; };
      if (navigator.clipboard) {
        navigator.clipboard.writeText(location.href).then(done, function () { prompt("This plan's link:", location.href); });
      } else {
        prompt("This plan's link:", location.href);
      }
      setTimeout(function () { $("#copy-link").textContent = "Copy link"; }, 2000);
    });
    $("#show-all").addEventListener("click", function () { showAll = !showAll; renderTable(); });
    $("table[data-table=options] tbody").addEventListener("click", function (event) {
      var row = event.target.closest("tr");
      if (row && row.dataset.key) { select(row.dataset.key); }
    });
    sortableTable($("table[data-table=options]"));  // /static/sortable.js

    var drop = $("#drop");
    ["dragenter", "dragover"].forEach(function (name) {
      drop.addEventListener(name, function (event) { event.preventDefault(); drop.classList.add("over"); });
    });
    ["dragleave", "drop"].forEach(function (name) {
      drop.addEventListener(name, function () { drop.classList.remove("over"); });
    });
    drop.addEventListener("drop", function (event) {
      event.preventDefault();
      var file = event.dataTransfer.files[0];
      if (file) { dropConfig(file); }
    });
    // a file dropped anywhere else would make the browser leave the page for it
    window.addEventListener("dragover", function (event) { event.preventDefault(); });
    window.addEventListener("drop", function (event) { event.preventDefault(); });
    $("#config-file").addEventListener("change", function (event) {
      if (event.target.files[0]) { dropConfig(event.target.files[0]); }
      event.target.value = "";
    });
    $("#sample-file").addEventListener("change", function (event) {
      if (event.target.files[0]) { measureSample(event.target.files[0]); }
    });
    document.addEventListener("click", function (event) {  // a click elsewhere closes the model list
      if (!event.target.closest("#model, #model-matches")) { showMatches([]); }
    });
    window.addEventListener("popstate", function () {
      fromQuery(location.search);
      plan(readState());
    });
  }

  function start() {
    wire();
    fromQuery(location.search);
    fetch("/api/health").then(function (r) { return r.json(); }).then(function (doc) {
      $("#version").textContent = "tunecast " + doc.version;
      page.limits = doc.limits || null;
    }).catch(function () {});
    var catalog = fetch("/api/catalog").then(function (r) {
      if (!r.ok) { throw new Error("HTTP " + r.status); }
      return r.json();
    }).then(fillCatalog).catch(function (failure) {
      var box = $("#catalog-error");
      box.hidden = false;
      box.textContent = "The catalog could not be loaded (" + failure.message + "): type model names and GPUs.";
    });
    // the plan needs no catalog; rent or buy reads its purchase prices, so it is drawn again once they are here
    plan(readState());
    catalog.then(function () { if (page.plan) { rentOrBuy(); } });
  }

  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
})();
