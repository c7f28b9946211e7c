"""An edge client's session (clients/client_session.py): its enrolment token, its registration
and task requests carrying its spend, its channels, and the key holder's public context,
adopted only under the signing key it first trusted. Real servers on loopback."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from clients.client_session import read_enrolment_token
from clients.peer_failures import own_fault
from crypto import BlockEncryptor
from crypto.enrolment import issue_tokens, read_token
from fedps.config import load_config
from fedps.errors import ConfigError
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.transport import bind, create_server
from server.serve import add_keyholder
from tests.clients.client_parts import ClientParts, client_parts
from tests.conftest import Cluster, start_cluster
from tests.round_driver import HandClient, RoundDriver
from tests.waiting import HANG_S, wait_for

RUN = "session-run"
ONE_CLIENT = {"clients": 1, "min_quorum": 1, "rounds": 1, "deadline_s": 60.0}


def _connect(parts: ClientParts, cluster: Cluster, keyholder: str = "") -> None:
    """Connect to the cluster's shards and key holder (or the one at ``keyholder``)."""
    spec = cluster.config.cluster
    shards = dict(zip(spec.shard_ids, spec.shards, strict=True))
    parts.session.connect(keyholder or spec.keyholder, shards, virtual_nodes=spec.virtual_nodes)


def _join(parts: ClientParts, cluster: Cluster, keyholder: str = "") -> None:
    """:func:`_connect`, then join run RUN."""
    _connect(parts, cluster, keyholder)
    parts.session.join(run_id=RUN, client_id="client-0")


def test_an_enrolment_token_is_read_and_a_missing_one_named_when_required(
    tmp_path: Path,
) -> None:
    # Prepare
    tls = load_config(None, tls={"insecure": True, "directory": str(tmp_path)}).tls
    issue_tokens(tls.directory, ["client-0"])

    # Execute
    token = read_enrolment_token(tls, "client-0", required=True)
    none = read_enrolment_token(tls, "client-9", required=False)

    # Assert: the token written for client-0; a missing one is named when it is needed
    assert token == read_token(tls.directory, "client-0") and token
    assert none == ""
    with pytest.raises(ConfigError, match=r"client-9\.token not found"):
        read_enrolment_token(tls, "client-9", required=True)


@pytest.mark.integration
def test_a_session_registers_joins_pulls_and_carries_its_spend(tmp_path: Path) -> None:
    # Prepare: a cluster waiting for its one client
    cluster = start_cluster(tmp_path, training=ONE_CLIENT)
    parts = client_parts(cluster.config)
    session = parts.session
    try:
        with pytest.raises(RuntimeError, match="not known"):
            _ = session.keyholder  # nothing is known before it joins a run

        # Execute: register, connect and join as the coordinator says; pull; announce
        started = session.start(time.time() + HANG_S)
        wait_for(lambda: any(s.owned_blocks for s in cluster.shards), "the first model")
        vector, version = session.pull(0)
        parts.ledger.record_next_round()
        announced = session.announce_spend()
        context = KeyHolderStub(cluster.config.cluster.keyholder).get_public_context()

        # Assert: joined under the key holder's context and key; the signed model pulled;
        # the coordinator holds the spend the ledger recorded
        assert started and session.connected and session.client_id and session.run_id
        assert (session.context_id, session.keyholder_key) == (
            context.context_id,
            context.signing_key,
        )
        assert version == 0 and vector.shape == (session.num_params,)
        assert announced and parts.ledger.epsilon > 0
        epsilons = cluster.coordinator.client_epsilons
        assert epsilons[session.client_id] == pytest.approx(parts.ledger.epsilon)
        assert parts.failures.total == 0
    finally:
        parts.close()
        cluster.stop()


@pytest.mark.integration
def test_a_context_under_another_signing_key_is_refused_and_a_pinned_one_required(
    tmp_path: Path,
) -> None:
    # Prepare: a cluster, and a second key holder (another signing key) beside it
    cluster = start_cluster(tmp_path, coordinator=False, training=ONE_CLIENT)
    other = create_server()
    address = f"127.0.0.1:{bind(other, '127.0.0.1:0')}"
    stranger = add_keyholder(other, cluster.config, tmp_path / "stranger")
    other.start()
    parts = client_parts(cluster.config, peer_wait_s=1.0)
    key = KeyHolderStub(address).get_public_context().signing_key
    security = cluster.config.security.model_copy(update={"keyholder_key": key.hex()})
    pinned = client_parts(cluster.config.model_copy(update={"security": security}))
    try:
        _join(parts, cluster)
        ours, trusted = parts.session.context_id, parts.session.keyholder_key

        # Execute: the run's context again (nothing fetched); the stranger's
        same = parts.session.adopt_context(ours)
        _join(pinned, cluster, keyholder=address)  # the pinned key is the stranger's
        _connect(parts, cluster, keyholder=address)
        adopted = parts.session.adopt_context(stranger.context_id)

        # Assert: the stranger's context is refused and counted; ours is kept
        assert same and not adopted
        assert parts.failures.counts == {"key holder: invalid_argument": 1}
        assert (parts.session.context_id, parts.session.keyholder_key) == (ours, trusted)
        assert pinned.session.keyholder_key == key
        # ... and a client that pins that key refuses the cluster's own key holder, itself
        with pytest.raises(ConfigError, match="pinned") as refused:
            _join(pinned, cluster)
        assert own_fault(refused.value)
    finally:
        parts.close()
        pinned.close()
        other.stop(grace=None)
        cluster.stop()


@pytest.mark.integration
def test_after_a_rotation_the_new_context_is_adopted_under_the_same_signing_key(
    tmp_path: Path,
) -> None:
    # Prepare: a new key pair after every applied round; the client joined under the first
    cluster = start_cluster(
        tmp_path, coordinator=False, training=ONE_CLIENT, security={"rotate_every_rounds": 1}
    )
    parts = client_parts(cluster.config)
    session = parts.session
    try:
        cluster.keyholder.initialize(np.zeros(session.num_params))
        _join(parts, cluster)
        first, trusted = session.context_id, session.keyholder_key
        encryptor = session.encryptor
        assert isinstance(encryptor, BlockEncryptor)
        driver = RoundDriver(cluster.config, encryptor.public, run_id=RUN)
        hand = HandClient(session.client_id, np.zeros(1), signer=session.signer)

        # Execute: round 1 committed, pushed and applied through the parts; the key rotates
        driver.open_commits(1, 0, [hand])
        delta = np.full(session.num_params, 0.01)
        prepared = parts.pipeline.prepare(1, 0, delta, weight=1.0)
        assert prepared is not None
        driver.open_shards(1, 0, [hand], driver.freeze(1))
        parts.pusher.send(prepared)
        assert driver.close(1) == {session.client_id}
        driver.apply(1, 0, [hand])
        rotated = KeyHolderStub(cluster.config.cluster.keyholder).get_public_context()
        adopted = session.adopt_context(rotated.context_id)

        # Assert: a new context, verified under the key the client already trusted
        assert rotated.context_id != first and adopted
        assert session.context_id == rotated.context_id
        assert session.keyholder_key == trusted == rotated.signing_key
        assert isinstance(session.encryptor, BlockEncryptor)
        assert session.encryptor.public.context_id == rotated.context_id
        assert parts.failures.total == 0
    finally:
        parts.close()
        cluster.stop()
