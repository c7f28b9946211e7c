"""Sizes in words (fedps/units.py)."""

from __future__ import annotations

import pytest

from fedps.units import size_text


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (812, "812 B"),
        (999, "999 B"),
        (1000, "1 kB"),
        (45_210, "45.21 kB"),
        (999_900, "999.9 kB"),
        (999_950, "1 MB"),
        (999.6, "1 kB"),
        (1_234_567, "1.235 MB"),
        (12_400_000, "12.4 MB"),
        (116_000_000_000, "116 GB"),
        (3e15, "3000 TB"),
    ],
)
def test_a_size_has_its_unit_and_at_most_four_significant_digits(
    num_bytes: float, text: str
) -> None:
    assert size_text(num_bytes) == text
