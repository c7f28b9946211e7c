"""Tests for a key-holder party as a process: the key generation over gRPC, its folder, restarts."""

from __future__ import annotations

import json
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from crypto import PublicContext
from crypto import threshold as th
from fedps.errors import NotReadyError, PolicyError
from fedps.proto import keyholder_party_pb2_grpc
from fedps.rpc.keyholder_party_messages import PartyDeal
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from fedps.rpc.transport import bind, create_server
from fedps.runtime.deployment import free_port
from server.keyholder.keyholder_party import RoundSource
from server.keyholder.keyholder_party_servicer import KeyHolderPartyServicer
from server.keyholder.party_key_generation import PUBLIC_CONTEXT_FILE, SHARE_FILE
from server.keyholder.party_process import PARTIES_FILE, PartyProcess, PartySettings
from tests.crypto.threshold_keys import PARAMS, N
from tests.server.keyholder.party_cluster import LAMBDA, MIN_QUORUM
from tests.waiting import wait_for

PARTIES, THRESHOLD = 3, 2


def _no_source(public: PublicContext) -> RoundSource:
    raise AssertionError("no round is asked in these tests")


def _no_combiner(public: PublicContext) -> bytes:
    raise AssertionError("no combiner is asked in these tests")


Opener = Callable[[int], PartyProcess]


@pytest.fixture
def opener(tmp_path: Path) -> Opener:
    """Opens party ``j`` of one cluster in its folder (as a process's start does)."""
    addresses = {j: f"127.0.0.1:{free_port()}" for j in range(1, PARTIES + 1)}

    def open_party(j: int) -> PartyProcess:
        settings = PartySettings(j, addresses, THRESHOLD, PARAMS, MIN_QUORUM, LAMBDA)
        folder = tmp_path / f"party-{j}"
        return PartyProcess(settings, folder, source=_no_source, combiner_key=_no_combiner).open()

    return open_party


@pytest.fixture
def generated(opener: Opener) -> Iterator[dict[int, PartyProcess]]:
    """Three parties, each behind its own server, after their key generation over gRPC."""
    parties = {j: opener(j) for j in range(1, PARTIES + 1)}
    servers: list[grpc.Server] = []
    stop = threading.Event()
    threads = []
    for j, party in parties.items():
        server = create_server()
        keyholder_party_pb2_grpc.add_KeyHolderPartyServicer_to_server(
            KeyHolderPartyServicer(party, keygen=party), server
        )
        bind(server, party.settings.addresses[j])
        server.start()
        servers.append(server)
    for j, party in parties.items():
        peers = {
            k: KeyHolderPartyStub(a, n=N) for k, a in party.settings.addresses.items() if k != j
        }
        threads.append(threading.Thread(target=party.generate, args=(peers, stop)))
        threads[-1].start()
    try:
        wait_for(lambda: all(p.ready for p in parties.values()), "the key generation")
        yield parties
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for server in servers:
            server.stop(0)


def _secret(parties: dict[int, PartyProcess], subset: tuple[int, int]) -> np.ndarray:
    """``sum lambda_j sh_j`` over ``subset``: the joint secret that subset reconstructs."""
    shares = {j: th.KeyShare.load(parties[j].folder / SHARE_FILE) for j in subset}
    modulus = shares[subset[0]].modulus
    lambdas = th.lagrange_coefficients(subset, modulus)
    total = np.zeros(N, dtype=object)
    for j in subset:
        total = total + lambdas[j] * shares[j].share.astype(object)
    return total % modulus


def test_parties_generate_one_key_over_the_network_each_holding_only_its_share(
    generated: dict[int, PartyProcess],
) -> None:
    # Prepare
    parties = generated
    # Execute: what each party serves and keeps
    hellos = {j: party.hello() for j, party in parties.items()}
    # Assert: one joint context, served by every party
    assert len({h.context for h in hellos.values()}) == 1 and hellos[1].context
    for j, party in parties.items():
        folder = party.folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / SHARE_FILE).stat().st_mode) == 0o600
        assert (folder / PUBLIC_CONTEXT_FILE).read_bytes() == hellos[1].context
        keys = json.loads((folder / PARTIES_FILE).read_text())  # every party's signing key
        assert keys == {str(k): h.signing_key.hex() for k, h in hellos.items()}
        assert th.KeyShare.load(folder / SHARE_FILE).index == j
    # any two parties' shares open one secret: the deals were consistent
    assert all(_secret(parties, (1, 2)) == _secret(parties, (2, 3)))


def test_a_restarted_party_reads_its_folder_back_and_takes_no_deal(
    generated: dict[int, PartyProcess], opener: Opener
) -> None:
    # Prepare
    context = generated[2].hello().context
    signing_key = generated[2].hello().signing_key
    # Execute: party 2 starts again on its folder
    restarted = opener(2)
    # Assert: ready at once, with its key generation's context and signing key
    assert restarted.ready
    assert restarted.hello().context == context
    assert restarted.hello().signing_key == signing_key
    deal = PartyDeal(1, b"\0" * 32, b"", b"")
    with pytest.raises(PolicyError, match="finished already"):
        restarted.receive_deal(deal, None)


def test_a_deal_is_refused_from_another_certificate(opener: Opener) -> None:
    # Prepare
    party = opener(1)
    deal = PartyDeal(3, b"\0" * 32, b"", b"")
    # Execute / Assert: party-2's certificate may not deal as party 3
    with pytest.raises(PolicyError, match="may not deal as party 3"):
        party.receive_deal(deal, "party-2")


def test_a_party_without_its_share_decrypts_nothing(opener: Opener) -> None:
    # Prepare
    party = opener(1)
    # Assert: no key generation yet, no hello context, no partial
    assert not party.ready and party.hello().context == b""
    with pytest.raises(NotReadyError, match="key generation has not finished"):
        party.partial_decrypt(None)  # type: ignore[arg-type]  # refused before it is read
