"""A client's round line names the peers that refused its calls and counts them (issue 27; the
client that survives them: tests/integration/test_client_survives.py)."""

from __future__ import annotations

from clients.edge_client import ClientSummary, RoundProgress


def _progress(**fields: object) -> RoundProgress:
    values: dict[str, object] = {
        "client_id": "client-0",
        "round": 3,
        "rounds": 20,
        "samples": 412,
        "loss": 0.4123,
        "epsilon": 1.8412,
        "delta": 1e-5,
        "bytes_pushed": 1_234_567,
        "push_seconds": 0.81,
    }
    return RoundProgress(**{**values, **fields})  # type: ignore[arg-type]


def test_a_refused_push_is_named_and_counted() -> None:
    # Execute
    line = _progress(refused=("shard-1 (invalid_argument)",), failures=1).line()

    # Assert
    assert line == (
        "client-0 round 3/20: 412 samples, loss 0.412, epsilon 1.84 (delta 1e-05), "
        "pushed 1.2 MB in 0.8 s; refused by shard-1 (invalid_argument), 1 peer failure so far"
    )


def test_a_round_every_peer_refused_says_nothing_was_pushed() -> None:
    # Execute
    refused = ("shard-0 (quarantined)", "shard-1 (config)", "coordinator (config)")
    line = _progress(bytes_pushed=0, refused=refused, failures=7).line()

    # Assert: not "the round ended first": the peers refused
    assert line.endswith(
        "nothing pushed; refused by shard-0 (quarantined), shard-1 (config), "
        "coordinator (config), 7 peer failures so far"
    )


def test_earlier_failures_are_counted_in_a_clean_round() -> None:
    # Execute
    line = _progress(failures=2).line()

    # Assert
    assert line.endswith("pushed 1.2 MB in 0.8 s; 2 peer failures so far")


def test_a_summary_without_failures_counts_none() -> None:
    assert ClientSummary("client-0", 3, 1.0, 1e-5, 100).failures == 0
