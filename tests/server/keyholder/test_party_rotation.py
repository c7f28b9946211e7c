"""Tests for key rotation with parties: a new collective key over gRPC, adopted in two steps."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from crypto import PublicContext
from crypto import threshold as th
from crypto.signing import BlockSigner
from fedps.errors import NotReadyError, PolicyError
from fedps.proto import keyholder_party_pb2_grpc
from fedps.rpc.keyholder_party_messages import AdoptRequest, RekeyRequest
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from fedps.rpc.transport import bind, create_server
from fedps.runtime.deployment import free_port
from server.keyholder.keyholder_party import RoundSource
from server.keyholder.keyholder_party_servicer import KeyHolderPartyServicer
from server.keyholder.party_key_generation import PUBLIC_CONTEXT_FILE, SHARE_FILE
from server.keyholder.party_process import PartyProcess, PartySettings
from server.keyholder.party_rotation import NEXT_DIR, PartyRotation
from tests.crypto.threshold_keys import PARAMS, N
from tests.server.keyholder.party_cluster import LAMBDA, MIN_QUORUM
from tests.waiting import wait_for

PARTIES, THRESHOLD = 3, 2


def _no_source(public: PublicContext) -> RoundSource:
    raise AssertionError("no round is asked in these tests")


@dataclass
class _Cluster:
    """Three parties behind their servers, their key generated, and the combiner's key."""

    parties: dict[int, PartyProcess]
    stubs: dict[int, KeyHolderPartyStub]
    combiner: BlockSigner
    open_party: Callable[[int], PartyProcess]

    def rotation(self, context_file: Path) -> PartyRotation:
        return PartyRotation(self.stubs, self.combiner, context_file, wait_s=120.0)

    def public(self) -> PublicContext:
        return PublicContext.from_bytes(self.parties[1].hello().context)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[_Cluster]:
    addresses = {j: f"127.0.0.1:{free_port()}" for j in range(1, PARTIES + 1)}
    combiner = BlockSigner()
    stop = threading.Event()

    def open_party(j: int) -> PartyProcess:
        settings = PartySettings(j, addresses, THRESHOLD, PARAMS, MIN_QUORUM, LAMBDA)
        return PartyProcess(
            settings,
            tmp_path / f"party-{j}",
            source=_no_source,
            combiner_key=lambda public: combiner.public_key,
        ).open()

    parties = {j: open_party(j) for j in addresses}
    servers: list[grpc.Server] = []
    for j, party in parties.items():
        server = create_server()
        keyholder_party_pb2_grpc.add_KeyHolderPartyServicer_to_server(
            KeyHolderPartyServicer(party, keygen=party), server
        )
        bind(server, addresses[j])
        server.start()
        servers.append(server)
    threads = []
    for j, party in parties.items():
        peers = {k: KeyHolderPartyStub(a, n=N) for k, a in addresses.items() if k != j}
        party.connect(peers, stop)
        threads.append(threading.Thread(target=party.generate, args=(peers, stop)))
        threads[-1].start()
    stubs = {j: KeyHolderPartyStub(a, n=N) for j, a in addresses.items()}
    try:
        wait_for(lambda: all(p.ready for p in parties.values()), "the key generation")
        yield _Cluster(parties, stubs, combiner, open_party)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for server in servers:
            server.stop(0)


def _secret(folders: list[Path], subset: tuple[int, int]) -> np.ndarray:
    """``sum lambda_j sh_j`` over ``subset``: the joint secret that subset reconstructs."""
    shares = {j: th.KeyShare.load(folders[j - 1] / SHARE_FILE) for j in subset}
    modulus = shares[subset[0]].modulus
    lambdas = th.lagrange_coefficients(subset, modulus)
    total = np.zeros(N, dtype=object)
    for j in subset:
        total = total + lambdas[j] * shares[j].share.astype(object)
    return total % modulus


def _rekeyed(cluster: _Cluster, generation: int) -> PublicContext:
    """Every party rekeyed (not adopted): the new context they all hold."""
    old = cluster.public()
    request = RekeyRequest(generation, old.context_id)
    signed = RekeyRequest(generation, old.context_id, cluster.combiner.sign(request.digest()))
    assert all(p.rekey(signed) for p in cluster.parties.values())
    wait_for(lambda: all(p.hello().next_context for p in cluster.parties.values()), "the rekey")
    contexts = {p.hello().next_context for p in cluster.parties.values()}
    assert len(contexts) == 1
    return PublicContext.from_bytes(contexts.pop())


def _adopt(cluster: _Cluster, context_id: str) -> AdoptRequest:
    request = AdoptRequest(context_id)
    return AdoptRequest(context_id, cluster.combiner.sign(request.digest()))


def test_a_rotation_makes_a_new_joint_key_that_every_party_adopts(
    cluster: _Cluster, tmp_path: Path
) -> None:
    # Prepare
    old = cluster.public()
    folders = [p.folder for p in cluster.parties.values()]
    before = _secret(folders, (1, 2))
    context_file = tmp_path / "joint.ctx"
    # Execute
    new = cluster.rotation(context_file).rotate(7, old)
    # Assert: one new context, served by the combiner and held by every party; a new secret
    # that any two shares open; nothing left in next/
    assert new is not None and new.context_id != old.context_id and new.params == old.params
    assert context_file.read_bytes() == new.serialize()
    for party in cluster.parties.values():
        assert party.hello().context == new.serialize() and not party.hello().next_context
        assert (party.folder / PUBLIC_CONTEXT_FILE).read_bytes() == new.serialize()
        assert not list((party.folder / NEXT_DIR).glob("*"))
        assert stat.S_IMODE((party.folder / SHARE_FILE).stat().st_mode) == 0o600
        assert stat.S_IMODE((party.folder / NEXT_DIR).stat().st_mode) == 0o700
    after = _secret(folders, (1, 2))
    assert all(after == _secret(folders, (2, 3))) and any(after != before)


def test_a_hello_naming_a_later_rotation_cannot_block_the_combiners_rotation(
    cluster: _Cluster, tmp_path: Path
) -> None:
    # Prepare: a caller that may say hello (another party's or the operator's certificate)
    # names a far later rotation at every party, as if the combiner had asked for it
    old = cluster.public()
    for stub in cluster.stubs.values():
        with pytest.raises(NotReadyError, match="was not asked for rotation"):
            stub.hello(2**62)
    # Execute: the combiner's own rotation
    new = cluster.rotation(tmp_path / "joint.ctx").rotate(7, old)
    # Assert: it went through (before, each party had made rotation 2**62 its latest and
    # refused rotation 7 as "over": the rotation was postponed for good)
    assert new is not None and new.context_id != old.context_id
    assert all(p.hello().context == new.serialize() for p in cluster.parties.values())


def test_a_rekey_or_an_adopt_the_combiner_did_not_sign_is_refused(cluster: _Cluster) -> None:
    # Prepare
    party = cluster.parties[1]
    old = cluster.public()
    forged = BlockSigner()
    rekey = RekeyRequest(3, old.context_id)
    adopt = AdoptRequest("0" * 64)
    # Execute / Assert
    with pytest.raises(PolicyError, match="rekey is not signed by the combiner"):
        party.rekey(RekeyRequest(3, old.context_id, forged.sign(rekey.digest())))
    with pytest.raises(PolicyError, match="adopt is not signed by the combiner"):
        party.adopt(AdoptRequest(adopt.context_id, forged.sign(adopt.digest())))
    with pytest.raises(PolicyError, match="holds no new share"):
        party.adopt(_adopt(cluster, adopt.context_id))  # signed, but nothing waits
    assert party.hello().context == old.serialize()


def test_a_party_that_missed_the_adopt_adopts_when_the_combiner_next_finds_it(
    cluster: _Cluster, tmp_path: Path
) -> None:
    # Prepare: every party rekeyed; parties 1 and 2 adopted; party 3 restarts before it did
    new = _rekeyed(cluster, 5)
    for j in (1, 2):
        assert cluster.parties[j].adopt(_adopt(cluster, new.context_id))
    restarted = cluster.open_party(3)
    assert restarted.hello().next_context == new.serialize()
    cluster.parties[3] = restarted
    rotation = cluster.rotation(tmp_path / "joint.ctx")
    # Execute: the combiner's probe before a round (party 3's server still serves the
    # process that rekeyed; the restarted one read its folder back: both wait on next/)
    up = rotation.probe(3, new)
    # Assert
    assert up
    assert cluster.stubs[3].hello().context == new.serialize()
    assert restarted.adopt(_adopt(cluster, new.context_id))  # its own copy adopts too
    assert (restarted.folder / PUBLIC_CONTEXT_FILE).read_bytes() == new.serialize()


def test_an_adopt_a_stop_interrupted_is_finished_at_the_next_start(cluster: _Cluster) -> None:
    # Prepare: party 2 stopped with its new share moved and its new context not yet
    new = _rekeyed(cluster, 9)
    folder = cluster.parties[2].folder
    (folder / "adopting").write_bytes(b"")
    os.replace(folder / NEXT_DIR / SHARE_FILE, folder / SHARE_FILE)
    # Execute
    restarted = cluster.open_party(2)
    # Assert: the move is finished, the new context in use, nothing waits
    assert restarted.hello().context == new.serialize()
    assert not restarted.hello().next_context
    assert not (folder / "adopting").exists()


def test_a_rotation_with_a_party_down_is_postponed_and_the_key_stays(
    cluster: _Cluster, tmp_path: Path
) -> None:
    # Prepare: the combiner cannot reach party 3
    old = cluster.public()
    stubs = {**cluster.stubs, 3: KeyHolderPartyStub(f"127.0.0.1:{free_port()}", n=N)}
    rotation = PartyRotation(stubs, cluster.combiner, tmp_path / "joint.ctx", wait_s=120.0)
    # Execute
    new = rotation.rotate(4, old)
    # Assert: postponed; the combiner's context untouched, every party on the current key
    assert new is None and not (tmp_path / "joint.ctx").exists()
    for party in cluster.parties.values():
        assert party.hello().context == old.serialize()
        assert (party.folder / PUBLIC_CONTEXT_FILE).read_bytes() == old.serialize()
