import pytest

from tunecast.errors import TunecastError
from tunecast.plan.breakeven import break_even, work_break_even


def test_the_quoted_example() -> None:
    result = break_even(purchase_usd=3800, rent_usd_per_hour=0.78, hours_per_month=350)
    assert result.as_dict()["breakeven_hours"] == 4871.8 and result.as_dict()["breakeven_months"] == 13.9


def test_power_and_resale() -> None:
    result = break_even(purchase_usd=3800, rent_usd_per_hour=0.78, hours_per_month=350, power_w=450,
                        usd_per_kwh=0.2, resale_usd=800)
    assert result.power_usd_per_hour == pytest.approx(0.09)
    assert result.breakeven_hours == pytest.approx(3000 / 0.69)


def test_renting_forever_cheaper_when_power_costs_more_than_rent() -> None:
    result = break_even(purchase_usd=1000, rent_usd_per_hour=0.05, hours_per_month=100, power_w=500, usd_per_kwh=0.2)
    assert result.breakeven_hours is None and result.as_dict()["breakeven_months"] is None


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"purchase_usd": -1}, "--purchase-usd"), ({"hours_per_month": 800}, "--hours-per-month"),
    ({"resale_usd": 5000}, "--resale-usd"), ({"power_w": 300}, "--power-w")])
def test_bad_inputs_name_the_flag(kwargs, field) -> None:
    values = {"purchase_usd": 3800, "rent_usd_per_hour": 0.78, "hours_per_month": 350, **kwargs}
    with pytest.raises(TunecastError) as error:
        break_even(**values)
    assert error.value.field == field


def test_in_units_of_work_a_slower_owned_card_needs_more_hours() -> None:
    result = work_break_even(purchase_usd=1600, resale_usd=0, owned_hours_per_run=10, rented_hours_per_run=2,
                             rented_usd_per_run=8, power_usd_per_hour=0.1, hours_per_month=200)
    # each run saves 8 - 10 × 0.1 = 7 dollars; 1600 / 7 runs of 10 owned hours each
    assert result.breakeven_runs == pytest.approx(1600 / 7)
    assert result.breakeven_months == pytest.approx(1600 / 7 * 10 / 200)
