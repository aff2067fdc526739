"""docs/runners.md shows every runner's differences as config/runner.py defines them."""

from tests.conftest import REPO

from tunecast.config.runner import RUNNERS
from tunecast.runners.profiles import differences_table


def test_the_documented_table_is_the_profiles_table() -> None:
    text = (REPO / "docs" / "runners.md").read_text()
    section = text.split("<!-- runner-differences:start -->\n", 1)[1].split("\n<!-- runner-differences:end -->", 1)[0]
    assert section == differences_table(), "run .venv/bin/python scripts/runner_table.py"
    for name in RUNNERS:
        if name != "tunecast":
            assert f"`{name}`" in section
