"""Blame rests on evidence: against real servers (sync and async), whoever breaks a round is
the one blamed, never an honest party, and a round the honest parties can carry applies.

- **Framing by under-reporting**: a shard reports fewer complete clients than it holds; every
  shard sums exactly the set the round closes with, so the honest shard is not blamed and the
  round applies (on each shard in turn).
- **Framing by a lying sketch**: a client commits sketches that are not those of the
  ciphertext it pushes; the sum then fails its check at the honest shard that holds it. The
  shard shows the client's ciphertext (its signed root proves it is the client's), and the
  client is blamed, not the shard.
- **Vetoing every round**: a client that pushes random ciphertexts (honestly committed) fails
  its own canaries: it is blamed and excluded, and the round is summed again without it.
- **A shard lying about the evidence**: a forged opening, a false accusation or no evidence
  at all is the shard's own fault.
- **Getting an honest shard declared gone**: a shard quarantined on proof is declared gone and
  its blocks move (docs/security.md); a malicious shard with clients on its side frames the
  honest shard with lying sketches round after round: the clients are blamed, the honest shard
  never quarantined, and the coordinator's ring keeps it. A shard proven to tamper is removed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from crypto import bitpack, unpack_block
from crypto.canary import CanaryOpening
from fedps.rpc.messages import Aggregate
from fedps.rpc.shard_messages import HeldCiphertext, OpenedBlock, TraceQuery
from server.coordinator.ring_keeper import RingKeeper
from tests.round_driver import HandClient
from tests.security.arena import VERSION, Arena

pytestmark = [pytest.mark.attack, pytest.mark.integration]


def _lying_sketch(arena: Arena, round_: int, clients: list[HandClient], block: int) -> None:
    """Every client commits and pushes; the last commits a sketch of ``block`` with one
    coefficient of ``c0`` changed (it pushes its honest bytes)."""
    driver, liar = arena.driver, clients[-1]
    driver.open_commits(round_, VERSION, clients)
    driver.encrypt(liar, round_)
    other = liar.coefficients.copy()
    other[block, 7] = (int(other[block, 7]) + 1) % arena.public.modulus
    for client in clients:
        driver.commit(round_, client, sketch_of=other if client is liar else None)
    commits = driver.freeze(round_)
    driver.open_shards(round_, VERSION, clients, commits)
    for client in clients:
        driver.push(round_, client)
    driver.close(round_)


def _random_ciphertext(arena: Arena, client: HandClient) -> None:
    """The client's ciphertext of block 0 is random coefficients (it commits to them)."""
    arena.driver.encrypt(client, 0)
    garbage = arena.rng.integers(0, arena.public.modulus, client.coefficients.shape[1])
    client.coefficients = client.coefficients.copy()
    client.coefficients[0] = garbage.astype(np.uint64)
    client.packed = dict(client.packed)
    client.packed[0] = bitpack.pack_rows(client.coefficients[:1], arena.public.coeff_bits)[0]
    client.signed_round = -1


@pytest.mark.parametrize("liar", [0, 1])
def test_a_shard_that_under_reports_completers_frames_nobody(arena: Arena, liar: int) -> None:
    # Prepare: shard `liar` reports client-2 incomplete, though it holds all its pushes
    clients = arena.clients()
    shard = arena.cluster.shards[liar]
    honest_close = type(shard).close_round.__get__(shard)

    def under_reporting(round_: int) -> list[str]:
        return [c for c in honest_close(round_) if c != "client-2"]

    shard.close_round = under_reporting  # type: ignore[method-assign]
    # Execute: the round closes with what every shard found complete
    arena.driver.committed_round(1, VERSION, clients)
    complete = arena.driver.close(1)
    arena.driver.apply(1, VERSION, [c for c in clients if c.client_id in complete])
    # Assert: applied with exactly that set, summed by both shards; nobody blamed
    assert complete == {"client-0", "client-1"}
    assert set(arena.keyholder._released[1].contributors) == complete
    assert arena.keyholder.detections == {} and arena.keyholder.blamed == {}


@pytest.mark.parametrize("block", [0, 1, 2])
def test_a_client_whose_sketch_lies_is_blamed_not_its_shard(arena: Arena, block: int) -> None:
    # Prepare
    clients = arena.clients()
    _lying_sketch(arena, 1, clients, block)
    # Execute / Assert: refused without decrypting; the liar blamed on the shard's evidence
    arena.assert_refused(1, clients)
    assert arena.keyholder.detections == {}
    assert "committed sketch" in arena.keyholder.blamed["client-2"]
    assert set(arena.keyholder.blamed) == {"client-2"}


def test_a_client_pushing_random_ciphertexts_is_blamed_and_the_round_goes_on(
    arena: Arena,
) -> None:
    # Prepare: client-2's block 0 is random bytes, honestly committed
    clients = arena.clients()
    _random_ciphertext(arena, clients[-1])
    # Execute
    arena.driver.committed_round(1, VERSION, clients)
    arena.driver.apply(1, VERSION, clients)
    # Assert: client-2 blamed on its own canaries; the other two applied; one decryption
    assert "carries key material" in arena.keyholder.blamed["client-2"]
    assert set(arena.keyholder._released[1].contributors) == {"client-0", "client-1"}
    assert len(arena.decryptions) == 1 and arena.keyholder.detections == {}
    # ... and the operator sees it (ModelState, what `fedps status` prints)
    assert set(arena.keyholder.model_state().blamed) == {"client-2"}


def test_a_shard_that_forges_an_opening_is_blamed_not_the_client(arena: Arena) -> None:
    # Prepare: client-2's block 0 fails its canaries; its shard then shows a forged opening
    # of an honest client, to frame it
    clients = arena.clients()
    _random_ciphertext(arena, clients[-1])
    shard = arena.owner(0)
    honest_trace = type(shard).trace.__get__(shard)

    def forging(query: TraceQuery) -> tuple[list[OpenedBlock], list[HeldCiphertext]]:
        openings, held = honest_trace(query)
        forged = []
        for o in openings:
            if o.client_id == "client-0":
                c1 = np.frombuffer(o.c1, dtype="<u8").copy()
                c1[3] ^= 1
                o = OpenedBlock.of(
                    o.client_id,
                    o.block,
                    CanaryOpening(c1.astype(np.uint64), o.opening().c0_canaries, o.rest_digest),
                )
            forged.append(o)
        return forged, held

    shard.trace = forging  # type: ignore[method-assign]
    arena.driver.committed_round(1, VERSION, clients)
    # Execute / Assert: refused; the shard is blamed for false evidence, no client is
    arena.assert_refused(1, clients)
    assert arena.keyholder.detections == {shard.shard_id: {"evidence": 1}}
    assert arena.keyholder.blamed == {}


@pytest.mark.parametrize("lie", ["accuse-honest", "show-nothing", "show-altered"])
def test_a_shard_that_lies_about_a_failed_sketch_is_blamed(arena: Arena, lie: str) -> None:
    # Prepare: client-2's sketch of block 0 lies; the shard answers the trace with a lie
    clients = arena.clients()
    shard = arena.owner(0)
    honest_trace = type(shard).trace.__get__(shard)

    def lying(query: TraceQuery) -> tuple[list[OpenedBlock], list[HeldCiphertext]]:
        _, found = honest_trace(query)
        if lie == "show-nothing":
            return [], []
        if lie == "accuse-honest":
            return [], [HeldCiphertext("client-0", 0, clients[0].packed[0])]
        return [], [HeldCiphertext(h.client_id, h.block, clients[0].packed[0]) for h in found]

    shard.trace = lying  # type: ignore[method-assign]
    _lying_sketch(arena, 1, clients, 0)
    # Execute / Assert: refused, and the shard blamed (no honest client is)
    arena.assert_refused(1, clients)
    reason = "aggregate" if lie == "show-nothing" else "evidence"
    assert arena.keyholder.detections == {shard.shard_id: {reason: 1}}
    assert arena.keyholder.blamed == {}


def test_a_tampering_shard_is_still_blamed(arena: Arena) -> None:
    # Prepare: a shard adds 1 to one coefficient of c0 of its aggregate of block 0
    clients = arena.clients()
    q = arena.public.modulus

    def changed(a: Aggregate) -> Aggregate:
        row = unpack_block(arena.public, a.ciphertext)
        row[9] = (int(row[9]) + 1) % q
        packed = bitpack.pack_rows(row[None, :], arena.public.coeff_bits)[0]
        return Aggregate(a.block, packed, a.contributions)

    arena.tamper(0, changed)
    arena.driver.committed_round(1, VERSION, clients)
    # Execute / Assert: the honest evidence shows no client at fault: the shard is blamed
    arena.assert_refused(1, clients)
    assert arena.keyholder.detections == {arena.owner(0).shard_id: {"aggregate": 1}}
    assert arena.keyholder.blamed == {}


def test_a_shard_flooding_the_trace_is_cut_off_and_blamed(arena: Arena) -> None:
    # Prepare: client-2's block 0 fails its canaries; its shard answers the trace with every
    # opening 50 times over
    clients = arena.clients()
    _random_ciphertext(arena, clients[-1])
    shard = arena.owner(0)
    honest_trace = type(shard).trace.__get__(shard)

    def flooding(query: TraceQuery) -> tuple[list[OpenedBlock], list[HeldCiphertext]]:
        openings, held = honest_trace(query)
        return openings * 50, held

    shard.trace = flooding  # type: ignore[method-assign]
    arena.driver.committed_round(1, VERSION, clients)
    # Execute / Assert: the stream is cut at what was asked for; the shard is blamed
    arena.assert_refused(1, clients)
    assert arena.keyholder.detections == {shard.shard_id: {"evidence": 1}}
    assert arena.keyholder.blamed == {}


def _coordinator_ring(arena: Arena) -> RingKeeper:
    """The coordinator's ring over the arena's shards."""
    return RingKeeper(sorted(arena.driver.ring.nodes), gone_after_s=0.0)


def test_clients_on_a_shards_side_cannot_get_the_honest_shard_declared_gone(
    arena: Arena,
) -> None:
    # Prepare: one proof is enough to quarantine a shard (and have it declared gone); the
    # honest shard owns block 0, a new client on the malicious side lies about it each round
    arena.keyholder.suspects.max_detections = 1
    honest = arena.driver.ring.owner(0)
    ring = _coordinator_ring(arena)

    # Execute: three rounds framed, the coordinator removing whatever the key holder quarantines
    for round_ in (1, 2, 3):
        clients = arena.clients(["client-0", "client-1", f"liar-{round_}"])
        _lying_sketch(arena, round_, clients, 0)
        arena.assert_refused(round_, clients)
        assert ring.quarantined(arena.keyholder.quarantined) == []

    # Assert: each liar blamed on evidence; nothing against the honest shard, which stays on
    assert arena.keyholder.detections == {} and arena.keyholder.quarantined == []
    assert set(arena.keyholder.blamed) == {"liar-1", "liar-2", "liar-3"}
    assert honest in ring.view.nodes and ring.view.version == 0


def test_a_shard_proven_to_tamper_is_declared_gone_and_the_ring_without_it_decrypts(
    arena: Arena,
) -> None:
    # Prepare: one proof quarantines; the shard that owns block 0 hands over one client's
    # ciphertext as the sum
    arena.keyholder.suspects.max_detections = 1
    guilty = arena.driver.ring.owner(0)
    ring = _coordinator_ring(arena)
    clients = arena.clients()
    arena.driver.committed_round(1, VERSION, clients)
    arena.tamper(0, lambda a: replace(a, ciphertext=clients[0].packed[0]))

    # Execute: refused on proof; the coordinator removes what the key holder quarantined
    arena.assert_refused(1, clients)
    left = ring.quarantined(arena.keyholder.quarantined)

    # Assert: the guilty shard is off the ring, and a ring without it is not refused for it
    assert arena.keyholder.quarantined == [guilty] and left == []
    assert guilty not in ring.view.nodes and ring.view.version == 1
    arena.keyholder.suspects.check_none_quarantined(ring.view.nodes)
