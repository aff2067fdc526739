"""--model given as a local path that is not there: say what is there, and never offer a download for it."""

import json
from pathlib import Path

import pytest

from tunecast.catalog.resolve import resolve_model
from tunecast.errors import TunecastError

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 1000}


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding models/my-model/config.json."""
    folder = tmp_path / "models" / "my-model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_misspelt_folder_under_an_existing_one_is_a_local_path_not_a_hub_id(catalog, models: Path) -> None:
    with pytest.raises(TunecastError, match=r"models/my-modle does not exist \(.*models has no 'my-modle'\)") as error:
        resolve_model("models/my-modle", catalog)
    assert "--allow-download" not in str(error.value.hint) and "Did you mean 'my-model'?" in str(error.value.hint)


@pytest.mark.parametrize("name", ["./nowhere", "../nowhere/model", "~/no-such-model-here", "weights.json"])
def test_a_name_written_as_a_path_gets_no_download_hint(catalog, models: Path, name: str) -> None:
    with pytest.raises(TunecastError, match="does not exist") as error:
        resolve_model(name, catalog)
    assert "--allow-download" not in str(error.value.hint) and "config.json" in str(error.value.hint)


def test_a_folder_without_config_json_gets_no_download_hint(catalog, models: Path) -> None:
    (models / "empty").mkdir()
    with pytest.raises(TunecastError, match=r"has no config\.json") as error:
        resolve_model("empty", catalog)
    assert "--allow-download" not in str(error.value.hint)


def test_a_misspelt_model_folder_name_is_suggested(catalog, models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(models / "models")
    with pytest.raises(TunecastError, match="unknown model 'my-modle'") as error:
        resolve_model("my-modle", catalog)
    assert str(error.value.hint).startswith("Did you mean the model folder 'my-model'?")


def test_a_hub_id_still_offers_the_download(catalog, models: Path) -> None:
    with pytest.raises(TunecastError, match="not a local path and not in the catalog") as error:
        resolve_model("some-org/some-model", catalog)
    assert "--allow-download" in str(error.value.hint)
