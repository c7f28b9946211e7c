"""A malicious shard against the key holder's decryption policy (real servers on loopback).

The shard below is real; a test replaces what it hands the key holder, as a compromised shard
would: one client's ciphertext presented as the aggregate, a doubled aggregate, or a cohort
below ``min_cohort``. The key holder must refuse each, and keep serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from crypto import BlockEncryptor, CiphertextSum, unpack_block
from crypto.signing import CHUNKS, BlockSigner, merkle_proof, sign_update
from fedps.errors import PolicyError
from server.aggregate_verifier import AuditChunk
from server.shard import Aggregate, PushBatch, SignedUpdate
from tests.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

RUN = "policy-run"
CLIENTS = ["alice", "bob", "carol"]
PARAMS = 3000


@pytest.fixture
def round_ready(tmp_path: Path) -> Iterator[tuple[Cluster, dict[str, dict[int, bytes]]]]:
    """Three honest clients pushed signed updates for round 1; the round is closed."""
    cluster = start_cluster(
        tmp_path, num_shards=1, coordinator=False, training={"clients": 3, "min_quorum": 2}
    )
    kh, shard = cluster.keyholder, cluster.shards[0]
    kh.initialize(np.zeros(PARAMS))
    public = kh.keys.public
    signers = {c: BlockSigner() for c in CLIENTS}
    shard.open_round(1, 0, {c: s.public_key for c, s in signers.items()}, public.context_id, RUN)
    plan = kh.audit_plan(1)
    packed_by_client: dict[str, dict[int, bytes]] = {}
    for i, client in enumerate(CLIENTS):
        packed, coeffs = BlockEncryptor(public).encrypt_with_coefficients(
            np.full(PARAMS, 0.1 * (i + 1))
        )
        nonce, signature, roots = sign_update(
            signers[client],
            coeffs,
            run_id=RUN,
            round_=1,
            client_id=client,
            context_id=public.context_id,
            weight=1.0,
        )
        size = coeffs.shape[1] // CHUNKS
        kh.submit_audit(
            client,
            1,
            {
                b: AuditChunk(c, coeffs[b, c * size : (c + 1) * size], merkle_proof(coeffs[b], c))
                for b, c in plan.items()
            },
        )
        shard.push(
            PushBatch(
                client,
                1,
                0,
                1.0,
                public.context_id,
                sorted(packed.items()),
                nonce,
                signature,
                tuple(roots),
            )
        )
        packed_by_client[client] = packed
    shard.close_round(1)
    yield cluster, packed_by_client
    cluster.stop()


def _members(cluster: Cluster) -> dict[str, bytes]:
    state = cluster.shards[0]._rounds[1]
    return dict(state.members)


def _tamper(cluster: Cluster, change: object) -> None:
    shard = cluster.shards[0]
    honest = shard.aggregates

    def tampered(round_: int) -> tuple[list[Aggregate], list[SignedUpdate]]:
        aggregates, updates = honest(round_)
        return [change(a) for a in aggregates], updates  # type: ignore[operator]

    shard.aggregates = tampered  # type: ignore[method-assign]


def test_honest_round_is_applied_and_released_once(
    round_ready: tuple[Cluster, dict[str, dict[int, bytes]]],
) -> None:
    # Prepare
    cluster, _ = round_ready
    kh = cluster.keyholder
    # Execute
    first = kh.apply_round(1, 0, RUN, _members(cluster))
    params_after = kh.params.copy()  # type: ignore[union-attr]
    again = kh.apply_round(1, 0, RUN, _members(cluster))
    # Assert: the mean of 0.1, 0.2, 0.3, and the same released result on repeat
    assert first == again
    np.testing.assert_allclose(params_after, 0.2, atol=1e-3)
    np.testing.assert_array_equal(kh.params, params_after)


def test_one_clients_ciphertext_as_the_aggregate_is_refused(
    round_ready: tuple[Cluster, dict[str, dict[int, bytes]]],
) -> None:
    # Prepare: the shard presents bob's ciphertext alone as the sum of all three
    cluster, packed = round_ready
    _tamper(cluster, lambda a: replace(a, ciphertext=packed["bob"][a.block]))
    # Execute / Assert
    with pytest.raises(PolicyError, match="tampering"):
        cluster.keyholder.apply_round(1, 0, RUN, _members(cluster))
    assert cluster.keyholder.version == 0


def test_doubled_aggregate_is_refused(
    round_ready: tuple[Cluster, dict[str, dict[int, bytes]]],
) -> None:
    # Prepare
    cluster, _ = round_ready
    public = cluster.keyholder.keys.public

    def doubled(a: Aggregate) -> Aggregate:
        total = CiphertextSum(public)
        coeffs = unpack_block(public, a.ciphertext)
        total.add(coeffs, multiplier=2)
        return replace(a, ciphertext=total.packed())

    _tamper(cluster, doubled)
    # Execute / Assert
    with pytest.raises(PolicyError, match="tampering"):
        cluster.keyholder.apply_round(1, 0, RUN, _members(cluster))


def test_cohort_below_minimum_is_refused(
    round_ready: tuple[Cluster, dict[str, dict[int, bytes]]],
) -> None:
    # Prepare: only bob in the manifest, bob's ciphertext as the "aggregate"
    cluster, packed = round_ready
    _tamper(
        cluster,
        lambda a: replace(
            a,
            ciphertext=packed["bob"][a.block],
            contributions={"bob": a.contributions["bob"]},
        ),
    )
    # Execute / Assert
    with pytest.raises(PolicyError, match="at least 2"):
        cluster.keyholder.apply_round(1, 0, RUN, _members(cluster))


def test_invented_or_reweighted_contributions_are_refused(
    round_ready: tuple[Cluster, dict[str, dict[int, bytes]]],
) -> None:
    # Prepare: the shard doubles alice's weight in the manifest
    cluster, _ = round_ready
    _tamper(
        cluster,
        lambda a: replace(
            a,
            contributions={
                **a.contributions,
                "alice": replace(a.contributions["alice"], weight=2.0),
            },
        ),
    )
    # Execute / Assert
    with pytest.raises(PolicyError, match="weight"):
        cluster.keyholder.apply_round(1, 0, RUN, _members(cluster))


def test_key_holder_keeps_serving_after_refusals(
    round_ready: tuple[Cluster, dict[str, dict[int, bytes]]],
) -> None:
    # Prepare: a refused tampered attempt first
    cluster, packed = round_ready
    shard = cluster.shards[0]
    honest = shard.aggregates
    _tamper(cluster, lambda a: replace(a, ciphertext=packed["carol"][a.block]))
    with pytest.raises(PolicyError):
        cluster.keyholder.apply_round(1, 0, RUN, _members(cluster))
    # Execute: the honest aggregate is then accepted
    shard.aggregates = honest  # type: ignore[method-assign]
    result = cluster.keyholder.apply_round(1, 0, RUN, _members(cluster))
    # Assert
    assert result.version == 1
