"""--model given as a local path that is not there: say what is there, and never send it to the Hub."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.hub import standing_hub

from tunecast.catalog.resolve import resolve_model
from tunecast.errors import TunecastError

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 1000}


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory holding models/my-model/config.json, with a stand-in Hub reachable that no test here may
    ask (the suite is offline otherwise, and would refuse before any request)."""
    folder = tmp_path / "models" / "my-model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.chdir(tmp_path)
    with standing_hub(monkeypatch) as hub:
        yield tmp_path
    assert hub.asked == []


def test_a_misspelt_folder_under_an_existing_one_is_a_local_path_not_a_hub_id(catalog, models: Path) -> None:
    with pytest.raises(TunecastError, match=r"models/my-modle does not exist \(.*models has no 'my-modle'\)") as error:
        resolve_model("models/my-modle", catalog)
    assert "Hub" not in str(error.value.hint) and "Did you mean 'my-model'?" in str(error.value.hint)


@pytest.mark.parametrize("name", ["./nowhere", "../nowhere/model", "~/no-such-model-here", "weights.json"])
def test_a_name_written_as_a_path_is_not_sent_to_the_hub(catalog, models: Path, name: str) -> None:
    with pytest.raises(TunecastError, match="does not exist") as error:
        resolve_model(name, catalog)
    assert "Hub" not in str(error.value.hint) and "config.json" in str(error.value.hint)


def test_a_folder_without_config_json_is_not_sent_to_the_hub(catalog, models: Path) -> None:
    (models / "empty").mkdir()
    with pytest.raises(TunecastError, match=r"has no config\.json") as error:
        resolve_model("empty", catalog)
    assert "Hub" not in str(error.value.hint)


def test_a_misspelt_model_folder_name_is_suggested(catalog, models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(models / "models")
    with pytest.raises(TunecastError, match="unknown model 'my-modle'") as error:
        resolve_model("my-modle", catalog)
    assert str(error.value.hint).startswith("Did you mean the model folder 'my-model'?")


def test_a_hub_id_is_what_goes_to_the_hub(catalog, models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An org/name whose first folder is not here is a Hub id: asked for, and refused offline with what to pass."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TunecastError, match="'some-org/some-model': not a local path nor in the catalog, and offline "
                                            "mode") as error:
        resolve_model("some-org/some-model", catalog)
    assert "local model directory holding config.json" in str(error.value.hint)
