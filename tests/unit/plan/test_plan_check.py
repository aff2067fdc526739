"""`check_failure`: the pre-flight gate of `tunecast plan --check` over a plan document."""

from __future__ import annotations

from typing import Any

from tunecast.plan.report import check_failure


def _option(fits: bool, total_usd: float | None, hours: float | None, note: str | None = None) -> dict[str, Any]:
    return {"gpu": "rtx-4080", "gpu_count": 2, "fits": fits, "total_usd": total_usd, "hours": hours,
            "notes": [note] if note else []}


def _plan(*options: dict[str, Any], budget: float | None = None, deadline: float | None = None,
          filtered_out: int = 0) -> dict[str, Any]:
    return {"options": list(options), "budget_usd": budget, "deadline_hours": deadline,
            "filtered_out": filtered_out, "recommendations": []}


def test_one_fitting_option_passes() -> None:
    assert check_failure(_plan(_option(False, None, None, "does not fit: 3 GiB over"), _option(True, 4.0, 2.0))) is None
    assert check_failure(_plan(_option(True, None, 2.0))) is None  # no price: fits, and no budget asked


def test_nothing_fits_names_an_option_and_its_reason() -> None:
    failure = check_failure(_plan(_option(False, None, None, "does not fit: at best 20.5 GiB per GPU, 5.6 GiB over")))
    assert failure == "no option fits (2×rtx-4080: at best 20.5 GiB per GPU, 5.6 GiB over)"


def test_a_budget_or_deadline_needs_an_option_known_to_meet_it() -> None:
    unpriced = _option(True, None, 2.0)
    assert check_failure(_plan(unpriced, budget=10.0)) == "no option that fits meets a budget of $10.00"
    assert check_failure(_plan(unpriced, deadline=3.0)) is None
    assert check_failure(_plan(_option(True, 4.0, 2.0), budget=10.0, deadline=1.5)) == \
        "no option that fits meets a budget of $10.00 and a deadline of 1.5 h"
    # every fitting option was dropped by the budget: the limits, not the memory, are the reason
    assert check_failure(_plan(budget=1.0, filtered_out=3)) == "no option that fits meets a budget of $1.00"
