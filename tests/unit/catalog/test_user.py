"""The user's catalog: added models (the parameter count handed in by the caller) and the rule that
catalog/ imports neither estimate/ nor torch."""

import ast
import json
from pathlib import Path

import pytest
from tests.conftest import PYTHON, run_subprocess

import tunecast.catalog
from tunecast.catalog.store import load_catalog
from tunecast.catalog.user import add_model, read_model_config
from tunecast.errors import TunecastError

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 1000}

IMPORT_EVERY_CATALOG_MODULE = """
import importlib, json, pkgutil, sys
import tunecast.catalog
names = sorted(m.name for m in pkgutil.iter_modules(tunecast.catalog.__path__, "tunecast.catalog."))
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("tunecast.estimate"))
print(json.dumps({"imported": names, "forbidden": loaded}))
"""


def test_catalog_imports_neither_estimate_nor_torch() -> None:
    result = run_subprocess(PYTHON, "-c", IMPORT_EVERY_CATALOG_MODULE)
    assert result.code == 0, result.stderr
    document = json.loads(result.stdout)
    assert "tunecast.catalog.user" in document["imported"] and "tunecast.catalog.resolve" in document["imported"]
    assert document["forbidden"] == []


def test_no_catalog_module_imports_estimate_or_torch_even_lazily() -> None:
    """Imports inside functions run only when called, so the source is read as well (shared/DESIGN.md:
    catalog/ sits below estimate/ and imports no torch)."""
    forbidden = ("tunecast.estimate", "torch", "transformers", "peft", "accelerate")
    found = []
    for path in sorted(Path(tunecast.catalog.__path__[0]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} {name}" for name in names
                      if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert found == []


def test_add_model_keeps_the_count_it_is_given_and_replaces_by_name(tmp_path) -> None:
    user = tmp_path / "catalog"
    entry, path = add_model(CONFIG, name="me/tiny", params=123, source="written for the test", user_dir=user)
    assert (entry.name, entry.params, entry.source) == ("me/tiny", 123, "written for the test")
    assert json.loads(path.read_text()) == CONFIG and path.parent.parent == user.resolve()
    add_model({**CONFIG, "vocab_size": 2000}, name="me/tiny", params=456, source="again", user_dir=user)
    models = load_catalog(user).models
    assert [n for n in models.names if n == "me/tiny"] == ["me/tiny"]
    assert models.entry("me/tiny").params == 456 and models.find("me/tiny").data["vocab_size"] == 2000


def test_add_model_needs_an_org_slash_name(tmp_path) -> None:
    with pytest.raises(TunecastError, match="is not a model id of the form org/name"):
        add_model(CONFIG, name="tiny", params=1, source="test", user_dir=tmp_path)


def test_read_model_config_from_a_file_or_a_model_directory(tmp_path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    assert read_model_config(tmp_path / "model") == read_model_config(tmp_path / "model" / "config.json") == CONFIG
    with pytest.raises(TunecastError, match="does not exist") as error:
        read_model_config(tmp_path / "missing.json")
    assert error.value.field == "config"
