"""The command line end to end, through the real entry point."""

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import PYTHON, REPO, run_subprocess

CANONICAL = ["rtx-3090", "rtx-4090", "rtx-5090", "rtx-a6000", "rtx-6000-ada", "rtx-pro-6000", "l4", "l40s",
             "a10g", "a100-40gb", "a100-80gb", "a100-80gb-pcie", "h100-sxm", "h100-pcie", "h200", "b200",
             "mi300x"]
BAD_CONFIG = "model: meta-llama/Llama-3.1-8B\nlora:\n  rnak: 16\nseq_len: -5\ngpus:\n  gpu: h1000\n"


def test_gpus_json_lists_every_canonical_slug_with_its_figures(cli) -> None:
    result = cli("gpus", "--json")
    assert result.code == 0
    gpus = {item["slug"]: item for item in result.json()}
    assert set(CANONICAL) <= set(gpus)
    for item in gpus.values():
        assert {"slug", "name", "memory_gib", "usable_memory_gib", "bf16_tflops", "memory_bandwidth_gb_per_s",
                "interconnect", "tdp_w", "schema_version", "source", "as_of"} <= set(item)
    h100 = gpus["h100-sxm"]
    assert (h100["memory_gib"], h100["bf16_tflops"], h100["memory_bandwidth_gb_per_s"]) == (80, 989, 3350)


def test_gpus_table(cli) -> None:
    result = cli("gpus", "--min-memory", "100")
    assert result.code == 0 and "h200" in result.stdout and "rtx-4090" not in result.stdout


def test_offers_json_has_the_quoted_figures(cli) -> None:
    offers = cli("offers", "--json").json()
    for item in offers:
        assert {"provider", "gpu", "gpu_count", "usd_per_hour", "spot_usd_per_hour", "as_of", "source",
                "schema_version"} <= set(item)
    figures = {(o["provider"], o["gpu"], o["usd_per_hour"]) for o in offers}
    assert {("thunder-compute", "a100-80gb", 0.78), ("thunder-compute", "rtx-a6000", 0.35),
            ("market-median", "rtx-4090", 0.435)} <= figures
    assert any(o["spot_usd_per_hour"] is None for o in offers)


def test_offers_filters(cli) -> None:
    offers = cli("offers", "--gpu", "H100", "--spot", "--json").json()
    assert offers and all(o["gpu"] == "h100-sxm" and o["spot_usd_per_hour"] for o in offers)
    bad = cli("offers", "--provider", "lamda")
    assert bad.code == 2 and "lambda" in bad.stderr


def test_models_json(cli) -> None:
    models = {m["name"]: m for m in cli("models", "--json").json()}
    assert len(models) >= 25
    assert models["meta-llama/Llama-3.1-8B"]["params"] == 8_030_261_248
    assert models["meta-llama/Llama-3.2-1B"]["params"] == 1_235_814_400
    assert models["Qwen/Qwen3-0.6B"]["params"] == 596_049_920
    assert all(m["model_type"] and m["params"] > 0 for m in models.values())


def test_validate_reports_three_mistakes_at_once(cli, tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_CONFIG)
    result = cli("validate", str(path))
    assert result.code == 2 and "Traceback" not in result.stderr + result.stdout
    for text in ("lora.rnak (line 3)", "Did you mean 'lora.rank'", "seq_len (line 4)", "for example 2048",
                 "gpus.gpu (line 6)", "h100-sxm", "3 problems"):
        assert text in result.stderr


def test_validate_json_error_document(cli, tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_CONFIG)
    result = cli("validate", str(path), "--json")
    assert result.code == 2
    document = result.json()
    assert document["schema_version"] == 1
    assert {"message", "field", "hint"} <= set(document["error"])
    assert [p["field"] for p in document["error"]["problems"]] == ["lora.rnak", "seq_len", "gpus.gpu"]


def test_validate_show_prints_defaults_filled_in(cli) -> None:
    import yaml

    result = cli("validate", str(REPO / "examples/llama-3.1-8b-lora.yaml"), "--show", "--gpu", "4090")
    resolved = yaml.safe_load(result.stdout)
    assert result.code == 0
    assert resolved["gpus"]["gpu"] == "rtx-4090" and resolved["lora"]["rank"] == 16
    assert resolved["attention"] == "sdpa" and resolved["output"].endswith("runs/Llama-3.1-8B-lora")


def test_flags_without_a_file(cli) -> None:
    result = cli("validate", "--model", "Qwen/Qwen3-0.6B", "--method", "full", "--set", "lora.dropout=0.1", "--json")
    assert result.code == 0, result.stderr
    assert result.json()["spec"]["method"] == "full" and result.json()["model"]["params"] == 596_049_920


def test_bad_flag_value_names_the_flag(cli) -> None:
    result = cli("validate", "--model", "Qwen/Qwen3-0.6B", "--method", "qlorra")
    assert result.code == 2 and "method (--method)" in result.stderr and "Did you mean 'qlora'" in result.stderr


def test_unknown_option_is_a_usage_error(cli) -> None:
    result = cli("gpus", "--bogus")
    assert result.code == 2 and "No such option" in result.stderr


def test_init_writes_a_valid_starter_and_never_overwrites(cli, tmp_path) -> None:
    path = tmp_path / "run.yaml"
    assert cli("init", str(path), "--model", "Qwen/Qwen3-0.6B").code == 0
    assert cli("validate", str(path)).code == 0
    again = cli("init", str(path))
    assert again.code == 2 and "already exists" in again.stderr and "--force" in again.stderr


def test_models_add_to_the_user_catalog(cli, tmp_path) -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": True}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    added = cli("models", "add", str(path), "--name", "me/tiny", "--source", "written for the test", "--json")
    assert added.code == 0, added.stderr
    # 1000×64 embedding (tied) + 2 layers × (q 64×64, k,v 64×32 each, o 64×64, mlp 3×64×128, 2 norms) + norm
    expected = 1000 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64
    assert added.json()["params"] == expected
    listed = {m["name"]: m for m in cli("models", "--json").json()}
    assert listed["me/tiny"]["params"] == expected


def test_version(cli) -> None:
    result = cli("--version")
    assert result.code == 0 and result.stdout.startswith("tunecast 0.1.0 (catalog ")


def test_import_skypilot_command(cli, tmp_path) -> None:
    path = tmp_path / "lambda" / "vms.csv"
    path.parent.mkdir()
    path.write_text("InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice\n"
                    "gpu_8x_h100_sxm5,H100,8.0,208.0,1800.0,23.92,us-east-1,,\n")
    result = cli("offers", "import-skypilot", str(path), "--as-of", "2026-11-20", "--json")
    assert result.code == 0, result.stderr
    assert result.json()["imported"] == 1
    offers = cli("offers", "--provider", "lambda", "--gpu", "h100-sxm", "--json").json()
    assert any(o["usd_per_hour"] == pytest.approx(2.99) and o["as_of"] == "2026-11-20" for o in offers)


@pytest.mark.parametrize("example", sorted(str(p.relative_to(REPO)) for p in (REPO / "examples").rglob("*.yaml")))
def test_every_shipped_example_is_valid(cli, example: str) -> None:
    first_line = (REPO / example).read_text().splitlines()[0]
    assert first_line.startswith("# tunecast "), "each example starts with the command that runs it"
    result = cli("validate", str(REPO / example))
    assert result.code == 0, result.stderr


def test_examples_exist() -> None:
    assert (REPO / "examples/llama-3.1-8b-lora.yaml").is_file()


# In fresh interpreters: what the console script imports and how it exits.

NO_TORCH = """
import sys
from tunecast.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    code = done.code
heavy = sorted(m for m in ("torch", "transformers", "peft", "accelerate") if m in sys.modules)
sys.stderr.write(f"HEAVY={heavy} CODE={code}\\n")
"""


@pytest.mark.parametrize("args", [["gpus"], ["offers", "--json"], ["models"], ["validate",
                                  "examples/llama-3.1-8b-lora.yaml"], ["validate", "--model", "nope/nope"],
                                  ["breakeven", "--purchase-usd", "3800", "--rent-usd-per-hour", "0.78", "--json"],
                                  ["breakeven", "--gpu", "rtx-4090"]])
def test_light_commands_never_import_torch(args: list[str]) -> None:
    result = run_subprocess(PYTHON, "-c", NO_TORCH, *args)
    assert "HEAVY=[]" in result.stderr, result.stderr


def test_console_script_and_python_m_agree(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_CONFIG)
    module = run_subprocess(PYTHON, "-m", "tunecast", "validate", str(bad))
    assert module.code == 2 and "Traceback" not in module.stderr and "3 problems" in module.stderr
    version = run_subprocess(PYTHON, "-m", "tunecast", "--version")
    assert version.code == 0 and "tunecast" in version.stdout


def test_an_estimate_run_as_the_program_exits_at_once_with_its_whole_answer(tmp_path: Path) -> None:
    """`tunecast memory` run as the program (main() without argv) skips the interpreter's teardown (app.py
    `_quick_exit`): its exit handlers still run, and its whole answer is written, to a pipe as to a file."""
    marker = tmp_path / "atexit-ran"
    script = ("import atexit, pathlib, sys\n"
              f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
              "sys.argv = ['tunecast', *sys.argv[1:]]\nfrom tunecast.cli import main\nmain()\n"
              "raise SystemExit('main() returned')\n")
    args = ("memory", "--model", "Qwen/Qwen2.5-0.5B", "--method", "lora", "--micro-batch", "1", "--seq-len", "256",
            "--gpu", "rtx-4090", "--json")
    piped = run_subprocess(PYTHON, "-c", script, *args)
    assert piped.code == 0, piped.stderr[-500:]
    answer = json.loads(piped.stdout)
    assert answer["fits"] is True and marker.read_text() == "yes"
    marker.unlink()
    written = tmp_path / "answer.json"
    with written.open("w") as sink:
        completed = subprocess.run([PYTHON, "-c", script, *args], stdout=sink, stderr=subprocess.PIPE, text=True,
                                   cwd=REPO, timeout=300)
    assert completed.returncode == 0 and json.loads(written.read_text()) == answer and marker.exists()


def test_internal_errors_are_short_without_debug(tmp_path: Path) -> None:
    script = ("import sys\nimport tunecast.cli.catalog_cmds as c\n"
              "def boom(*a, **k):\n    raise RuntimeError('boom')\n"
              "c.state = lambda ctx: type('S', (), {'catalog': boom})()\n"
              "from tunecast.cli import main\nmain(sys.argv[1:])\n")
    plain = run_subprocess(PYTHON, "-c", script, "gpus")
    assert plain.code == 1 and "internal error" in plain.stderr and "Traceback" not in plain.stderr
    debug = run_subprocess(PYTHON, "-c", script, "--debug", "gpus")
    assert debug.code == 1 and "Traceback" in debug.stderr


def test_each_command_is_registered_by_the_module_the_table_names() -> None:
    """A command imports only its own module (app.COMMAND_MODULES): the table must say who registers what."""
    import importlib

    import typer

    app_module = importlib.import_module("tunecast.cli.app")
    found: dict[str, str] = {}
    for name in dict.fromkeys(app_module.COMMAND_MODULES.values()):
        probe = typer.Typer()
        importlib.import_module(f"tunecast.cli.{name}").register(probe)
        for command in probe.registered_commands:
            found[command.name or ""] = name
        for group in probe.registered_groups:
            found[group.name or ""] = name
    assert found == app_module.COMMAND_MODULES


def test_a_command_loads_its_own_module_and_help_lists_every_command() -> None:
    script = ("import sys\nfrom tunecast.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "sys.stderr.write('LOADED=' + ','.join(sorted(m.rsplit('.', 1)[1] for m in sys.modules\n"
              "                  if m.startswith('tunecast.cli.') and m.endswith('_cmds'))))\n")
    gpus = run_subprocess(PYTHON, "-c", script, "--catalog", "nowhere", "gpus", "--json")
    assert "LOADED=catalog_cmds" in gpus.stderr, gpus.stderr[-500:]
    helped = run_subprocess(PYTHON, "-c", script, "--help")
    assert all(f" {command} " in helped.stdout for command in ("memory", "plan", "train", "models", "calibrate"))


def test_help_lists_the_commands_without_importing_the_library() -> None:
    """`tunecast --help` builds every command, but reads no RunSpec (pydantic) for the run-setting flags, and
    imports no catalog or estimator: that is what keeps it fast from a cold start (benchmarks/cold_start.py)."""
    script = ("import sys\nfrom tunecast.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "sys.stderr.write('HEAVY=' + ','.join(sorted(m for m in ('pydantic', 'numpy', 'yaml', 'torch',\n"
              "                  'tunecast.config.spec', 'tunecast.catalog.store') if m in sys.modules)))\n")
    for args in (["--help"], []):  # (a command's own parsing imports pydantic: typer validates option values with it)
        result = run_subprocess(PYTHON, "-c", script, *args)
        assert result.stderr.endswith("HEAVY="), result.stderr[-500:]


SPEC_COMMANDS = [["validate"], ["memory"], ["plan"], ["train"], ["calibrate"], ["export", "skypilot"],
                 ["export", "accelerate"], ["export", "axolotl"], ["export", "llamafactory"]]


def test_every_command_with_run_setting_flags_reads_their_help_when_shown() -> None:
    """A command registered with @spec_command but not cls=SpecCommand would show its flags without help: every
    command with a flag in the run-settings panel is a SpecCommand, and SPEC_COMMANDS lists them all."""
    import typer

    from tunecast.cli.app import app, register
    from tunecast.cli.spec_flags import PANEL, SpecCommand

    register()
    found = []

    def walk(command: Any, words: list[str]) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*words, name])
        if any(getattr(param, "rich_help_panel", None) == PANEL for param in command.params):
            assert isinstance(command, SpecCommand), f"{' '.join(words)}: register it with cls=SpecCommand"
            found.append(words)

    walk(typer.main.get_command(app), [])
    assert sorted(found) == sorted(SPEC_COMMANDS)


@pytest.mark.parametrize("words", SPEC_COMMANDS, ids=" ".join)
def test_a_commands_help_gives_each_run_setting_flag_its_fields_docstring(cli, monkeypatch, words) -> None:
    """The flags' help is read from RunSpec when a command's help is shown (cli/spec_flags.py SpecCommand)."""
    from tunecast.config.spec import LoraSpec

    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: the sentence is not wrapped
    result = cli(*words, "--help")
    first = " ".join((LoraSpec.model_fields["rank"].description or "").split()).split(". ")[0]
    assert result.code == 0 and first and "--lora-rank" in result.stdout
    line = next(line for line in result.stdout.splitlines() if "--lora-rank" in line)
    assert first in line


def test_no_command_leaves_a_process_behind(tmp_path: Path) -> None:
    """A quick command, its help and an error, run by the console script: once each has exited, no process
    started under it is left (found by a marker in the environment every child inherits)."""
    proc = Path("/proc")
    if not proc.is_dir():
        pytest.skip("needs /proc to list processes")
    script = str(Path(PYTHON).with_name("tunecast"))
    marker = f"TUNECAST_TEST_MARK={tmp_path.name}"
    env = {"TUNECAST_TEST_MARK": tmp_path.name, "TUNECAST_CACHE": str(tmp_path / "cache")}
    for args in (["memory", "--model", "meta-llama/Llama-3.2-1B", "--method", "lora"], ["gpus", "--json"],
                 ["--help"], ["memory", "--model", "nobody/no-such-model", "--offline"]):
        result = run_subprocess(script, *args, env=env)
        assert result.code in (0, 2), result.stderr[-500:]
    left = []
    for entry in proc.iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                left.append(entry.name)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    assert not left, f"processes left behind: {left}"
