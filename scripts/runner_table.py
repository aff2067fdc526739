"""docs/runners.md's table of every runner's differences from tunecast's step, from src/tunecast/config/runner.py
and step/variants.py.

Run:  .venv/bin/python scripts/runner_table.py     (tests/unit/runners/test_runner_docs.py checks it is current)
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from docsection import write_section  # noqa: E402

from tunecast.runners.profiles import differences_table  # noqa: E402

DOC = REPO / "docs" / "runners.md"
MARK = "runner-differences"

if __name__ == "__main__":
    write_section(DOC, MARK, differences_table())
