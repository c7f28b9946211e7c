"""Tests for clients.pusher.moved_push: the blocks of a gone shard, cut again for the new ring."""

from __future__ import annotations

from clients.pusher import moved_push
from clients.update_pipeline import PreparedPush, push_messages
from crypto.signed_update import SignedUpdate
from fedps.sharding.hash_ring import HashRing

BLOCKS = 64
RING = HashRing(["shard-0", "shard-1", "shard-2"])
UPDATE = SignedUpdate(
    "client-0", 1.0, b"n" * 16, b"s" * 64, tuple(b"r" * 32 for _ in range(BLOCKS)), 3
)


def _prepared(ring: HashRing) -> PreparedPush:
    """Round 5's update, every block (its ciphertext: its index), pushed on ``ring``."""
    by_shard: dict[str, list[tuple[int, bytes]]] = {}
    for block in range(BLOCKS):
        by_shard.setdefault(ring.owner(block), []).append((block, block.to_bytes(2, "big")))
    return PreparedPush(5, 3, push_messages(UPDATE, 5, "ctx", by_shard))


def test_the_gone_shards_blocks_go_to_their_new_owners_under_the_same_commitment() -> None:
    # Prepare
    prepared = _prepared(RING)
    after = RING.remove("shard-1")

    # Execute
    moved = moved_push(prepared, after)
    unchanged = moved_push(prepared, RING)

    # Assert: exactly shard-1's blocks, each to its owner on the new ring, the same bytes,
    # every stream opened by the signed commitment
    assert unchanged is None and moved is not None
    sent = {
        block: (sid, data)
        for sid, messages in moved.messages.items()
        for message in messages
        for block, data in message.blocks
    }
    assert sorted(sent) == [b for b in range(BLOCKS) if RING.owner(b) == "shard-1"]
    assert all(
        sid == after.owner(b) and data == b.to_bytes(2, "big") for b, (sid, data) in sent.items()
    )
    assert all(m[0].update == UPDATE and m[0].round == 5 for m in moved.messages.values())
    assert (moved.round, moved.version) == (5, 3)


def test_the_blocks_a_joined_shard_takes_go_to_it_and_nothing_else_moves() -> None:
    # Prepare: an update cut for three shards; shard-3 joins before it is pushed
    prepared = _prepared(RING)
    after = RING.add("shard-3")

    # Execute
    moved = moved_push(prepared, after)

    # Assert: exactly the blocks shard-3 owns now, all to it, under the same commitment
    assert moved is not None and set(moved.messages) == {"shard-3"}
    sent = sorted(b for m in moved.messages["shard-3"] for b, _ in m.blocks)
    assert sent == after.assignment(BLOCKS)["shard-3"] and sent
    assert moved.messages["shard-3"][0].update == UPDATE
