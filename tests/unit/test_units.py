from tunecast.units import BYTES_PER_GIB, bytes_to_gib, format_params, format_usd


def test_gib_is_binary_and_gb_decimal() -> None:
    assert BYTES_PER_GIB == 2**30 and bytes_to_gib(2**31) == 2.0


def test_formatting() -> None:
    assert format_params(8_030_261_248) == "8.03 B" and format_params(596_049_920) == "596 M"
    assert (format_usd(0.435), format_usd(0.78), format_usd(1599)) == ("$0.435", "$0.78", "$1,599.00")
    assert (format_usd(0.7), format_usd(0.0017), format_usd(0)) == ("$0.70", "$0.002", "$0")  # $/h column: $0.70
