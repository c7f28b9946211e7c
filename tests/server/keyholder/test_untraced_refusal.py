"""Tests for what counts against a shard: only proof (server.keyholder.blame, .suspects)."""

from __future__ import annotations

import pytest

from fedps.errors import PolicyError, QuarantinedError
from server.keyholder.aggregate_verifier import TamperingError
from server.keyholder.blame import untraced_refusal
from server.keyholder.suspects import Suspects


def test_an_untraced_failed_sketch_counts_against_nobody() -> None:
    # Prepare: key-holder parties cannot trace; a failed sketch of shard-0's blocks (a client's
    # false sketch fails an honest shard's sum the same way), and a foreign block (proof)
    sketch = TamperingError("shard-0", "aggregate", "block 3 failed", blocks=(3,))
    foreign = TamperingError("shard-1", "foreign-block", "sent block 9")

    # Execute
    refused, proven = untraced_refusal(sketch, 4), untraced_refusal(foreign, 4)

    # Assert: the round is refused either way; only the proof is a detection against its shard
    assert isinstance(refused, PolicyError) and not isinstance(refused, TamperingError)
    assert "nobody is blamed" in str(refused)
    assert proven is foreign


def test_a_quarantined_shard_stops_only_a_ring_that_holds_it() -> None:
    # Prepare: shard-1 proven to tamper once, with max_detections 1
    suspects = Suspects(max_detections=1, exclude=lambda client, why: None)
    suspects.detected(2, TamperingError("shard-1", "aggregate", "block 0 failed", blocks=(0,)))

    # Execute / Assert: a ring with shard-1 is refused; the ring without it is decrypted
    with pytest.raises(QuarantinedError, match="shard-1"):
        suspects.check_none_quarantined(("shard-0", "shard-1", "shard-2"))
    suspects.check_none_quarantined(("shard-0", "shard-2"))
    assert suspects.quarantined == ["shard-1"]  # the evidence is kept
