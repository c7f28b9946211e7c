"""Tests for fedps.runtime.cluster_status: what ``fedps status`` says of each client."""

from __future__ import annotations

from fedps.rpc.coordinator_messages import ClusterStatus
from fedps.runtime.cluster_status import client_lines


def test_a_client_line_gives_the_servers_figure_and_what_the_client_says_where_it_differs() -> None:
    # Prepare: the server's ledger says 2.889 for client-0, which says 2.165 and is spent
    status = ClusterStatus(
        "run",
        8,
        8,
        2,
        False,
        (),
        2.889,
        1e-5,
        0,
        0.0,
        client_epsilons={"client-0": 2.889, "client-1": 1.5},
        client_reported_epsilons={"client-0": 2.165, "client-1": 1.5},
        spent_clients=("client-0",),
        flagged_clients=("client-0",),
    )

    # Execute
    lines = client_lines(status)

    # Assert
    assert lines == [
        "client-0: epsilon 2.889 (it reports 2.165), SPENT: the server's ledger stops it at "
        "the target, WARNED (see the privacy warnings)",
        "client-1: epsilon 1.500",
    ]
