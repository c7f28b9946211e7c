"""Tests for ``fedps bench --parties``: both settings measured, alternating, in one run."""

from __future__ import annotations

import pytest
from rich.console import Console

from fedps.bench.parties_bench import render_parties, run_parties_bench
from fedps.errors import InvalidArgumentError


@pytest.mark.slow
def test_the_parties_bench_times_both_settings_and_their_ratio() -> None:
    # Execute: a tiny model, two repeats
    result = run_parties_bench(size=3000, repeats=2, console=Console(quiet=True))
    # Assert: every setting measured in every repeat, the ratios of the medians
    for what in ("keygen_s", "decrypt_s"):
        assert sorted(result["runs"][what]) == ["1", "3"]
        assert all(len(times) == 2 for times in result["runs"][what].values())
    assert result["decrypt_ratio"] == result["decrypt_s"]["3"] / result["decrypt_s"]["1"]
    assert result["blocks"] == 2
    text = render_parties(result)
    assert "key generation" in text and "one round's decryption" in text


def test_the_parties_bench_needs_parties_and_a_quorum() -> None:
    with pytest.raises(InvalidArgumentError):
        run_parties_bench(parties=1, console=Console(quiet=True))
    with pytest.raises(InvalidArgumentError):
        run_parties_bench(clients=1, console=Console(quiet=True))
