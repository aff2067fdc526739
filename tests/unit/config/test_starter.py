"""The starter config is valid, complete and at the defaults."""

import yaml

from tunecast.catalog.store import load_catalog
from tunecast.config.load import load_spec
from tunecast.config.spec import RunSpec
from tunecast.config.starter import starter_yaml


def test_starter_is_valid_and_equals_the_defaults(tmp_path) -> None:
    path = tmp_path / "tunecast.yaml"
    path.write_text(starter_yaml("meta-llama/Llama-3.1-8B", str(path)))
    loaded = load_spec(path, [], load_catalog(None))
    assert loaded.spec == RunSpec(model="meta-llama/Llama-3.1-8B")


def test_starter_writes_every_key_with_its_docstring() -> None:
    text = starter_yaml("m/x", "run.yaml")
    data = yaml.safe_load(text)
    assert set(RunSpec.model_fields) - {"global_batch", "max_steps", "output", "runner_version",
                                        "bitsandbytes_version", "transformers_version"} <= set(data)
    assert "# Rank r of each adapter matrix. Default 8" in text
    assert "# max_steps: 1000" in text  # unset optional keys are shown commented out with an example
