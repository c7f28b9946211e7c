"""Tests for server.shard.shard.Shard, the shard's rules without gRPC, on real CKKS ciphertexts.

Each client's update holds one constant per client (1, 2, 4, ...) times ``block + 1``, so the
decrypted sum of a block tells exactly which clients were counted, and how many times. Every
client encrypts its whole model once per module and signs it (Ed25519 over the chunk roots of
every block) once per test, as a real client signs once per round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest

from crypto import BlockEncryptor, CkksParams, PublicContext, SecretContext, bitpack, unpack_block
from crypto.files import FAULTS_VARIABLE
from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner, chunk_root
from fedps.errors import (
    CorruptStateError,
    InvalidArgumentError,
    NotReadyError,
    PeerUnavailableError,
    RateLimitedError,
    RoundClosedError,
    UnknownClientError,
)
from fedps.rpc.messages import Aggregate, Contribution
from fedps.rpc.shard_messages import PushBatch
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from server.shard.shard import Shard
from server.shard.shard_log import ShardLog

N = CkksParams().values_per_block  # values per block (the default ring, less its canaries)
NUM_BLOCKS = 4
SHARD = "shard-0"
TOLERANCE = 1e-3  # a few ciphertexts summed: well above the ~4e-5 error of each
CLIENT_VALUE = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 8.0, "e": 16.0, "f": 32.0}
COHORT = ["a", "b", "c"]

#: Makes the push message carrying some blocks of one signed update.
Pusher = Callable[[Iterable[int]], PushBatch]
#: Finds a public context by its id, as the key holder's lookup does.
Lookup = Callable[[str], PublicContext]


@dataclasses.dataclass(frozen=True)
class Encrypted:
    """One client's whole encrypted model update: packed blocks and their coefficients."""

    packed: dict[int, bytes]
    coefficients: np.ndarray  # (NUM_BLOCKS, 2N) uint64

    def roots(self) -> list[bytes]:
        return [chunk_root(row) for row in self.coefficients]


def _model_update(value: float) -> np.ndarray:
    """A flat update of every block: ``value * (block + 1)`` throughout block ``block``."""
    return np.concatenate([np.full(N, value * (b + 1)) for b in range(NUM_BLOCKS)])


class Updates:
    """Every client's key and encrypted update, and the signing a client does each round."""

    def __init__(self, keys: SecretContext) -> None:
        self.context_id = keys.public.context_id
        encryptor = BlockEncryptor(keys.public)
        self.signers = {client: BlockSigner() for client in CLIENT_VALUE}
        self.encrypted = {
            client: Encrypted(*encryptor.encrypt_with_coefficients(_model_update(value)))
            for client, value in CLIENT_VALUE.items()
        }
        assert all(len(e.packed) == NUM_BLOCKS for e in self.encrypted.values())

    def members(self, clients: Iterable[str]) -> dict[str, bytes]:
        """A cohort: each client with its registered public key."""
        return {client: self.signers[client].public_key for client in clients}

    def signed(
        self,
        client: str,
        *,
        weight: float = 1.0,
        round_: int = 1,
        version: int = 1,
        run_id: str = "",
        encrypted: Encrypted | None = None,
        signer: BlockSigner | None = None,
    ) -> Pusher:
        """Sign ``client``'s whole update once; push messages for any blocks of it."""
        update = encrypted or self.encrypted[client]
        signed = SignedUpdate.sign(
            signer or self.signers[client],
            update.coefficients,
            run_id=run_id,
            round_=round_,
            client_id=client,
            context_id=self.context_id,
            weight=weight,
            version=version,
        )
        nonce, signature, roots = signed.nonce, signed.signature, signed.roots

        def push_batch(blocks: Iterable[int]) -> PushBatch:
            return PushBatch(
                client,
                round_,
                version,
                weight,
                self.context_id,
                [(b, update.packed[b]) for b in blocks],
                nonce=nonce,
                signature=signature,
                roots=tuple(roots),
            )

        return push_batch


@pytest.fixture(scope="module")
def keys() -> SecretContext:
    return SecretContext.generate(CkksParams())


@pytest.fixture(scope="module")
def ring() -> HashRing:
    return HashRing(["shard-0", "shard-1"])


@pytest.fixture(scope="module")
def owned(ring: HashRing) -> list[int]:
    blocks = ring.assignment(NUM_BLOCKS)[SHARD]
    # The tests need this shard to own several blocks and the other shard at least one.
    assert 2 <= len(blocks) < NUM_BLOCKS
    return blocks


@pytest.fixture(scope="module")
def foreign_block(ring: HashRing) -> int:
    return ring.assignment(NUM_BLOCKS)["shard-1"][0]


@pytest.fixture(scope="module")
def lookup(keys: SecretContext) -> Lookup:
    def public_context(context_id: str) -> PublicContext:
        if context_id != keys.public.context_id:
            raise InvalidArgumentError(f"unknown context id {context_id[:12]}")
        return keys.public

    return public_context


@pytest.fixture(scope="module")
def updates(keys: SecretContext) -> Updates:
    """Every client's key and encrypted update, every block (encrypted once per module)."""
    return Updates(keys)


def _published(ring: HashRing, owned: list[int], lookup: Lookup) -> Shard:
    shard = Shard(SHARD, ring, lookup)
    shard.model.publish(1, NUM_BLOCKS, N, {b: np.full(N, float(b)) for b in owned})
    return shard


@pytest.fixture
def shard(
    ring: HashRing,
    owned: list[int],
    lookup: Lookup,
    keys: SecretContext,
    updates: Updates,
) -> Shard:
    """A shard at version 1 with round 1 open for clients a, b and c."""
    shard = _published(ring, owned, lookup)
    shard.open_round(1, 1, updates.members(COHORT), keys.public.context_id)
    return shard


def _push_all(
    shard: Shard,
    client: str,
    updates: Updates,
    owned: list[int],
    weight: float = 1.0,
    round_: int = 1,
) -> tuple[int, int]:
    """Push every owned block of ``client``'s update, signed, in one message."""
    return shard.push(updates.signed(client, weight=weight, round_=round_)(owned))


def _contributions(
    updates: Updates, block: int, weights: dict[str, float]
) -> dict[str, Contribution]:
    """The manifest expected for ``block``: each client's weight, signed root, version 1 and
    no staleness multiplier (sync mode)."""
    return {
        c: Contribution(w, updates.encrypted[c].roots()[block], version=1, multiplier=1)
        for c, w in weights.items()
    }


def _decrypted_sums(aggregates: list[Aggregate], keys: SecretContext) -> dict[int, float]:
    """Each aggregate's decrypted block, divided by ``block + 1`` and checked constant."""
    out = {}
    for agg in aggregates:
        values = keys.decrypt(unpack_block(keys.public, agg.ciphertext)) / (agg.block + 1)
        assert np.ptp(values) < TOLERANCE
        out[agg.block] = float(np.mean(values))
    return out


def _assert_counted_alone(
    client: str, aggregates: list[Aggregate], signed: list[SignedUpdate], updates: Updates
) -> None:
    """Every aggregate counts ``client`` alone, with weight 1; only its update is handed on."""
    assert all(
        agg.contributions == _contributions(updates, agg.block, {client: 1.0}) for agg in aggregates
    )
    assert [u.client_id for u in signed] == [client]


def test_shard_not_on_ring_is_refused(ring: HashRing, lookup: Lookup) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(InvalidArgumentError, match="not on the ring"):
        Shard("shard-9", ring, lookup)


# --------------------------------------------------------------------------- rounds


def test_push_before_open_round_is_refused(
    ring: HashRing, owned: list[int], lookup: Lookup, updates: Updates
) -> None:
    # Prepare
    shard = _published(ring, owned, lookup)

    # Execute / Assert: not open yet (the client retries until the coordinator opens it)
    with pytest.raises(NotReadyError, match=r"not open .* yet"):
        _push_all(shard, "a", updates, owned)
    assert shard.stats["refused"] == 1
    assert shard.status().refusals == {"not_ready": 1}  # by reason, for the operator
    assert not shard.round_is_open


def test_open_round_validation(shard: Shard, keys: SecretContext, updates: Updates) -> None:
    # Prepare / Execute / Assert: an empty cohort, a member without a valid key, and a
    # context id the key holder never made.
    with pytest.raises(InvalidArgumentError, match="cohort"):
        shard.open_round(2, 1, {}, keys.public.context_id)
    with pytest.raises(InvalidArgumentError, match="32-byte"):
        shard.open_round(
            2, 1, {**updates.members(COHORT), "c": b"\x01" * 31}, keys.public.context_id
        )
    with pytest.raises(InvalidArgumentError, match="context id"):
        shard.open_round(2, 1, updates.members(COHORT), "0" * 64)
    assert shard.open_round_number == 1
    assert shard.round_is_open


def test_push_from_unknown_client_is_refused(
    shard: Shard, owned: list[int], updates: Updates
) -> None:
    # Prepare: "d" is a real client with a real, signed update, just not in this round's cohort.
    # Execute / Assert
    with pytest.raises(UnknownClientError, match="'d'"):
        _push_all(shard, "d", updates, owned)
    assert shard.stats == {"accepted": 0, "duplicates": 0, "refused": 1, "bytes": 0}


def test_valid_pushes_sum_every_block(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    # Prepare
    weights = {"a": 1.5, "b": 2.0, "c": 30.0}
    batches = {c: updates.signed(c, weight=w)(owned) for c, w in weights.items()}

    # Execute
    results = [shard.push(batch) for batch in batches.values()]
    complete = shard.close_round(1)
    aggregates, signed = shard.aggregates(1, shard.close_round(1))

    # Assert: every block summed, each contribution with its weight and signed root, and
    # each client's signed update handed on for the key holder to check.
    assert results == [(len(owned), 0)] * 3
    assert complete == ["a", "b", "c"]
    assert [agg.block for agg in aggregates] == owned
    for agg in aggregates:
        assert agg.contributions == _contributions(updates, agg.block, weights)
    assert sorted(signed, key=lambda u: u.client_id) == [
        SignedUpdate(c, b.weight, b.nonce, b.signature, b.roots, b.version)
        for c, b in batches.items()
    ]
    assert all(list(u.roots) == updates.encrypted[u.client_id].roots() for u in signed)
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 7.0) < TOLERANCE for s in sums.values())  # 1 + 2 + 4
    assert shard.stats["accepted"] == 3 * len(owned)
    assert shard.stats["bytes"] == 3 * len(owned) * keys.public.block_bytes


_BAD_PUSHES = {
    "wrong-version": "version",
    "wrong-context-id": "context id",
    "non-owned-block": "not owned",
    "short-ciphertext": "exactly",
    "long-ciphertext": "exactly",
    "coefficient-not-below-q": "not below q",
    "block-twice": "twice",
    "no-blocks": "no blocks",
    "nan-weight": "weight",
    "inf-weight": "weight",
    "zero-weight": "weight",
    "negative-weight": "weight",
    "huge-weight": "weight",
}


@pytest.mark.parametrize("case", sorted(_BAD_PUSHES))
def test_invalid_push_is_refused_and_adds_nothing(
    shard: Shard,
    keys: SecretContext,
    owned: list[int],
    foreign_block: int,
    updates: Updates,
    case: str,
) -> None:
    # Prepare: a bad message from "b", validly signed, whose other blocks are all valid.
    weights = {
        "nan-weight": float("nan"),
        "inf-weight": float("inf"),
        "zero-weight": 0.0,
        "negative-weight": -1.0,
        "huge-weight": 1e7,
    }
    encrypted = updates.encrypted["b"]
    if case == "coefficient-not-below-q":
        # Signed as it is, so that only the range check can refuse it.
        coefficients = encrypted.coefficients.copy()
        coefficients[owned[-1], 5] = keys.public.modulus
        packed = dict(encrypted.packed)
        packed[owned[-1]] = bitpack.pack(coefficients[owned[-1]], keys.public.coeff_bits)
        encrypted = Encrypted(packed, coefficients)
    bad = updates.signed("b", weight=weights.get(case, 1.0), encrypted=encrypted)(owned)
    blocks = list(bad.blocks)
    if case == "wrong-version":
        bad = dataclasses.replace(bad, version=2)
    elif case == "wrong-context-id":
        bad = dataclasses.replace(bad, context_id="f" * 64)
    elif case == "non-owned-block":
        blocks.append((foreign_block, encrypted.packed[foreign_block]))
    elif case == "short-ciphertext":
        blocks[-1] = (blocks[-1][0], blocks[-1][1][:-1])
    elif case == "long-ciphertext":
        blocks[-1] = (blocks[-1][0], blocks[-1][1] + b"\x00")
    elif case == "block-twice":
        blocks.append(blocks[0])
    elif case == "no-blocks":
        blocks = []
    bad = dataclasses.replace(bad, blocks=blocks)
    _push_all(shard, "a", updates, owned)

    # Execute
    with pytest.raises(InvalidArgumentError, match=_BAD_PUSHES[case]):
        shard.push(bad)
    shard.close_round(1)
    aggregates, signed = shard.aggregates(1, shard.close_round(1))

    # Assert: only "a" is in the sums, the manifests and the signed updates.
    assert shard.stats["refused"] == 1
    assert shard.stats["accepted"] == len(owned)
    _assert_counted_alone("a", aggregates, signed, updates)
    sums = _decrypted_sums(aggregates, keys)
    assert sorted(sums) == owned
    assert all(abs(s - 1.0) < TOLERANCE for s in sums.values())


@pytest.mark.parametrize("case", ["nan-weight", "short-block-after-valid-signature"])
def test_refused_push_does_not_block_a_later_valid_one(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates, case: str
) -> None:
    # Prepare: a refused message first (a bad weight, or a signed update of weight 5 with a
    # truncated block), then the same client's valid update of weight 3.
    if case == "nan-weight":
        refused = updates.signed("b", weight=float("nan"))(owned)
    else:
        refused = updates.signed("b", weight=5.0)(owned)
        blocks = [(b, data[:-1] if b == owned[-1] else data) for b, data in refused.blocks]
        refused = dataclasses.replace(refused, blocks=blocks)
    with pytest.raises(InvalidArgumentError):
        shard.push(refused)

    # Execute
    accepted = _push_all(shard, "b", updates, owned, weight=3.0)
    shard.close_round(1)

    # Assert
    assert accepted == (len(owned), 0)
    aggregates, signed = shard.aggregates(1, shard.close_round(1))
    assert [(u.client_id, u.weight) for u in signed] == [("b", 3.0)]
    assert all(
        agg.contributions == _contributions(updates, agg.block, {"b": 3.0}) for agg in aggregates
    )
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 2.0) < TOLERANCE for s in sums.values())


def test_duplicate_push_is_counted_once(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    # Prepare
    push_batch = updates.signed("c", weight=2.0)
    first = shard.push(push_batch(owned))

    # Execute: the retry carries the same signed update.
    second = shard.push(push_batch(owned))
    shard.close_round(1)
    aggregates, signed = shard.aggregates(1, shard.close_round(1))

    # Assert
    assert first == (len(owned), 0)
    assert second == (0, len(owned))
    assert shard.stats["duplicates"] == len(owned)
    assert shard.stats["accepted"] == len(owned)
    assert all(
        agg.contributions == _contributions(updates, agg.block, {"c": 2.0}) for agg in aggregates
    )
    assert len(signed) == 1
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 4.0) < TOLERANCE for s in sums.values())  # once, not 8


def test_partly_duplicate_push_adds_only_new_blocks(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    # Prepare
    push_batch = updates.signed("a")
    shard.push(push_batch([owned[0]]))

    # Execute
    result = shard.push(push_batch(owned))
    shard.close_round(1)

    # Assert
    assert result == (len(owned) - 1, 1)
    sums = _decrypted_sums(shard.aggregates(1, shard.close_round(1))[0], keys)
    assert sorted(sums) == owned
    assert all(abs(s - 1.0) < TOLERANCE for s in sums.values())


def test_close_round_returns_only_complete_clients(
    shard: Shard, owned: list[int], updates: Updates
) -> None:
    # Prepare: "a" pushes every block in one message, "b" in one message per block,
    # "c" misses the last block.
    _push_all(shard, "a", updates, owned)
    push_b = updates.signed("b")
    for b in owned:
        shard.push(push_b([b]))
    shard.push(updates.signed("c")(owned[:-1]))

    # Execute
    complete = shard.close_round(1)

    # Assert
    assert complete == ["a", "b"]
    assert not shard.round_is_open
    # ... and every block sums exactly the complete clients: "c"'s partial push is left out
    aggregates, _ = shard.aggregates(1, complete)
    assert [set(agg.contributions) for agg in aggregates] == [{"a", "b"}] * len(owned)


def test_push_after_close_is_refused(shard: Shard, owned: list[int], updates: Updates) -> None:
    # Prepare
    _push_all(shard, "a", updates, owned)
    shard.close_round(1)

    # Execute / Assert
    with pytest.raises(RoundClosedError):
        _push_all(shard, "b", updates, owned)
    aggregates, _ = shard.aggregates(1, shard.close_round(1))
    assert all(set(agg.contributions) == {"a"} for agg in aggregates)


def test_push_to_other_round_is_refused(shard: Shard, owned: list[int], updates: Updates) -> None:
    # Prepare: signed for round 2, which is not open yet, and for round 0, which is past
    later = updates.signed("a", round_=2)(owned)
    earlier = updates.signed("a", round_=0)(owned)

    # Execute / Assert
    with pytest.raises(NotReadyError):
        shard.push(later)
    with pytest.raises(RoundClosedError):
        shard.push(earlier)


def test_discard_round_drops_sums(shard: Shard, owned: list[int], updates: Updates) -> None:
    # Prepare
    _push_all(shard, "a", updates, owned)
    _push_all(shard, "b", updates, owned)

    # Execute
    shard.discard_round(1)

    # Assert
    with pytest.raises(InvalidArgumentError, match="holds no pushes"):
        shard.aggregates(1, ["a", "b"])
    with pytest.raises(RoundClosedError):
        _push_all(shard, "c", updates, owned)


def test_aggregates_of_open_or_unknown_round_are_refused(
    shard: Shard, owned: list[int], updates: Updates
) -> None:
    # Prepare
    _push_all(shard, "a", updates, owned)

    # Execute / Assert
    with pytest.raises(RoundClosedError, match="still open"):
        shard.aggregates(1, ["a"])
    with pytest.raises(RoundClosedError, match="unknown"):
        shard.aggregates(7, ["a"])
    with pytest.raises(RoundClosedError, match="unknown"):
        shard.close_round(7)
    with pytest.raises(RoundClosedError, match="unknown"):
        shard.discard_round(7)


def test_one_sum_per_block_whatever_the_number_of_clients(
    ring: HashRing, owned: list[int], lookup: Lookup, keys: SecretContext, updates: Updates
) -> None:
    # Prepare
    shard = _published(ring, owned, lookup)
    clients = sorted(CLIENT_VALUE)
    shard.open_round(1, 1, updates.members(clients), keys.public.context_id)
    sizes = []

    # Execute
    for client in clients:
        _push_all(shard, client, updates, owned)
        sizes.append(len(shard._rounds[1].sums))
    shard.close_round(1)
    aggregates, signed = shard.aggregates(1, shard.close_round(1))

    # Assert: one running sum (one block's worth of memory) per owned block.
    assert sizes == [len(owned)] * len(clients)
    assert len(aggregates) == len(owned)
    assert all(len(agg.ciphertext) == keys.public.block_bytes for agg in aggregates)
    assert all(set(agg.contributions) == set(clients) for agg in aggregates)
    assert sorted(u.client_id for u in signed) == clients
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 63.0) < TOLERANCE for s in sums.values())  # 1 + 2 + ... + 32


def test_reopening_same_round_is_idempotent(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    # Prepare
    _push_all(shard, "a", updates, owned)

    # Execute: the same cohort and keys, listed in another order.
    shard.open_round(1, 1, updates.members(reversed(COHORT)), keys.public.context_id)
    shard.close_round(1)

    # Assert: the sums survived the repeated open.
    aggregates, signed = shard.aggregates(1, shard.close_round(1))
    assert len(aggregates) == len(owned)
    _assert_counted_alone("a", aggregates, signed, updates)


@pytest.mark.parametrize("case", ["smaller-cohort", "new-key"])
def test_reopening_with_new_cohort_starts_afresh(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates, case: str
) -> None:
    # Prepare
    _push_all(shard, "a", updates, owned)
    if case == "smaller-cohort":
        members = updates.members(["a", "b"])
    else:  # the same clients, but "a" registered another key
        members = {**updates.members(COHORT), "a": BlockSigner().public_key}

    # Execute
    shard.open_round(1, 1, members, keys.public.context_id)
    _push_all(shard, "b", updates, owned)
    shard.close_round(1)

    # Assert
    aggregates, signed = shard.aggregates(1, shard.close_round(1))
    assert len(aggregates) == len(owned)
    _assert_counted_alone("b", aggregates, signed, updates)


def test_opening_next_round_closes_the_previous_one(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    # Prepare
    _push_all(shard, "a", updates, owned)

    # Execute
    shard.open_round(2, 1, updates.members(COHORT), keys.public.context_id)

    # Assert
    with pytest.raises(RoundClosedError):
        _push_all(shard, "b", updates, owned)
    assert shard.open_round_number == 2
    assert [set(a.contributions) for a in shard.aggregates(1, shard.close_round(1))[0]] == [
        {"a"}
    ] * len(owned)


# --------------------------------------------------------------------------- signatures


def _assert_only_a_counted(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    """Push "a"'s valid update, close the round and check that nothing else was counted."""
    assert _push_all(shard, "a", updates, owned) == (len(owned), 0)
    assert shard.close_round(1) == ["a"]
    aggregates, signed = shard.aggregates(1, shard.close_round(1))
    assert shard.stats["accepted"] == len(owned)
    _assert_counted_alone("a", aggregates, signed, updates)
    sums = _decrypted_sums(aggregates, keys)
    assert sorted(sums) == owned
    assert all(abs(s - 1.0) < TOLERANCE for s in sums.values())


_UNSIGNED = {
    "no-signature": "signature",  # roots, but no nonce or signature
    "garbage-signature": "signature",
    "no-commitment": "commits to 0 blocks",  # no nonce, signature or roots at all
    "too-few-roots": "commits to",  # validly signed, but not for every block of the model
}


@pytest.mark.parametrize("case", sorted(_UNSIGNED))
def test_unsigned_push_is_refused_and_adds_nothing(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates, case: str
) -> None:
    # Prepare: "b"'s real update, with its signature or commitment missing.
    if case == "too-few-roots":
        encrypted = updates.encrypted["b"]
        short = Encrypted(encrypted.packed, encrypted.coefficients[:-1])
        bad = updates.signed("b", encrypted=short)(owned)
    else:
        bad = updates.signed("b")(owned)
        if case == "no-signature":
            bad = dataclasses.replace(bad, nonce=b"", signature=b"")
        elif case == "garbage-signature":
            bad = dataclasses.replace(bad, signature=bytes(64))
        else:
            bad = PushBatch(
                bad.client_id, bad.round, bad.version, bad.weight, bad.context_id, bad.blocks
            )

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match=_UNSIGNED[case]):
        shard.push(bad)
    assert shard.stats == {"accepted": 0, "duplicates": 0, "refused": 1, "bytes": 0}
    _assert_only_a_counted(shard, keys, owned, updates)


@pytest.mark.parametrize("case", ["unregistered-key", "other-members-key"])
def test_push_signed_by_a_non_member_key_is_refused(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates, case: str
) -> None:
    # Prepare: "b"'s update, claimed as "b"'s but signed with a key "b" never registered.
    signer = BlockSigner() if case == "unregistered-key" else updates.signers["c"]
    bad = updates.signed("b", signer=signer)(owned)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="signature"):
        shard.push(bad)
    assert shard.stats["refused"] == 1
    _assert_only_a_counted(shard, keys, owned, updates)


@pytest.mark.parametrize("case", ["other-run", "other-round", "other-client", "other-weight"])
def test_signature_for_something_else_is_refused(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates, case: str
) -> None:
    # Prepare: a genuine signature by "b", but for another run, round, client or weight.
    if case == "other-run":
        bad = updates.signed("b", run_id="another-run")(owned)
    elif case == "other-round":
        bad = dataclasses.replace(updates.signed("b", round_=0)(owned), round=1)
    elif case == "other-client":  # "b" signed as if it were "c"
        bad = dataclasses.replace(
            updates.signed("c", signer=updates.signers["b"])(owned), client_id="b"
        )
    else:  # signed with weight 1, pushed with weight 10
        bad = dataclasses.replace(updates.signed("b")(owned), weight=10.0)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="signature"):
        shard.push(bad)
    _assert_only_a_counted(shard, keys, owned, updates)


@pytest.mark.parametrize("case", ["fresh-encryption", "other-clients-block", "other-block"])
def test_block_swapped_after_signing_is_refused_and_adds_nothing(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates, case: str
) -> None:
    # Prepare: "b"'s signed update with its last block replaced by another valid ciphertext.
    bad = updates.signed("b")(owned)
    target = owned[-1]
    if case == "fresh-encryption":  # the same values, encrypted again
        values = _model_update(CLIENT_VALUE["b"])[target * N : (target + 1) * N]
        swapped = BlockEncryptor(keys.public).encrypt_block(values)
    elif case == "other-clients-block":
        swapped = updates.encrypted["c"].packed[target]
    else:
        swapped = updates.encrypted["b"].packed[owned[0]]
    assert swapped != updates.encrypted["b"].packed[target]
    blocks = [(b, swapped if b == target else data) for b, data in bad.blocks]

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="commitment"):
        shard.push(dataclasses.replace(bad, blocks=blocks))
    assert shard.stats == {"accepted": 0, "duplicates": 0, "refused": 1, "bytes": 0}
    _assert_only_a_counted(shard, keys, owned, updates)


@pytest.mark.parametrize("case", ["re-signed-weight", "new-ciphertexts", "changed-weight"])
def test_second_different_update_in_a_round_is_refused(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates, case: str
) -> None:
    # Prepare: "a" pushes everything; "c" pushes all but its last block of a signed update.
    _push_all(shard, "a", updates, owned)
    first = updates.signed("c", weight=2.0)
    shard.push(first(owned[:-1]))
    if case == "re-signed-weight":  # the same ciphertexts, signed again with another weight
        second = updates.signed("c", weight=8.0)(owned)
    elif case == "new-ciphertexts":  # the same values, encrypted and signed again
        encrypted = Encrypted(
            *BlockEncryptor(keys.public).encrypt_with_coefficients(_model_update(CLIENT_VALUE["c"]))
        )
        second = updates.signed("c", weight=2.0, encrypted=encrypted)(owned)
    else:  # the first update's signature, with another weight
        second = dataclasses.replace(first(owned), weight=8.0)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="second, different update"):
        shard.push(second)
    assert shard.stats["refused"] == 1
    assert shard.stats["accepted"] == 2 * len(owned) - 1

    # Assert: the first update can still complete, and is all that counts.
    assert shard.push(first([owned[-1]])) == (1, 0)
    assert shard.close_round(1) == ["a", "c"]
    aggregates, signed = shard.aggregates(1, shard.close_round(1))
    for agg in aggregates:
        assert agg.contributions == _contributions(updates, agg.block, {"a": 1.0, "c": 2.0})
    assert sorted((u.client_id, u.weight) for u in signed) == [("a", 1.0), ("c", 2.0)]
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 5.0) < TOLERANCE for s in sums.values())  # 1 + 4


def test_too_many_messages_in_a_round_are_refused(
    ring: HashRing, owned: list[int], lookup: Lookup, keys: SecretContext, updates: Updates
) -> None:
    # Prepare: a shard allowing two messages per client and round; "a" sends its first block
    # twice (a duplicate counts as a message).
    shard = Shard(SHARD, ring, lookup, max_messages_per_round=2)
    shard.model.publish(1, NUM_BLOCKS, N, {b: np.full(N, float(b)) for b in owned})
    shard.open_round(1, 1, updates.members(COHORT), keys.public.context_id)
    push_a = updates.signed("a")
    assert shard.push(push_a([owned[0]])) == (1, 0)
    assert shard.push(push_a([owned[0]])) == (0, 1)

    # Execute / Assert: the third message is refused and adds nothing.
    with pytest.raises(RateLimitedError, match="'a'"):
        shard.push(push_a(owned[1:]))
    assert shard.stats == {
        "accepted": 1,
        "duplicates": 1,
        "refused": 1,
        "bytes": 2 * keys.public.block_bytes,
    }

    # Assert: other clients have their own budget ...
    assert _push_all(shard, "b", updates, owned) == (len(owned), 0)
    assert shard.close_round(1) == ["b"]
    manifests = {agg.block: set(agg.contributions) for agg in shard.aggregates(1, ["b"])[0]}
    assert manifests == {b: {"b"} for b in owned}

    # ... and "a" has a fresh one in the next round.
    shard.open_round(2, 1, updates.members(COHORT), keys.public.context_id)
    assert _push_all(shard, "a", updates, owned, round_=2) == (len(owned), 0)


def _publish_and_open(
    shard: Shard, owned: list[int], keys: SecretContext, updates: Updates
) -> None:
    """Version 1 published, round 1 open for the cohort."""
    shard.model.publish(1, NUM_BLOCKS, N, {b: np.full(N, float(b)) for b in owned})
    shard.open_round(1, 1, updates.members(COHORT), keys.public.context_id)


@dataclasses.dataclass(frozen=True)
class Durable:
    """Where a durable shard keeps its log, and what its tests need besides."""

    path: Path
    ring: HashRing
    lookup: Lookup
    owned: list[int]
    keys: SecretContext
    updates: Updates

    def start(self) -> Shard:
        """A shard on the log, having recovered what it holds (as after a crash)."""
        shard = Shard(SHARD, self.ring, self.lookup, log=ShardLog(self.path / SHARD))
        shard.recover()
        return shard


@pytest.fixture
def durable(
    tmp_path: Path,
    ring: HashRing,
    owned: list[int],
    lookup: Lookup,
    keys: SecretContext,
    updates: Updates,
) -> Durable:
    return Durable(tmp_path, ring, lookup, owned, keys, updates)


def test_restarted_shard_continues_the_open_round_and_counts_nothing_twice(
    durable: Durable,
) -> None:
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    # Prepare: a durable shard publishes, opens round 1 and acknowledges client a
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    push_a = updates.signed("a")(owned)
    assert first.push(push_a) == (len(owned), 0)
    # Execute: the process dies (nothing closed, nothing flushed by hand) and restarts
    del first
    second = durable.start()
    retried = second.push(push_a)  # the same message again, its acknowledgement was lost
    _push_all(second, "b", updates, owned)
    # Assert: the model and the round survived; a counted once, b added
    assert second.model.pull(1)[0] == 1 and second.round_is_open
    assert retried == (0, len(owned))
    assert second.close_round(1) == ["a", "b"]
    aggregates, signed = second.aggregates(1, second.close_round(1))
    assert sorted(u.client_id for u in signed) == ["a", "b"]
    sums = _decrypted_sums(aggregates, keys)
    assert sorted(sums) == owned
    assert all(abs(v - 3.0) < TOLERANCE for v in sums.values())  # 1 (a) + 2 (b), once each


def test_closed_and_discarded_rounds_stay_so_after_restart(durable: Durable) -> None:
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    # Prepare: round 1 closed with a; round 2 discarded after b
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    _push_all(first, "a", updates, owned)
    first.close_round(1)
    first.open_round(2, 1, updates.members(COHORT), keys.public.context_id)
    first.push(updates.signed("b", round_=2)(owned))
    first.discard_round(2)
    # Execute
    second = durable.start()
    # Assert: round 1's aggregate is still there to fetch; round 2 holds nothing
    sums = _decrypted_sums(second.aggregates(1, second.close_round(1))[0], keys)
    assert sorted(sums) == owned and all(abs(v - 1.0) < TOLERANCE for v in sums.values())
    with pytest.raises(InvalidArgumentError, match="holds no pushes"):
        second.aggregates(2, ["b"])


def test_torn_last_record_is_cut_off(durable: Durable) -> None:
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    # Prepare: a acknowledged; then the process dies in the middle of writing b's record
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    _push_all(first, "a", updates, owned)
    path = durable.path / SHARD / "log" / f"round-{1:012d}.wal"
    good = path.stat().st_size
    with open(path, "ab") as fh:
        fh.write(b"\x00\x10\x00\x00garbage")  # a header promising 4096 bytes, then a crash
    # Execute
    second = durable.start()
    # Assert: a is there, the torn record is gone from the file, b can push normally
    assert path.stat().st_size == good
    assert _push_all(second, "b", updates, owned) == (len(owned), 0)
    assert second.close_round(1) == ["a", "b"]


def _flip_byte(path: Path, index: int) -> None:
    data = bytearray(path.read_bytes())
    data[index] ^= 0x04
    path.write_bytes(data)


def test_a_push_the_disk_cannot_hold_is_refused_and_counted_once_retried(
    durable: Durable, faults: pytest.MonkeyPatch
) -> None:
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    # Prepare: round 1 open, then the disk is full for the next record
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    faults.setenv(FAULTS_VARIABLE, "round-*.wal")
    push_a = updates.signed("a")(owned)
    # Execute: refused as unavailable (a client retries), then the retry is acknowledged
    with pytest.raises(PeerUnavailableError, match="nothing was recorded, retry later"):
        first.push(push_a)
    retried = first.push(push_a)
    second = durable.start()
    # Assert: counted once, in memory and after a restart
    assert retried == (len(owned), 0)
    assert second.push(push_a) == (0, len(owned))
    assert second.close_round(1) == ["a"]
    sums = _decrypted_sums(second.aggregates(1, second.close_round(1))[0], keys)
    assert all(abs(v - 1.0) < TOLERANCE for v in sums.values())


def test_a_corrupt_round_opening_stops_recovery(durable: Durable) -> None:
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    # Prepare: round 1 opened and pushed to; then a bit of its opening record flips
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    _push_all(first, "a", updates, owned)
    path = durable.path / SHARD / "log" / f"round-{1:012d}.wal"
    _flip_byte(path, 12)
    damaged = path.read_bytes()
    # Execute / Assert: the shard stops instead of forgetting the round
    with pytest.raises(CorruptStateError) as info:
        durable.start()
    assert str(info.value).startswith(f"{path}: corrupt record at byte 0 (checksum mismatch)")
    assert path.read_bytes() == damaged
    assert path.with_name(f"{path.name}.corrupt").read_bytes() == damaged


def test_a_flipped_bit_in_the_saved_model_stops_recovery(durable: Durable) -> None:
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    # Prepare
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    path = durable.path / SHARD / "model.pb"
    _flip_byte(path, path.stat().st_size // 2)
    # Execute / Assert
    with pytest.raises(CorruptStateError) as info:
        durable.start()
    assert str(info.value) == (
        f"{path}: the published model is corrupt (checksum mismatch); delete it; the key "
        "holder republishes the model to this shard when the coordinator starts"
    )


def test_a_smaller_set_is_summed_from_the_log_after_a_restart(durable: Durable) -> None:
    # Prepare: a and b pushed every block and the round closed; the shard restarts (its
    # memory holds running sums only, the pushes are in its log)
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    _push_all(first, "a", updates, owned)
    _push_all(first, "b", updates, owned)
    first.close_round(1)
    second = durable.start()
    # Execute: the sum of a alone, as if another shard had found b incomplete
    aggregates, signed = second.aggregates(1, ["a"])
    # Assert: exactly a's blocks, read back from the log; a and b still sum to 1 + 2
    sums = _decrypted_sums(aggregates, keys)
    assert sorted(sums) == owned and all(abs(v - 1.0) < TOLERANCE for v in sums.values())
    assert [u.client_id for u in signed] == ["a"]
    assert all(set(a.contributions) == {"a"} for a in aggregates)
    both = _decrypted_sums(second.aggregates(1, ["a", "b"])[0], keys)
    assert all(abs(v - 3.0) < TOLERANCE for v in both.values())


# --------------------------------------------------------------------------- wire forms


@pytest.fixture(scope="module")
def compressed_keys() -> SecretContext:
    """Keys of the default workload, whose clients send compressed blocks."""
    params = CkksParams.for_workload(max_clients=100, max_abs_value=1.0, precision=1e-5)
    assert params.c0_drop_bits and params.c1_drop_bits
    return SecretContext.generate(params)


@pytest.mark.parametrize("form", ["compressed", "full", "compressed-out-of-range"])
def test_a_push_in_either_form_is_validated_exactly_and_summed(
    ring: HashRing, owned: list[int], compressed_keys: SecretContext, form: str
) -> None:
    # Prepare: "a" pushes as clients do; "b" compressed, in the full form (the same
    # ciphertext, so the same signed roots), or with a compressed value of c1 that expands
    # beyond q (its bits fit, its range not)
    keys = compressed_keys
    public = keys.public
    updates = Updates(keys)
    shard = _published(ring, owned, lambda _: public)
    shard.open_round(1, 1, updates.members(COHORT), public.context_id)
    _push_all(shard, "a", updates, owned)
    encrypted = updates.encrypted["b"]
    packed = dict(encrypted.packed)
    compression, n = public.compression, public.params.poly_modulus_degree
    start = bitpack.packed_size(n, compression.widths[0])
    end = start + bitpack.packed_size(n, compression.widths[1])
    for b in owned:
        if form == "full":
            packed[b] = bitpack.pack(encrypted.coefficients[b], public.coeff_bits)
        elif form == "compressed-out-of-range":
            c1 = bitpack.unpack(packed[b][start:end], n, compression.widths[1])
            c1[7] = compression.limits[1]
            packed[b] = (
                packed[b][:start] + bitpack.pack(c1, compression.widths[1]) + packed[b][end:]
            )
    push = updates.signed("b", encrypted=Encrypted(packed, encrypted.coefficients))(owned)

    # Execute
    if form == "compressed-out-of-range":
        with pytest.raises(InvalidArgumentError, match="out of range"):
            shard.push(push)
    else:
        shard.push(push)
    aggregates, _ = shard.aggregates(1, shard.close_round(1))

    # Assert: the bytes counted are the compressed ones; aggregates travel in the full form
    # and decrypt to the sum of what was accepted
    accepted = 1.0 if form == "compressed-out-of-range" else 3.0
    sent = {"compressed": public.block_bytes, "full": public.full_block_bytes}.get(form, 0)
    assert shard.stats["bytes"] == len(owned) * (public.block_bytes + sent)
    assert public.block_bytes < public.full_block_bytes
    assert all(len(agg.ciphertext) == public.full_block_bytes for agg in aggregates)
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - accepted) < TOLERANCE for s in sums.values())


# ---------------------------------------------------------------------- a ring that moves
#: The ring once shard-1 is declared gone: shard-0 owns every block.
WITHOUT_SHARD_1 = RingView(1, ("shard-0",))


def _reopen_on_the_new_ring(shard: Shard, keys: SecretContext, updates: Updates) -> None:
    """Round 1 opened again, the same cohort and commitments, on ring version 1."""
    members = updates.members(COHORT)
    shard.open_round(1, 1, members, keys.public.context_id, ring=WITHOUT_SHARD_1)


def test_a_newer_ring_reopens_the_closed_round_and_takes_the_moved_blocks(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    # Prepare: a and b pushed this shard's blocks and the round closed; shard-1 is then gone
    pushes = {client: updates.signed(client) for client in ("a", "b")}
    for push in pushes.values():
        shard.push(push(owned))
    assert shard.close_round(1) == ["a", "b"]
    moved = [b for b in range(NUM_BLOCKS) if b not in owned]

    # Execute: the round reopens on the new ring; a pushes its moved blocks, b does not
    _reopen_on_the_new_ring(shard, keys, updates)
    taken = shard.push(pushes["a"](moved))
    retried = shard.push(pushes["a"](owned))  # what it pushed before: duplicates

    # Assert: the sums were kept, the moved blocks are this shard's now, and only a, which
    # pushed every block it owns now, is complete
    assert shard.model.ring_view == WITHOUT_SHARD_1
    assert shard.update_blocks == list(range(NUM_BLOCKS))
    assert taken == (len(moved), 0) and retried == (0, len(owned))
    assert shard.close_round(1) == ["a"]
    aggregates, _ = shard.aggregates(1, ["a"])
    sums = _decrypted_sums(aggregates, keys)
    assert sorted(sums) == list(range(NUM_BLOCKS))
    assert all(abs(v - 1.0) < TOLERANCE for v in sums.values())  # a's alone, once


def test_an_older_ring_or_one_without_this_shard_changes_nothing(
    shard: Shard, keys: SecretContext, owned: list[int], updates: Updates
) -> None:
    # Prepare
    members = updates.members(COHORT)
    context_id = keys.public.context_id
    _reopen_on_the_new_ring(shard, keys, updates)

    # Execute: the configured ring again (older), then a ring that removed this shard
    shard.open_round(1, 1, members, context_id, ring=RingView(0, ("shard-0", "shard-1")))
    with pytest.raises(InvalidArgumentError, match="removed"):
        shard.open_round(1, 1, members, context_id, ring=RingView(2, ("shard-1",)))

    # Assert
    assert shard.model.ring_view == WITHOUT_SHARD_1


def test_a_restarted_shard_follows_the_ring_its_log_holds(durable: Durable) -> None:
    owned, keys, updates = durable.owned, durable.keys, durable.updates
    # Prepare: round 1 reopened on ring version 1 and a's moved block pushed, then a crash
    first = durable.start()
    _publish_and_open(first, owned, keys, updates)
    _reopen_on_the_new_ring(first, keys, updates)
    moved = [b for b in range(NUM_BLOCKS) if b not in owned]
    push_a = updates.signed("a")
    first.push(push_a(moved))
    del first

    # Execute
    second = durable.start()

    # Assert: the ring, and the moved block's sum, survived
    assert second.model.ring_view == WITHOUT_SHARD_1
    assert second.push(push_a(moved)) == (0, len(moved))


def test_a_publish_for_a_newer_ring_carries_the_moved_blocks(
    ring: HashRing, lookup: Lookup
) -> None:
    # Prepare
    shard = Shard(SHARD, ring, lookup)
    every_block = {b: np.full(N, float(b)) for b in range(NUM_BLOCKS)}

    # Execute: the key holder publishes version 1 on ring version 1
    count = shard.model.publish(1, NUM_BLOCKS, N, every_block, ring=WITHOUT_SHARD_1)

    # Assert: every block is this shard's to serve
    assert count == NUM_BLOCKS
    assert sorted(shard.model.pull(1)[1]) == list(range(NUM_BLOCKS))
