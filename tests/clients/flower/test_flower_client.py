"""A Flower node's uplink: the strategy's messages carry its tasks, never a coordinator."""

from __future__ import annotations

import pytest

from clients.flower.flower_client import StrategyMessages
from fedps.errors import InvalidArgumentError
from fedps.rpc.coordinator_messages import AssignmentQuery, UpdateReport


def test_a_flower_node_asks_no_coordinator_for_tasks() -> None:
    # Prepare: what EdgeClient.run would ask of a Flower node's uplink
    uplink = StrategyMessages()

    # Execute / Assert: each refuses with the reason, and closing it closes nothing
    with pytest.raises(InvalidArgumentError, match="strategy's messages"):
        uplink.get_task(AssignmentQuery("client-0", 0.0, 1e-5))
    with pytest.raises(InvalidArgumentError, match="strategy's messages"):
        uplink.report_update(UpdateReport(client_id="client-0", round=1))
    uplink.close()
