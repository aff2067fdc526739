"""What config tests share."""

from __future__ import annotations

import pytest

from tunecast.errors import ConfigError


def problems_of(error: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    """Each problem of a refused config by its field: where, what and how to fix it, on one line."""
    return {p.field or "": f"{p.location}: {p.message} | {p.hint}" for p in error.value.problems}
