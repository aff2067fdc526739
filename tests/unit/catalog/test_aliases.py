"""Aliases: other Hub ids under which a catalog model's config.json is published (a renamed repository's old id, a
mirror). An alias is served with its model's config and keeps its own name: the repository weights come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunecast.catalog.listing import model_documents
from tunecast.catalog.models import ModelEntry
from tunecast.catalog.resolve import resolve_model
from tunecast.catalog.store import load_catalog
from tunecast.errors import ConfigError

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 1000}
ALIAS_HEADER = "alias,name,kind,as_of,source,notes\n"


def _user_catalog(directory: Path, aliases: str, models: tuple[str, ...] = ("acme/tiny",)) -> Path:
    (directory / "models").mkdir(parents=True)
    rows = ["name,file,params,as_of,source,notes"]
    for name in models:
        file = name.replace("/", "__") + ".json"
        (directory / "models" / file).write_text(json.dumps(CONFIG))
        rows.append(f"{name},{file},123,2026-12-01,a test,")
    (directory / "models.csv").write_text("\n".join(rows) + "\n")
    (directory / "model_aliases.csv").write_text(ALIAS_HEADER + aliases)
    return directory


def test_a_renamed_id_is_served_with_its_models_config_under_its_own_name(catalog) -> None:
    old = catalog.models.find("meta-llama/Meta-Llama-3.1-8B-Instruct")
    new = catalog.models.find("meta-llama/Llama-3.1-8B-Instruct")
    assert old is not None and new is not None
    assert (old.name, old.alias_of, old.origin) == ("meta-llama/Meta-Llama-3.1-8B-Instruct",
                                                    "meta-llama/Llama-3.1-8B-Instruct", "catalog")
    assert old.data == new.data and old.params == new.params == 8_030_261_248
    assert "oumi-ai/oumi/pull/1357" in (old.source or "") and new.alias_of is None


def test_resolving_a_mirror_keeps_the_mirror_as_the_repository_to_load(catalog) -> None:
    mirror = resolve_model("nousresearch/meta-llama-3-8b", catalog)
    assert (mirror.name, mirror.alias_of) == ("NousResearch/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B")
    assert mirror.data == resolve_model("meta-llama/Meta-Llama-3-8B", catalog).data


def test_a_renamed_id_takes_the_part_after_the_slash_only_where_nothing_else_has_it(tmp_path) -> None:
    """A mirror's part after the slash names nothing (a short name would train on the mirror's copy)."""
    catalog = load_catalog(_user_catalog(tmp_path, "old/tiny,acme/tiny,renamed,2026-12-01,a test,\n"
                                                   "old/Tiny-Old,acme/tiny,renamed,2026-12-01,a test,\n"
                                                   "old-b/Tiny-Chat,acme/tiny,renamed,2026-12-01,a test,\n"
                                                   "old-c/Tiny-Chat,acme/tiny,renamed,2026-12-01,a test,\n"
                                                   "mirror-c/Tiny-Base,acme/tiny,mirror,2026-12-01,a test,\n"))
    assert catalog.models.find("tiny").name == "acme/tiny"  # a model's own short name stays its own
    assert catalog.models.find("tiny-old").name == "old/Tiny-Old"
    assert catalog.models.find("tiny-chat") is None  # two renamed ids share it
    assert catalog.models.find("tiny-base") is None  # a mirror's
    assert catalog.models.find("MIRROR-C/tiny-base").name == "mirror-c/Tiny-Base"


def test_an_alias_of_a_model_the_catalog_lacks_is_refused_naming_the_file_and_the_alias(tmp_path) -> None:
    directory = _user_catalog(tmp_path, "mirror/tiny,acme/missing,mirror,2026-12-01,a test,\n")
    with pytest.raises(ConfigError, match=r"model_aliases\.csv: 1 problem") as error:
        load_catalog(directory)
    problem = error.value.problems[0]
    assert problem.field == f"{directory}/model_aliases.csv: mirror/tiny"
    assert "'acme/missing', which is not a model of the catalog" in problem.message


def test_an_alias_row_needs_a_known_kind_and_a_source(tmp_path) -> None:
    directory = _user_catalog(tmp_path, "mirror/tiny,acme/tiny,copy,2026-12-01,,\n")
    with pytest.raises(ConfigError) as error:
        load_catalog(directory)
    fields = {problem.field for problem in error.value.problems}
    assert fields == {f"{directory}/model_aliases.csv:2 (kind)", f"{directory}/model_aliases.csv:2 (source)"}


def test_a_model_of_the_same_id_replaces_an_alias(tmp_path) -> None:
    directory = _user_catalog(tmp_path, "", models=("acme/tiny", "meta-llama/Meta-Llama-3.1-8B"))
    model = load_catalog(directory).models.find("meta-llama/Meta-Llama-3.1-8B")
    assert model is not None and (model.alias_of, model.params) == (None, 123)


def test_a_model_added_to_a_loaded_index_keeps_its_aliases(catalog, tmp_path) -> None:
    path = tmp_path / "acme__tiny.json"
    path.write_text(json.dumps(CONFIG))
    entry = ModelEntry.model_validate({"name": "acme/tiny", "file": path.name, "params": 123,
                                       "as_of": "2026-12-01", "source": "a test"})
    models = catalog.models.with_entry(entry, path)
    assert models.find("acme/tiny").params == 123 and len(models) == len(catalog.models) + 1
    assert [alias.alias for alias in models.aliases] == [alias.alias for alias in catalog.models.aliases]


def test_the_listing_names_each_models_aliases(catalog) -> None:
    documents = {d["name"]: d for d in model_documents(catalog, search="Llama 3.1 8B")}
    assert documents["meta-llama/Llama-3.1-8B"]["aliases"] == ["meta-llama/Meta-Llama-3.1-8B",
                                                               "NousResearch/Meta-Llama-3.1-8B",
                                                               "unsloth/Llama-3.1-8B", "unsloth/Meta-Llama-3.1-8B"]
    assert documents["meta-llama/Llama-3.1-8B-Instruct"]["aliases"] == ["meta-llama/Meta-Llama-3.1-8B-Instruct",
                                                                        "unsloth/Llama-3.1-8B-Instruct",
                                                                        "unsloth/Meta-Llama-3.1-8B-Instruct"]


def test_every_bundled_alias_is_sourced_and_shadowed_by_no_model(catalog) -> None:
    names = {name.lower() for name in catalog.models.names}
    assert catalog.models.aliases, "the bundled catalog has aliases"
    for alias in catalog.models.aliases:
        assert alias.alias.lower() not in names, alias.alias
        assert "github.com/" in alias.source or "https://" in alias.source, alias.alias
        assert catalog.models.find(alias.alias).alias_of == alias.name
