"""Bond amounts and the slash split (design §8, §12): exact decimals, never floats.

What a bond holder, a reporter and the treasury rely on: a slashed amount is split at its own
decimal scale, harmed and reporter shares floored, the treasury taking the rest, so the three
always add up to the amount exactly; and slashes checked against what remains never overdraw
the bond. Amounts are the strings `registry.trust.AMOUNT` admits (up to 30 integer and 18
fractional digits), shares any non-negative fractions adding up to exactly 1.
"""

from __future__ import annotations

from decimal import Context, Decimal, localcontext
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry import trust
from registry.errors import Invalid

EXACT = Context(prec=200)  # the tests' own arithmetic: far beyond any amount or share here


def exact_sum(*parts: Decimal) -> Decimal:
    with localcontext(EXACT):
        return sum(parts, Decimal(0))


def exact_product(a: Decimal, b: Decimal) -> Decimal:
    with localcontext(EXACT):
        return a * b


def scale_of(value: Decimal) -> int:
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    return -exponent


def amount_text(whole: int, scale: int, fraction: int) -> str:
    return str(whole) if scale == 0 else f"{whole}.{fraction:0{scale}d}"


@st.composite
def amounts(draw: st.DrawFn, *, max_whole: int = 10**30 - 1) -> str:
    """An amount string as a client sends it: 0..30 integer digits, scale 0..18."""
    scale = draw(st.integers(0, 18))
    whole = draw(st.integers(0, max_whole))
    fraction = draw(st.integers(0, 10**scale - 1))
    return amount_text(whole, scale, fraction)


# Up to 60 fractional digits: beyond the 28 digits of decimal's default context and, with a
# 48-digit amount, beyond 80-digit products, where a rounded sum or product would show.
MAX_SHARE_DIGITS = 60


@st.composite
def shares(draw: st.DrawFn) -> trust.Shares:
    """Random non-negative shares adding up to exactly 1: integers over a common 10^k, drawn
    digit by digit so that long shares have digits all the way down."""

    def up_to(limit: int) -> int:
        width = len(str(limit))
        digits = draw(st.lists(st.sampled_from("0123456789"), min_size=width, max_size=width))
        return int("".join(digits)) % (limit + 1)

    k = draw(st.integers(0, MAX_SHARE_DIGITS))
    denominator = 10**k
    a = up_to(denominator)
    b = up_to(denominator - a)
    parts = draw(st.permutations([a, b, denominator - a - b]))
    harmed, reporter, treasury = (Decimal(f"{p}E-{k}") for p in parts)  # exact construction
    return trust.Shares(harmed, reporter, treasury)


# --- the split -------------------------------------------------------------------------------


def test_the_designs_worked_example() -> None:
    split = trust.split_slash(Decimal("33.10"), trust.Shares())
    assert (split.harmed, split.reporter, split.treasury) == (
        Decimal("16.55"),
        Decimal("9.93"),
        Decimal("6.62"),
    )
    assert split.to_json() == {
        "harmedPartiesShare": "16.55",
        "reporterShare": "9.93",
        "treasuryShare": "6.62",
    }


@pytest.mark.parametrize(
    ("amount", "expected"),
    [
        ("100.00", ("50.00", "30.00", "20.00")),
        ("0.01", ("0.00", "0.00", "0.01")),  # the rounding remainder goes to the treasury
        ("0.03", ("0.01", "0.00", "0.02")),
        ("1000", ("500", "300", "200")),
        ("1", ("0", "0", "1")),
        ("7", ("3", "2", "2")),
        ("0.000000000000000001", ("0.000000000000000000",) * 2 + ("0.000000000000000001",)),
    ],
)
def test_default_shares_at_the_amounts_scale(amount: str, expected: tuple[str, str, str]) -> None:
    split = trust.split_slash(trust.parse_amount(amount, "amount"), trust.Shares())
    assert tuple(split.to_json().values()) == expected


@given(text=amounts(), shares=shares())
def test_the_split_adds_up_exactly_and_floors_at_the_amounts_scale(
    text: str, shares: trust.Shares
) -> None:
    amount = trust.parse_amount(text, "amount", positive=False)
    split = trust.split_slash(amount, shares)
    parts = (split.harmed, split.reporter, split.treasury)

    assert exact_sum(*parts) == amount
    assert all(part >= 0 for part in parts)
    assert [scale_of(part) for part in parts] == [scale_of(amount)] * 3
    unit = Decimal(1).scaleb(-scale_of(amount))
    for part, share in ((split.harmed, shares.harmed), (split.reporter, shares.reporter)):
        owed = exact_product(amount, share)
        assert part <= owed < exact_sum(part, unit)
    # The wire form: each share a valid amount string with the amount's fractional digits.
    for shown in split.to_json().values():
        assert trust.AMOUNT.match(shown)
        assert len(shown.partition(".")[2]) == scale_of(amount)


@given(data=st.data(), bond_text=amounts(), shares=shares())
def test_slashes_checked_against_what_remains_never_overdraw_the_bond(
    data: st.DataObject, bond_text: str, shares: trust.Shares
) -> None:
    bonded = trust.parse_amount(bond_text, "amount", positive=False)
    accepted: list[Decimal] = []
    paid_out = Decimal(0)
    for _ in range(data.draw(st.integers(0, 8), label="slashes")):
        left = trust.remaining(bonded, accepted)
        if left > 0 and data.draw(st.booleans(), label="take the rest"):
            text = trust.format_amount(left)
        else:
            scale = data.draw(st.integers(0, 18), label="scale")
            # Up to about 1.5 × what is left, so some slashes fit and some do not.
            ceiling = max(1, int(left.scaleb(scale) * 3 / 2) + 1)
            units = data.draw(st.integers(1, min(ceiling, 10**30 - 1)), label="units")
            text = amount_text(units // 10**scale, scale, units % 10**scale)
        amount = trust.parse_amount(text, "amount")
        if amount > left:
            continue  # refused: slash_exceeds_bond, the bond is unchanged
        split = trust.split_slash(amount, shares)
        paid_out = exact_sum(paid_out, split.harmed, split.reporter, split.treasury)
        accepted.append(amount)
        assert trust.remaining(bonded, accepted) >= 0
    left = trust.remaining(bonded, accepted)
    assert left >= 0
    assert exact_sum(left, paid_out) == bonded  # nothing lost, nothing made up


def test_remaining_is_exact_at_full_precision() -> None:
    bonded = trust.parse_amount("9" * 30 + "." + "9" * 18, "amount")
    slashed = [Decimal("0." + "0" * 17 + "1"), Decimal("9" * 30)]
    assert trust.remaining(bonded, slashed) == Decimal("0." + "9" * 17 + "8")
    assert trust.remaining(bonded, [bonded]) == 0


# --- shares ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("harmed", "reporter", "treasury"),
    [
        ("0.5", "0.3", "0.3"),  # 1.1
        ("0.5", "0.3", "0.1"),  # 0.9
        ("0", "0", "0"),
        ("1.2", "-0.2", "0"),  # adds up to 1, but a negative share
        ("0.5", "0.5", "0.000001"),
    ],
)
def test_shares_that_are_negative_or_do_not_add_up_to_one_are_refused(
    harmed: str, reporter: str, treasury: str
) -> None:
    with pytest.raises(ValueError, match="add up to 1"):
        trust.Shares(Decimal(harmed), Decimal(reporter), Decimal(treasury))


def test_the_default_shares_are_50_30_20() -> None:
    assert trust.Shares() == trust.Shares(Decimal("0.5"), Decimal("0.3"), Decimal("0.2"))


# --- amounts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "1e5",
        "1E5",
        "-1",
        "+1",
        "0",
        "0.00",
        "01",
        "00.5",
        "1.",
        ".5",
        "1,5",
        " 1",
        "1 ",
        "",
        "NaN",
        "Infinity",
        "1" * 31,
        "1." + "1" * 19,
        "١",  # an Arabic-Indic digit: Decimal() would take it
    ],
)
def test_parse_amount_refuses_what_is_not_a_plain_positive_decimal(text: str) -> None:
    with pytest.raises(Invalid) as caught:
        trust.parse_amount(text, "slash.amount")
    assert caught.value.code == "invalid_amount"
    assert caught.value.details == {"field": "slash.amount"}


@pytest.mark.parametrize("value", [1, 1.5, Decimal("1.5"), None, b"1.5", ["1"]])
def test_parse_amount_refuses_non_strings(value: Any) -> None:
    with pytest.raises(Invalid) as caught:
        trust.parse_amount(value, "amount")
    assert caught.value.code == "invalid_amount"


@pytest.mark.parametrize("text", ["12.50\n", "12.50\r\n", "\n12.50"])
def test_parse_amount_refuses_a_line_break(text: str) -> None:
    with pytest.raises(Invalid) as caught:
        trust.parse_amount(text, "amount")
    assert caught.value.code == "invalid_amount"


def test_zero_is_an_amount_where_zero_is_allowed() -> None:
    assert trust.parse_amount("0", "amount", positive=False) == 0
    assert trust.format_amount(trust.parse_amount("0.00", "amount", positive=False)) == "0.00"


@pytest.mark.parametrize(
    "text", ["1", "0.5", "6.60", "0.01", "1000", "9" * 30 + "." + "9" * 18, "0." + "0" * 17 + "1"]
)
def test_parse_then_format_keeps_the_string(text: str) -> None:
    assert trust.format_amount(trust.parse_amount(text, "amount")) == text


@given(text=amounts())
def test_every_valid_amount_round_trips_with_its_scale(text: str) -> None:
    assert trust.AMOUNT.match(text)
    assert trust.format_amount(trust.parse_amount(text, "amount", positive=False)) == text


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (Decimal("6.60"), "6.60"),
        (Decimal("0.01"), "0.01"),
        (Decimal("1000"), "1000"),
        (Decimal("1E+3"), "1000"),  # never an exponent
        (Decimal("1E-7"), "0.0000001"),
        (Decimal("0E-18"), "0.000000000000000000"),
    ],
)
def test_format_amount_is_plain_and_keeps_the_scale(value: Decimal, shown: str) -> None:
    assert trust.format_amount(value) == shown


# --- precision: exact whatever the digits --------------------------------------------------


@pytest.mark.parametrize(
    ("harmed", "reporter", "treasury", "adds_up"),
    [
        ("0.5", "0.5", "1E-30", False),  # 1 + 1E-30: a 28-digit sum would round it to 1
        (  # exactly 1: a 28-digit sum would make it 0.9999999999999999999999999999
            "0.12345678901234567890123456784999",
            "0.20000000000000000000000000004999",
            "0.67654321098765432109876543210002",
            True,
        ),
    ],
    ids=["refuses-1+1e-30", "accepts-exact-32-digit-shares"],
)
def test_shares_are_checked_with_exact_arithmetic(
    harmed: str, reporter: str, treasury: str, adds_up: bool
) -> None:
    parts = Decimal(harmed), Decimal(reporter), Decimal(treasury)
    assert (exact_sum(*parts) == 1) is adds_up
    if adds_up:
        trust.Shares(*parts)
    else:
        with pytest.raises(ValueError, match="add up to 1"):
            trust.Shares(*parts)


def test_the_floor_holds_for_shares_of_any_precision() -> None:
    with localcontext(EXACT):
        tiny = Decimal(1).scaleb(-85)
        shares = trust.Shares(Decimal("0.5") - tiny, Decimal("0.5") + tiny, Decimal(0))
    amount = trust.parse_amount("2" + "0" * 29 + "." + "0" * 17 + "2", "amount")
    split = trust.split_slash(amount, shares)
    # amount × harmed is 1E+29 + 1E-18 less ~1E-56: a product rounded to 80 digits would floor
    # to 1E+29 + 1E-18, more than the harmed parties are owed.
    assert split.harmed <= exact_product(amount, shares.harmed)
    assert split.to_json() == {
        "harmedPartiesShare": "1" + "0" * 29 + "." + "0" * 18,
        "reporterShare": "1" + "0" * 29 + "." + "0" * 17 + "1",
        "treasuryShare": "0." + "0" * 17 + "1",
    }
