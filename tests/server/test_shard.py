"""Tests for server.shard.Shard, the shard's rules without gRPC, on real CKKS ciphertexts.

Each client's update holds one constant per client (1, 2, 4, ...) times ``block + 1``, so the
decrypted sum of a block tells exactly which clients were counted, and how many times.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from crypto import BlockEncryptor, CkksParams, PublicContext, SecretContext, bitpack, unpack_block
from fedps.errors import InvalidArgumentError, NotReadyError, RoundClosedError, UnknownClientError
from fedps.hash_ring import HashRing
from server.shard import Aggregate, PushBatch, Shard

N = 2048
NUM_BLOCKS = 4
SHARD = "shard-0"
TOLERANCE = 1e-3  # a few ciphertexts summed: well above the ~4e-5 error of each
CLIENT_VALUE = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 8.0, "e": 16.0, "f": 32.0}
COHORT = ["a", "b", "c"]


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
def lookup(keys: SecretContext) -> Callable[[str], PublicContext]:
    def public_context(context_id: str) -> PublicContext:
        if context_id != keys.public.context_id:
            raise InvalidArgumentError(f"unknown context id {context_id[:12]}")
        return keys.public

    return public_context


@pytest.fixture(scope="module")
def ciphertexts(keys: SecretContext) -> dict[str, dict[int, bytes]]:
    """Every client's encrypted update, every block (encrypted once per module)."""
    encryptor = BlockEncryptor(keys.public)
    return {
        client: {b: encryptor.encrypt_block(np.full(N, value * (b + 1))) for b in range(NUM_BLOCKS)}
        for client, value in CLIENT_VALUE.items()
    }


def _published(ring: HashRing, owned: list[int], lookup: Callable[[str], PublicContext]) -> Shard:
    shard = Shard(SHARD, ring, lookup)
    shard.publish(1, NUM_BLOCKS, N, {b: np.full(N, float(b)) for b in owned})
    return shard


@pytest.fixture
def shard(
    ring: HashRing,
    owned: list[int],
    lookup: Callable[[str], PublicContext],
    keys: SecretContext,
) -> Shard:
    """A shard at version 1 with round 1 open for clients a, b and c."""
    shard = _published(ring, owned, lookup)
    shard.open_round(1, 1, COHORT, keys.public.context_id)
    return shard


def _batch(
    client: str,
    blocks: list[tuple[int, bytes]],
    context_id: str,
    *,
    round_: int = 1,
    version: int = 1,
    weight: float = 1.0,
) -> PushBatch:
    return PushBatch(client, round_, version, weight, context_id, blocks)


def _push_all(
    shard: Shard,
    client: str,
    ciphertexts: dict[str, dict[int, bytes]],
    keys: SecretContext,
    owned: list[int],
    weight: float = 1.0,
) -> tuple[int, int]:
    blocks = [(b, ciphertexts[client][b]) for b in owned]
    return shard.push(_batch(client, blocks, keys.public.context_id, weight=weight))


def _decrypted_sums(aggregates: list[Aggregate], keys: SecretContext) -> dict[int, float]:
    """Each aggregate's decrypted block, divided by ``block + 1`` and checked constant."""
    out = {}
    for agg in aggregates:
        values = keys.decrypt(unpack_block(keys.public, agg.ciphertext)) / (agg.block + 1)
        assert np.ptp(values) < TOLERANCE
        out[agg.block] = float(np.mean(values))
    return out


# --------------------------------------------------------------------------- model blocks


def test_publish_then_pull(ring: HashRing, owned: list[int], lookup: Callable) -> None:
    # Prepare
    shard = Shard(SHARD, ring, lookup)
    values = {b: np.linspace(-1.0, 1.0, N) * (b + 1) for b in owned}

    # Execute
    count = shard.publish(3, NUM_BLOCKS, N, values)
    version, blocks = shard.pull(3)

    # Assert: every owned block, as float32 bytes.
    assert count == len(owned)
    assert version == 3
    assert shard.owned_blocks == owned
    assert sorted(blocks) == owned
    for b in owned:
        np.testing.assert_array_equal(
            np.frombuffer(blocks[b], dtype="<f4"), values[b].astype(np.float32)
        )
    assert shard.pull(1)[0] == 3  # an older minimum is served the newer version


def test_pull_before_publish_is_not_ready(ring: HashRing, lookup: Callable) -> None:
    # Prepare
    shard = Shard(SHARD, ring, lookup)

    # Execute / Assert
    with pytest.raises(NotReadyError):
        shard.pull(0)


def test_pull_of_future_version_is_refused(shard: Shard) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(RoundClosedError, match="version 1"):
        shard.pull(2)


@pytest.mark.parametrize("case", ["missing-block", "foreign-block", "bad-shape", "nan"])
def test_publish_rejects_malformed_blocks(
    ring: HashRing, owned: list[int], foreign_block: int, lookup: Callable, case: str
) -> None:
    # Prepare
    shard = _published(ring, owned, lookup)
    blocks = {b: np.zeros(N) for b in owned}
    if case == "missing-block":
        del blocks[owned[0]]
    elif case == "foreign-block":
        blocks[foreign_block] = np.zeros(N)
    elif case == "bad-shape":
        blocks[owned[0]] = np.zeros(N - 1)
    else:
        blocks[owned[0]][7] = np.nan

    # Execute / Assert: refused, and the published version 1 is untouched.
    with pytest.raises(InvalidArgumentError):
        shard.publish(2, NUM_BLOCKS, N, blocks)
    version, pulled = shard.pull(1)
    assert version == 1
    assert np.frombuffer(pulled[owned[0]], dtype="<f4")[0] == float(owned[0])


def test_publish_refuses_older_version(ring: HashRing, owned: list[int], lookup: Callable) -> None:
    # Prepare
    shard = _published(ring, owned, lookup)
    shard.publish(5, NUM_BLOCKS, N, {b: np.zeros(N) for b in owned})

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="older"):
        shard.publish(4, NUM_BLOCKS, N, {b: np.zeros(N) for b in owned})
    assert shard.version == 5


def test_shard_not_on_ring_is_refused(ring: HashRing, lookup: Callable) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(InvalidArgumentError, match="not on the ring"):
        Shard("shard-9", ring, lookup)


# --------------------------------------------------------------------------- rounds


def test_push_before_open_round_is_refused(
    ring: HashRing,
    owned: list[int],
    lookup: Callable,
    keys: SecretContext,
    ciphertexts: dict[str, dict[int, bytes]],
) -> None:
    # Prepare
    shard = _published(ring, owned, lookup)

    # Execute / Assert
    with pytest.raises(RoundClosedError, match="not open"):
        _push_all(shard, "a", ciphertexts, keys, owned)
    assert shard.stats["refused"] == 1
    assert not shard.round_is_open


def test_open_round_validation(shard: Shard, keys: SecretContext) -> None:
    # Prepare / Execute / Assert: an empty cohort, and a context id the key holder never made.
    with pytest.raises(InvalidArgumentError, match="cohort"):
        shard.open_round(2, 1, [], keys.public.context_id)
    with pytest.raises(InvalidArgumentError, match="context id"):
        shard.open_round(2, 1, COHORT, "0" * 64)
    assert shard.open_round_number == 1
    assert shard.round_is_open


def test_push_from_unknown_client_is_refused(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare: "d" is a real client with a real update, just not in this round's cohort.
    # Execute / Assert
    with pytest.raises(UnknownClientError, match="'d'"):
        _push_all(shard, "d", ciphertexts, keys, owned)
    assert shard.stats == {"accepted": 0, "duplicates": 0, "refused": 1, "bytes": 0}


def test_valid_pushes_sum_every_block(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare / Execute
    results = [
        _push_all(shard, c, ciphertexts, keys, owned, weight=w)
        for c, w in [("a", 1.5), ("b", 2.0), ("c", 30.0)]
    ]
    complete = shard.close_round(1)
    aggregates = shard.aggregates(1)

    # Assert
    assert results == [(len(owned), 0)] * 3
    assert complete == ["a", "b", "c"]
    assert [agg.block for agg in aggregates] == owned
    assert all(agg.contributions == {"a": 1.5, "b": 2.0, "c": 30.0} for agg in aggregates)
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 7.0) < TOLERANCE for s in sums.values())  # 1 + 2 + 4
    assert shard.stats["accepted"] == 3 * len(owned)
    assert shard.stats["bytes"] == 3 * len(owned) * keys.public.block_bytes


_BAD_PUSHES = [
    "wrong-version",
    "wrong-context-id",
    "non-owned-block",
    "short-ciphertext",
    "long-ciphertext",
    "coefficient-not-below-q",
    "block-twice",
    "no-blocks",
    "nan-weight",
    "inf-weight",
    "zero-weight",
    "negative-weight",
    "huge-weight",
]


@pytest.mark.parametrize("case", _BAD_PUSHES)
def test_invalid_push_is_refused_and_adds_nothing(
    shard: Shard,
    keys: SecretContext,
    owned: list[int],
    foreign_block: int,
    ciphertexts: dict[str, dict[int, bytes]],
    case: str,
) -> None:
    # Prepare: a bad message from "b" whose other blocks are all valid.
    blocks = [(b, ciphertexts["b"][b]) for b in owned]
    kwargs: dict[str, float | int] = {}
    context_id = keys.public.context_id
    if case == "wrong-version":
        kwargs["version"] = 2
    elif case == "wrong-context-id":
        context_id = "f" * 64
    elif case == "non-owned-block":
        blocks.append((foreign_block, ciphertexts["b"][foreign_block]))
    elif case == "short-ciphertext":
        blocks[-1] = (blocks[-1][0], blocks[-1][1][:-1])
    elif case == "long-ciphertext":
        blocks[-1] = (blocks[-1][0], blocks[-1][1] + b"\x00")
    elif case == "coefficient-not-below-q":
        coeffs = unpack_block(keys.public, blocks[-1][1])
        coeffs[5] = keys.public.modulus
        blocks[-1] = (blocks[-1][0], bitpack.pack(coeffs, keys.public.coeff_bits))
    elif case == "block-twice":
        blocks.append(blocks[0])
    elif case == "no-blocks":
        blocks = []
    else:
        kwargs["weight"] = {
            "nan-weight": float("nan"),
            "inf-weight": float("inf"),
            "zero-weight": 0.0,
            "negative-weight": -1.0,
            "huge-weight": 1e7,
        }[case]
    bad = _batch("b", blocks, context_id, **kwargs)  # type: ignore[arg-type]
    _push_all(shard, "a", ciphertexts, keys, owned)

    # Execute
    with pytest.raises(InvalidArgumentError):
        shard.push(bad)
    shard.close_round(1)
    aggregates = shard.aggregates(1)

    # Assert: only "a" is in the sums and the manifests.
    assert shard.stats["refused"] == 1
    assert shard.stats["accepted"] == len(owned)
    assert all(agg.contributions == {"a": 1.0} for agg in aggregates)
    sums = _decrypted_sums(aggregates, keys)
    assert sorted(sums) == owned
    assert all(abs(s - 1.0) < TOLERANCE for s in sums.values())


def test_refused_push_does_not_block_a_later_valid_one(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare: a bad weight first, then the same client's valid push.
    blocks = [(b, ciphertexts["b"][b]) for b in owned]
    with pytest.raises(InvalidArgumentError):
        shard.push(_batch("b", blocks, keys.public.context_id, weight=float("nan")))

    # Execute
    accepted = shard.push(_batch("b", blocks, keys.public.context_id, weight=3.0))
    shard.close_round(1)

    # Assert
    assert accepted == (len(owned), 0)
    sums = _decrypted_sums(shard.aggregates(1), keys)
    assert all(abs(s - 2.0) < TOLERANCE for s in sums.values())


def test_duplicate_push_is_counted_once(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    first = _push_all(shard, "c", ciphertexts, keys, owned, weight=2.0)

    # Execute: the retry carries a different weight; the first one stands.
    second = _push_all(shard, "c", ciphertexts, keys, owned, weight=9.0)
    shard.close_round(1)
    aggregates = shard.aggregates(1)

    # Assert
    assert first == (len(owned), 0)
    assert second == (0, len(owned))
    assert shard.stats["duplicates"] == len(owned)
    assert shard.stats["accepted"] == len(owned)
    assert all(agg.contributions == {"c": 2.0} for agg in aggregates)
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 4.0) < TOLERANCE for s in sums.values())  # once, not 8


def test_partly_duplicate_push_adds_only_new_blocks(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    context_id = keys.public.context_id
    shard.push(_batch("a", [(owned[0], ciphertexts["a"][owned[0]])], context_id))

    # Execute
    result = _push_all(shard, "a", ciphertexts, keys, owned)
    shard.close_round(1)

    # Assert
    assert result == (len(owned) - 1, 1)
    sums = _decrypted_sums(shard.aggregates(1), keys)
    assert all(abs(s - 1.0) < TOLERANCE for s in sums.values())


def test_close_round_returns_only_complete_clients(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare: "a" pushes every block in one message, "b" in one message per block,
    # "c" misses the last block.
    context_id = keys.public.context_id
    _push_all(shard, "a", ciphertexts, keys, owned)
    for b in owned:
        shard.push(_batch("b", [(b, ciphertexts["b"][b])], context_id))
    shard.push(_batch("c", [(b, ciphertexts["c"][b]) for b in owned[:-1]], context_id))

    # Execute
    complete = shard.close_round(1)

    # Assert
    assert complete == ["a", "b"]
    assert not shard.round_is_open
    manifests = {agg.block: set(agg.contributions) for agg in shard.aggregates(1)}
    assert manifests[owned[-1]] == {"a", "b"}
    assert manifests[owned[0]] == {"a", "b", "c"}


def test_push_after_close_is_refused(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    _push_all(shard, "a", ciphertexts, keys, owned)
    shard.close_round(1)

    # Execute / Assert
    with pytest.raises(RoundClosedError):
        _push_all(shard, "b", ciphertexts, keys, owned)
    assert all(agg.contributions == {"a": 1.0} for agg in shard.aggregates(1))


def test_push_to_other_round_is_refused(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    blocks = [(b, ciphertexts["a"][b]) for b in owned]

    # Execute / Assert
    with pytest.raises(RoundClosedError):
        shard.push(_batch("a", blocks, keys.public.context_id, round_=2))


def test_discard_round_drops_sums(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    _push_all(shard, "a", ciphertexts, keys, owned)
    _push_all(shard, "b", ciphertexts, keys, owned)

    # Execute
    shard.discard_round(1)

    # Assert
    assert shard.aggregates(1) == []
    with pytest.raises(RoundClosedError):
        _push_all(shard, "c", ciphertexts, keys, owned)


def test_aggregates_of_open_or_unknown_round_are_refused(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    _push_all(shard, "a", ciphertexts, keys, owned)

    # Execute / Assert
    with pytest.raises(RoundClosedError, match="still open"):
        shard.aggregates(1)
    with pytest.raises(RoundClosedError, match="unknown"):
        shard.aggregates(7)
    with pytest.raises(RoundClosedError, match="unknown"):
        shard.close_round(7)
    with pytest.raises(RoundClosedError, match="unknown"):
        shard.discard_round(7)


def test_one_sum_per_block_whatever_the_number_of_clients(
    ring: HashRing,
    owned: list[int],
    lookup: Callable,
    keys: SecretContext,
    ciphertexts: dict[str, dict[int, bytes]],
) -> None:
    # Prepare
    shard = _published(ring, owned, lookup)
    clients = sorted(CLIENT_VALUE)
    shard.open_round(1, 1, clients, keys.public.context_id)
    sizes = []

    # Execute
    for client in clients:
        _push_all(shard, client, ciphertexts, keys, owned)
        sizes.append(len(shard._rounds[1].sums))
    shard.close_round(1)
    aggregates = shard.aggregates(1)

    # Assert: one running sum (one block's worth of memory) per owned block.
    assert sizes == [len(owned)] * len(clients)
    assert len(aggregates) == len(owned)
    assert all(len(agg.ciphertext) == keys.public.block_bytes for agg in aggregates)
    assert all(set(agg.contributions) == set(clients) for agg in aggregates)
    sums = _decrypted_sums(aggregates, keys)
    assert all(abs(s - 63.0) < TOLERANCE for s in sums.values())  # 1 + 2 + ... + 32


def test_reopening_same_round_is_idempotent(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    _push_all(shard, "a", ciphertexts, keys, owned)

    # Execute
    shard.open_round(1, 1, reversed(COHORT), keys.public.context_id)
    shard.close_round(1)

    # Assert: the sums survived the repeated open.
    assert all(agg.contributions == {"a": 1.0} for agg in shard.aggregates(1))


def test_reopening_with_new_cohort_starts_afresh(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    _push_all(shard, "a", ciphertexts, keys, owned)

    # Execute
    shard.open_round(1, 1, ["a", "b"], keys.public.context_id)
    _push_all(shard, "b", ciphertexts, keys, owned)
    shard.close_round(1)

    # Assert
    assert all(agg.contributions == {"b": 1.0} for agg in shard.aggregates(1))


def test_opening_next_round_closes_the_previous_one(
    shard: Shard, keys: SecretContext, owned: list[int], ciphertexts: dict[str, dict[int, bytes]]
) -> None:
    # Prepare
    _push_all(shard, "a", ciphertexts, keys, owned)

    # Execute
    shard.open_round(2, 1, COHORT, keys.public.context_id)

    # Assert
    with pytest.raises(RoundClosedError):
        _push_all(shard, "b", ciphertexts, keys, owned)
    assert shard.open_round_number == 2
    assert [set(a.contributions) for a in shard.aggregates(1)] == [{"a"}] * len(owned)
