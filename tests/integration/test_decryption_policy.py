"""The key holder's decryption policy on honest and malformed requests (real servers).

The attacks of a malicious shard are in ``tests/security/test_aggregation_attacks.py``; this
module checks the policy's everyday behaviour: an honest round is applied and released once,
the key holder keeps serving after a refusal, and it decrypts exactly the committed clients
the round closed with, each commitment checked as it arrives.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner
from fedps.errors import InvalidArgumentError, PolicyError, RoundClosedError, UnknownClientError
from fedps.proto import keyholder_pb2
from fedps.rpc.messages import Aggregate
from fedps.rpc.transport import call
from tests.conftest import Cluster
from tests.round_driver import HandClient, RoundDriver, driven_cluster

pytestmark = pytest.mark.integration

RUN = "policy-run"
PARAMS = 3000


@pytest.fixture
def ready(tmp_path: Path) -> Iterator[tuple[Cluster, RoundDriver]]:
    with driven_cluster(tmp_path, num_shards=1, num_params=PARAMS, run_id=RUN) as ready:
        yield ready


def _clients(names: tuple[str, ...] = ("alice", "bob", "carol")) -> list[HandClient]:
    return [HandClient(c, np.full(PARAMS, 0.1 * (i + 1))) for i, c in enumerate(names)]


def test_honest_round_is_applied_and_released_once(
    ready: tuple[Cluster, RoundDriver],
) -> None:
    # Prepare
    cluster, driver = ready
    clients = _clients()
    driver.committed_round(1, 0, clients)
    # Execute
    first = driver.apply(1, 0, clients)
    params_after = cluster.keyholder.params.copy()  # type: ignore[union-attr]
    again = driver.apply(1, 0, clients)
    # Assert: the mean of 0.1, 0.2, 0.3, and the same released result on repeat, which
    # decrypted nothing again (no phase of the key holder ran: the timing is the call's own)
    assert "decrypt" in first.phase_seconds and not again.phase_seconds
    first.ClearField("phase_seconds")
    assert first == again
    np.testing.assert_allclose(params_after, 0.2, atol=1e-3)
    np.testing.assert_array_equal(cluster.keyholder.params, params_after)


def test_exactly_the_closed_clients_are_decrypted(ready: tuple[Cluster, RoundDriver]) -> None:
    # Prepare: carol committed but never pushed: the round closes with alice and bob
    cluster, driver = ready
    clients = _clients()
    driver.open_commits(1, 0, clients)
    for c in clients:
        driver.commit(1, c)
    driver.open_shards(1, 0, clients, driver.freeze(1))
    for c in clients[:2]:
        driver.push(1, c)
    complete = driver.close(1)
    # Execute
    result = driver.apply(1, 0, clients[:2])
    # Assert: the mean of 0.1 and 0.2
    assert complete == {"alice", "bob"}
    assert result.version == 1
    assert cluster.keyholder.params is not None
    np.testing.assert_allclose(cluster.keyholder.params, 0.15, atol=1e-3)


def test_a_contributor_that_never_committed_is_refused(
    ready: tuple[Cluster, RoundDriver],
) -> None:
    # Prepare: carol is named a contributor though she never committed
    _, driver = ready
    clients = _clients()
    driver.committed_round(1, 0, clients[:2])
    # Execute / Assert
    with pytest.raises(PolicyError, match="never committed"):
        driver.apply(1, 0, clients)


def test_commitments_are_checked_as_they_arrive(ready: tuple[Cluster, RoundDriver]) -> None:
    # Prepare
    _, driver = ready
    alice, bob, carol = _clients()
    driver.open_commits(1, 0, [alice, bob])
    # Execute / Assert: an outsider, a declared weight other than the uniform 1, a commitment
    # signed by another key, a second different one, then one after the freeze
    with pytest.raises(UnknownClientError):
        driver.commit(1, carol)
    with pytest.raises(UnknownClientError):
        driver.challenge(1, carol)
    heavy = HandClient("alice", alice.update, weight=1e-6, signer=alice.signer)
    with pytest.raises(InvalidArgumentError, match="bounds"):
        driver.commit(1, heavy)
    forged = HandClient("alice", alice.update, signer=BlockSigner())
    with pytest.raises(InvalidArgumentError, match="not signed"):
        driver.commit(1, forged)
    driver.encrypt(alice, 1)
    short = keyholder_pb2.CommitRequest(round=1, update=alice.signed, sketches=b"\0" * 8)
    with pytest.raises(InvalidArgumentError, match="sketches must be"):
        call(lambda: driver.keyholder.Commit(short), "commit")
    driver.commit(1, alice)
    driver.commit(1, alice)  # a retry of the same commitment is fine
    with pytest.raises(InvalidArgumentError, match="another update"):
        driver.commit(1, HandClient("alice", bob.update, signer=alice.signer))
    assert list(driver.freeze(1).client_ids) == ["alice"]
    with pytest.raises(RoundClosedError, match="too late"):
        driver.commit(1, bob)
    # ... and the frozen round cannot be reopened for another cohort
    with pytest.raises(RoundClosedError, match="cannot be opened again"):
        driver.open_commits(1, 0, [alice, bob, carol])


def test_key_holder_keeps_serving_after_a_refusal(ready: tuple[Cluster, RoundDriver]) -> None:
    # Prepare: a tampered round 1, refused
    cluster, driver = ready
    clients = _clients()
    driver.committed_round(1, 0, clients)
    shard = cluster.shards[0]

    def tampered(
        round_: int, contributors: Collection[str]
    ) -> tuple[list[Aggregate], list[SignedUpdate]]:
        aggregates, updates = type(shard).aggregates(shard, round_, contributors)
        return [replace(a, ciphertext=clients[0].sent[a.block]) for a in aggregates], updates

    shard.aggregates = tampered  # type: ignore[method-assign]
    with pytest.raises(PolicyError, match="tampering"):
        driver.apply(1, 0, clients)
    del shard.aggregates
    # Execute: an honest round 2
    fresh = _clients()
    driver.committed_round(2, 0, fresh)
    result = driver.apply(2, 0, fresh)
    # Assert
    assert result.version == 1
