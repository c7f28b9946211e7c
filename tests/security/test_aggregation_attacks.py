"""A malicious shard (alone, or with a colluding client) against the key holder's checks.

Every attack runs against real servers on loopback: a real key holder and real shards, driven
through their gRPC faces by :class:`tests.round_driver.RoundDriver` as the coordinator and the
clients drive them. The compromised shard is the real one with what it hands the key holder
replaced (its ``aggregates``), as a shard under an attacker's control would. For each attack the
test checks that the key holder refuses the round and that nothing was decrypted (the secret
key's ``open`` never returns), in synchronous rounds and in asynchronous buffers (updates
of three different model versions, weighted by staleness).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from crypto import CiphertextSum, PublicContext, unpack_block
from crypto.signed_update import SignedUpdate
from crypto.sketch import Challenge
from fedps.errors import (
    FedPSError,
    InvalidArgumentError,
    PolicyError,
    QuarantinedError,
    RoundClosedError,
)
from fedps.learning.staleness import create_staleness, multiplier
from fedps.proto import common_pb2
from fedps.rpc.messages import Aggregate, Contribution, signed_update_from_proto
from fedps.runtime.cluster_status import print_status
from server.keyholder.aggregate_verifier import AggregateVerifier, TamperingError
from server.keyholder.commit_board import Commitment, CommitPhase
from tests.conftest import start_cluster
from tests.round_driver import HandClient, RoundDriver
from tests.security.arena import RUN, TAMPER, VERSION, Arena, open_arena
from tests.security.sketch_forgery import isolating_aggregate
from tests.waiting import wait_for

pytestmark = [pytest.mark.attack, pytest.mark.integration]


def _add_to_coefficient(public: PublicContext, coefficient: int, value: int) -> TAMPER:
    def change(a: Aggregate) -> Aggregate:
        coeffs = unpack_block(public, a.ciphertext).copy()
        q = public.modulus
        coeffs[coefficient] = np.uint64((int(coeffs[coefficient]) + value) % q)
        total = CiphertextSum(public)
        total.add(coeffs)
        return replace(a, ciphertext=total.packed())

    return change


def _alone(victim: HandClient) -> TAMPER:
    """The victim's ciphertext in place of the aggregate."""
    return lambda a: replace(a, ciphertext=victim.packed[a.block])


def _scaled(public: PublicContext, packed: bytes, k: int) -> bytes:
    total = CiphertextSum(public)
    total.add(unpack_block(public, packed), multiplier=k)
    return total.packed()


def _pack(public: PublicContext, coefficients: np.ndarray) -> bytes:
    """Packed bytes of integer coefficients (any integer dtype), reduced modulo q."""
    reduced = (coefficients.astype(object) % public.modulus).astype(np.uint64)
    return CiphertextSum(public, reduced).packed()


def _coeffs(public: PublicContext, packed: bytes, m: int = 1) -> np.ndarray:
    return unpack_block(public, packed).astype(object) * m


# ---------------------------------------------------------------------- (a) one coefficient
def test_a_changed_coefficient_is_refused_through_real_servers(arena: Arena) -> None:
    # Prepare: 20 rounds, each with a nonzero value added to one random coefficient of c0 or
    # c1 of one random block of the aggregate, before the key holder fetches it
    public = arena.public
    q, coeffs = public.modulus, public.coeffs_per_block
    accepted = 0
    for round_ in range(1, 21):
        clients = arena.clients()
        arena.driver.committed_round(round_, VERSION, clients)
        block = int(arena.rng.integers(0, 3))
        coefficient = int(arena.rng.integers(0, coeffs))  # < N: c0, else c1
        value = int(arena.rng.integers(1, q))
        arena.tamper(block, _add_to_coefficient(public, coefficient, value))
        # Execute / Assert
        try:
            arena.assert_refused(round_, clients)
        except AssertionError:
            accepted += 1
            raise
    assert accepted == 0
    assert sum(arena.keyholder.detections[s]["aggregate"] for s in arena.keyholder.detections) == 20
    # And the key holder still applies an honest round
    honest = arena.clients()
    arena.driver.committed_round(21, VERSION, honest)
    assert arena.driver.apply(21, VERSION, honest).version == VERSION + 1


def test_a_changed_coefficient_is_refused_500_times(arena: Arena) -> None:
    # Prepare: three real encrypted updates; for every trial a fresh secret challenge, the
    # clients' sketches under it, and the honest aggregate changed in one random coefficient
    public = arena.public
    q, n = public.modulus, public.coeffs_per_block
    clients = arena.clients()
    for c in clients:
        arena.driver.encrypt(c, 1)
    staleness = create_staleness("polynomial", a=0.5) if arena.mode == "async" else None
    multipliers = {
        c.client_id: multiplier(staleness, VERSION - c.version) if staleness else 1 for c in clients
    }
    rows = np.zeros_like(clients[0].coefficients, dtype=object)
    for c in clients:
        rows = (rows + c.coefficients.astype(object) * multipliers[c.client_id]) % q
    honest = rows.astype(np.uint64)
    blocks = list(range(honest.shape[0]))
    owners = [arena.driver.ring.owner(b) for b in blocks]
    accepted = 0
    for _ in range(500):
        challenge = Challenge(os.urandom(32), modulus=q, coeffs_per_block=n)
        phase = CommitPhase(
            1,
            VERSION,
            RUN,
            public.context_id,
            {c.client_id: c.signer.public_key for c in clients},
            {
                c.client_id: Commitment(
                    signed_update_from_proto(c.signed), challenge.sketch(c.coefficients)
                )
                for c in clients
            },
            frozen=True,
        )
        verifier = AggregateVerifier(
            phase=phase,
            contributors={c.client_id for c in clients},
            min_quorum=2,
            max_clients=100,
            challenge=challenge,
            staleness=staleness,
            max_staleness=2,
        )
        expected = verifier.expected_sketches()
        verifier.check_aggregates(owners, blocks, honest, expected)  # the honest sum passes
        tampered = honest.copy()
        block, coefficient = int(arena.rng.integers(0, len(blocks))), int(arena.rng.integers(0, n))
        value = int(arena.rng.integers(1, q))
        tampered[block, coefficient] = np.uint64((int(tampered[block, coefficient]) + value) % q)
        # Execute
        try:
            verifier.check_aggregates(owners, blocks, tampered, expected)
            accepted += 1
        except TamperingError as exc:
            assert exc.reason == "aggregate" and exc.shard == owners[block]
    # Assert
    assert accepted == 0


# ---------------------------------------------------------------------- (b) isolation
def _isolations(arena: Arena, clients: list[HandClient]) -> dict[str, TAMPER]:
    public = arena.public
    victim = clients[1]

    def sub_sum(a: Aggregate, names: set[str]) -> bytes:
        total = CiphertextSum(public)
        for c in clients:
            if c.client_id in names:
                m = a.contributions[c.client_id].multiplier
                total.add(unpack_block(public, c.packed[a.block]), multiplier=m)
        return total.packed()

    others = {c.client_id for c in clients} - {victim.client_id}
    return {
        "one client's ciphertext as the aggregate": lambda a: replace(
            a, ciphertext=victim.packed[a.block]
        ),
        "twice one client's ciphertext": lambda a: replace(
            a, ciphertext=_scaled(public, victim.packed[a.block], 2)
        ),
        "three times one client's ciphertext": lambda a: replace(
            a, ciphertext=_scaled(public, victim.packed[a.block], 3)
        ),
        "the aggregate doubled": lambda a: replace(a, ciphertext=_scaled(public, a.ciphertext, 2)),
        "the aggregate minus one client": lambda a: replace(
            a,
            ciphertext=_pack(
                public,
                _coeffs(public, a.ciphertext)
                - _coeffs(
                    public, victim.packed[a.block], a.contributions[victim.client_id].multiplier
                ),
            ),
        ),
        "a sub-cohort, listed as such": lambda a: replace(
            a,
            ciphertext=sub_sum(a, others),
            contributions={c: v for c, v in a.contributions.items() if c in others},
        ),
        "a sub-cohort, listed as everyone": lambda a: replace(a, ciphertext=sub_sum(a, others)),
        "the victim alone, listed as such": lambda a: replace(
            a,
            ciphertext=victim.packed[a.block],
            contributions={victim.client_id: a.contributions[victim.client_id]},
        ),
        "a contributor re-weighted": lambda a: replace(
            a,
            contributions={
                **a.contributions,
                victim.client_id: replace(a.contributions[victim.client_id], weight=0.5),
            },
        ),
        "an invented contributor": lambda a: replace(
            a,
            contributions={
                **a.contributions,
                "client-9": Contribution(1.0, b"\0" * 32, VERSION, 1),
            },
        ),
    }


def test_b_isolating_one_client_is_refused_on_any_block(arena: Arena) -> None:
    # Prepare: each isolation, on a random block, in its own round
    names = list(_isolations(arena, arena.clients()))
    for round_, name in enumerate(names, start=1):
        clients = arena.clients()
        arena.driver.committed_round(round_, VERSION, clients)
        block = int(arena.rng.integers(0, 3))
        arena.tamper(block, _isolations(arena, clients)[name])
        # Execute / Assert
        arena.assert_refused(round_, clients)


def test_b_a_round_closed_with_fewer_clients_sums_exactly_those(arena: Arena) -> None:
    # Prepare: every shard holds all three clients' pushes, but the round closes with fewer
    # (as when one shard reports the others incomplete, truly or not)
    clients = arena.clients()
    arena.driver.committed_round(1, VERSION, clients)
    # Execute / Assert: a set below the quorum is refused, decrypting nothing
    arena.assert_refused(1, clients[:1])
    # Execute: two, a quorum
    clients = arena.clients()
    arena.driver.committed_round(2, VERSION, clients)
    arena.driver.apply(2, VERSION, clients[:2])
    # Assert: every shard summed exactly the two, nobody is blamed, one decryption
    result = arena.keyholder._released[2]
    assert set(result.contributors) == {c.client_id for c in clients[:2]}
    assert arena.keyholder.detections == {} and arena.keyholder.blamed == {}
    assert len(arena.decryptions) == 1


# ---------------------------------------------------------------------- (c) cancellation
def test_c_a_colluder_cannot_cancel_the_others(arena: Arena) -> None:
    # Prepare: alice and bob are honest; mallory colludes with the shards. Everyone commits,
    # the commitments freeze, the honest clients push, and the shards show mallory their
    # ciphertexts: she computes minus their sum, so that the aggregate would be bob's alone...
    public = arena.public
    alice, bob, mallory = arena.clients(["client-0", "client-1", "client-2"])
    driver = arena.driver
    driver.open_commits(1, VERSION, [alice, bob, mallory])
    for client in (alice, bob, mallory):
        driver.commit(1, client)
    commits = driver.freeze(1)
    driver.open_shards(1, VERSION, [alice, bob, mallory], commits)
    driver.push(1, alice)
    driver.push(1, bob)
    q = public.modulus
    cancel = (-(alice.coefficients.astype(object)) % q).astype(np.uint64)
    crafted = HandClient(mallory.client_id, mallory.update, mallory.version, signer=mallory.signer)
    crafted.coefficients = cancel
    crafted.packed = {b: _pack(public, cancel[b]) for b in range(len(cancel))}
    # Execute / Assert 1: committing the crafted update now is refused (commitments are fixed)
    with pytest.raises(FedPSError) as refused:
        driver.commit(1, crafted)
    assert isinstance(refused.value, InvalidArgumentError | RoundClosedError)
    # ... a cohort member who had not committed is refused as too late
    late = HandClient("client-3", mallory.update)
    driver.encrypt(late, 1)
    with pytest.raises(FedPSError):
        driver.commit(1, late)
    # 2: pushing the crafted ciphertexts (signed anew) is refused by an honest shard
    driver.encrypt(crafted, 1)
    with pytest.raises(InvalidArgumentError, match="committed"):
        driver.push(1, crafted)
    # 3: a malicious shard that adds them anyway in place of mallory's is caught
    driver.push(1, mallory)
    driver.close(1)
    for block in range(3):
        if arena.owner(block) is arena.owner(0):
            arena.tamper(
                block,
                lambda a: replace(
                    a,
                    ciphertext=_pack(
                        public,
                        _coeffs(
                            public, alice.packed[a.block], a.contributions["client-0"].multiplier
                        )
                        + _coeffs(
                            public, bob.packed[a.block], a.contributions["client-1"].multiplier
                        )
                        + cancel[a.block].astype(object) * a.contributions["client-2"].multiplier,
                    ),
                ),
            )
            break
    arena.assert_refused(1, [alice, bob, mallory])


# ---------------------------------------------------------------------- after a detection
def test_a_refused_round_is_never_decrypted_and_suspects_are_counted(
    arena: Arena,
) -> None:
    # Prepare: a tampered round, refused
    clients = arena.clients()
    arena.driver.committed_round(1, VERSION, clients)
    arena.tamper(0, lambda a: replace(a, ciphertext=clients[0].packed[0]))
    arena.assert_refused(1, clients)
    # Execute: the shard now hands over the honest aggregate of the same round
    before = len(arena.decryptions)
    with pytest.raises(PolicyError, match="never decrypted"):
        arena.driver.apply(1, VERSION, clients)
    # Assert: nothing decrypted; the shard is counted as a suspect
    assert len(arena.decryptions) == before
    state = arena.driver.keyholder.GetModelState(common_pb2.Empty())
    assert dict(state.detections) == {arena.driver.ring.owner(0): 1}
    assert dict(state.detection_reasons) == {"aggregate": 1}  # by reason, for the operator


def test_quarantine_after_max_detections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: max_detections = 2, and a coordinator for `fedps status` (no clients: it only
    # gives the key holder its model and waits)
    cluster = start_cluster(
        tmp_path,
        num_shards=1,
        training={"clients": 3, "min_quorum": 2},
        security={"max_detections": 2},
    )
    try:
        kh = cluster.keyholder
        wait_for(lambda: kh.params is not None, "the key holder's initial model")
        assert kh.params is not None
        size, version = kh.params.size, kh.version
        driver = RoundDriver(cluster.config, kh.keys.public, run_id=RUN)
        rng = np.random.default_rng(3)

        def clients() -> list[HandClient]:
            return [HandClient(f"client-{i}", rng.uniform(-0.3, 0.3, size)) for i in range(3)]

        arena = Arena(cluster, driver, "sync", [], rng)
        for round_ in (1, 2):
            tampered = clients()
            driver.committed_round(round_, version, tampered)
            arena.tamper(0, _alone(tampered[2]))
            with pytest.raises(PolicyError, match="tampering"):
                driver.apply(round_, version, tampered)
            arena.heal()
        # Execute: an honest round after two detections
        honest = clients()
        driver.committed_round(3, version, honest)
        # Assert: refused without decrypting; the shard is reported quarantined
        with pytest.raises(QuarantinedError, match="decrypts nothing"):
            driver.apply(3, version, honest)
        assert kh.version == version
        assert kh.quarantined == ["shard-0"]
        print_status(cluster.config)
        out = capsys.readouterr().out
        assert "shard-0" in out and "QUARANTINED: 2 tampered aggregate(s)" in out
        # Execute: the operator replaced the shard and clears the detections
        kh.clear_detections()
        fresh = clients()
        driver.committed_round(4, version, fresh)
        # Assert: an honest round is applied again; the refused ones stay refused
        assert driver.apply(4, version, fresh).version == version + 1
        with pytest.raises(PolicyError, match="never decrypted"):
            driver.apply(1, version, honest)
    finally:
        cluster.stop()


def test_a_shard_streaming_duplicate_or_foreign_blocks_is_cut_off(arena: Arena) -> None:
    # Prepare: a shard that answers the fetch with 3,000 copies of one of its blocks (each
    # copy about 12 KB), then one that sends a block it does not own
    clients = arena.clients()
    arena.driver.committed_round(1, VERSION, clients)
    shard = arena.owner(0)
    honest = type(shard).aggregates.__get__(shard)

    def flooding(
        round_: int, contributors: Collection[str]
    ) -> tuple[list[Aggregate], list[SignedUpdate]]:
        aggregates, updates = honest(round_, contributors)
        return [aggregates[0]] * 3000, updates

    shard.aggregates = flooding  # type: ignore[method-assign]
    # Execute / Assert: refused as a duplicate, nothing decrypted, counted against the shard
    arena.assert_refused(1, clients)
    assert arena.keyholder.detections[shard.shard_id] == {"duplicate-block": 1}
    # ... and a block of another shard is refused as foreign
    others = [b for b in range(3) if arena.owner(b) is not shard]
    if others:
        clients = arena.clients()
        arena.driver.committed_round(2, VERSION, clients)
        stolen = others[0]
        arena.tamper(0, lambda a: replace(a, block=stolen))
        arena.assert_refused(2, clients)
        assert arena.keyholder.detections[shard.shard_id]["foreign-block"] == 1


def test_a_malformed_or_bloated_block_is_blamed_on_its_own_shard(arena: Arena) -> None:
    # Prepare: each shard in turn sends one short block; then one sends a manifest bloated
    # with thousands of invented contributors
    for round_, shard in enumerate(arena.cluster.shards, start=1):
        blocks = [b for b in range(3) if arena.owner(b) is shard]
        if not blocks:
            continue
        clients = arena.clients()
        arena.driver.committed_round(round_, VERSION, clients)
        arena.tamper(blocks[0], lambda a: replace(a, ciphertext=a.ciphertext[:-8]))
        # Execute / Assert: refused, and counted against the shard that sent it
        arena.assert_refused(round_, clients)
        assert arena.keyholder.detections.get(shard.shard_id, {}).get("malformed") == 1
    assert set(arena.keyholder.detections) <= {s.shard_id for s in arena.cluster.shards}
    clients = arena.clients()
    arena.driver.committed_round(9, VERSION, clients)
    bloat = {f"client-{i}": Contribution(1.0, b"\0" * 32, VERSION, 1) for i in range(10, 5000)}
    arena.tamper(0, lambda a: replace(a, contributions={**a.contributions, **bloat}))
    arena.assert_refused(9, clients)
    assert arena.keyholder.detections[arena.owner(0).shard_id]["manifest"] == 1


def test_b_a_shard_with_a_colluding_client_cannot_isolate_one_client(tmp_path: Path) -> None:
    """The owner of block 1 hands over victim + colluder with a forged sketch (plain packing).

    :func:`tests.security.sketch_forgery.isolating_aggregate`: the colluder gives its shard the
    round's challenge, and a correction of entries in {-1, 0, 1} in ``c0`` makes the aggregate's
    sketch the sum of all three committed ones. Every check of the aggregate passes; the pad
    of the client left out (crypto/blinding.py) is what keeps the victim's update unreadable.
    """
    # Prepare: an honest round, then the shard's substitute for block 1
    arena = open_arena(tmp_path, "sync")
    try:
        clients = arena.clients(["client-0", "client-1", "mallory"])
        victim, left_out, mallory = clients
        arena.driver.committed_round(1, VERSION, clients)
        challenge = arena.driver.challenge(1, mallory)
        forged = isolating_aggregate(challenge, arena.public, 1, [victim, mallory], left_out)
        arena.tamper(1, lambda a: replace(a, ciphertext=_pack(arena.public, forged[0])))

        # Execute
        try:
            arena.driver.apply(1, VERSION, clients)
        except PolicyError as refused:
            # the forgery passes every check of the aggregate: the pads leave it unreadable
            assert not isinstance(refused, TamperingError), refused
            return

        # Assert: the released block is not the victim's update plus the colluder's own
        released = arena.keyholder.params
        assert released is not None
        block = arena.keyholder.layout.block_of(released, 1) * 3
        own = arena.keyholder.layout.block_of(mallory.update, 1)
        victims = arena.keyholder.layout.block_of(victim.update, 1)
        assert not np.allclose(block - own, victims, atol=1e-3), "the victim's update was released"
    finally:
        arena.cluster.stop()
