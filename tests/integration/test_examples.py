"""Every shipped example, with every method the CLI offers for it, trains a few steps or is refused before training
in one line with exit status 2 — never an internal error.

The examples are found in examples/ (a new one is covered without editing this file). One that names a dataset
file trains here, on the CPU: two steps of each method, then the final evaluation, with its output in tmp_path.
One of declared size (dataset.examples and mean_tokens, no file) is a planning example: `train` must refuse it
before anything runs, and `validate` must accept it with each method. Runs start in fresh processes forked from a
warm server (tests/forkserver.py), which pays for torch's import once.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tests.trainruns import REPO, ForkServer, train_losses

from tunecast.config.spec import RunSpec

EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))
METHODS = typing.get_args(RunSpec.model_fields["method"].annotation)
STEPS = 2
# A step limit given on the command line caps the file's epochs (issue 29: the override wins).
FEW_STEPS = ["--set", f"max_steps={STEPS}"]


def _trains_here(example: Path) -> bool:
    """An example with a dataset file trains; one of declared size plans only."""
    document = yaml.safe_load(example.read_text()) or {}
    return bool((document.get("dataset") or {}).get("path"))


def _refused_method(example: Path, method: str) -> bool:
    """QLoRA of a diffusion pipeline (a folder with a model_index.json) is refused in one line: not built yet."""
    model = (yaml.safe_load(example.read_text()) or {}).get("model", "")
    return method == "qlora" and (example.parent / model / "model_index.json").is_file()


CASES = [pytest.param(example, method, id=f"{example.relative_to(REPO / 'examples')}-{method}")
         for example in EXAMPLES for method in METHODS]


# the memory check's traces of the tiny model, shared with the estimator tests (the fork server passes TUNECAST_*)
pytestmark = pytest.mark.usefixtures("profile_cache")


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    forks = ForkServer.start(warm=("diffusers",))  # the diffusion examples' runs too
    yield forks
    forks.stop()


def _no_internal_error(log: str) -> None:
    assert "Traceback" not in log and "internal error" not in log and "This is a bug" not in log, log[-3000:]


def test_the_examples_are_found() -> None:
    """The discovery is not empty: at least the training demo, and the methods of RunSpec."""
    assert any(_trains_here(example) for example in EXAMPLES)
    assert METHODS


@pytest.mark.parametrize(("example", "method"), CASES)
def test_each_example_trains_a_few_steps_or_is_refused_in_one_line(server: ForkServer, example: Path, method: str,
                                                                   tmp_path: Path) -> None:
    output = tmp_path / "out"
    log = tmp_path / "log.txt"
    code = server.run(["train", str(example), "--method", method, "--set", f"output={output}", *FEW_STEPS], log)
    text = log.read_text()
    _no_internal_error(text)
    if _trains_here(example) and not _refused_method(example, method):
        assert code == 0, text[-3000:]
        assert sorted(train_losses(output)) == list(range(1, STEPS + 1))
        assert (output / "final").is_dir()
        return
    assert code == 2, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    # refused before training: no step, and nothing written, not even the output's lock
    assert not any(line.startswith("step ") for line in text.splitlines()), text
    assert not output.exists()


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not _trains_here(e)],
                         ids=lambda e: str(e.relative_to(REPO / "examples")))
def test_a_planning_example_is_valid_with_every_method(server: ForkServer, example: Path, tmp_path: Path) -> None:
    for method in METHODS:
        log = tmp_path / f"{method}.txt"
        code = server.run(["validate", str(example), "--method", method], log)
        _no_internal_error(log.read_text())
        assert code == 0, log.read_text()[-3000:]
