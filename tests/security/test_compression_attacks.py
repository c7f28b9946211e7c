"""Shared random-k sparsification against the key holder's and the shards' checks.

Real key holder and shards on loopback, driven by hand (:class:`tests.round_driver.RoundDriver`):
a compressed round applies exactly the average of the coordinates its mask picked, a
commitment or push under another mask (or uncompressed) is refused, and a tampered block of a
compressed round is still caught before anything is decrypted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedps.errors import FedPSError, InvalidArgumentError
from fedps.sharding.sparse_mask import SparseMask
from tests.round_driver import HandClient
from tests.security.arena import PARAMS, VERSION, Arena, open_arena

pytestmark = [pytest.mark.attack, pytest.mark.integration]

DENSITY = 0.5  # two of the three blocks


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    arena = open_arena(tmp_path, "sync", compression={"density": DENSITY})
    yield arena
    arena.cluster.stop()


def _masked_clients(
    arena: Arena, round_: int, names: list[str]
) -> tuple[list[HandClient], list[np.ndarray], SparseMask]:
    """Clients whose round-``round_`` commit phase is open, each with a whole update and the
    coordinates of it the round's mask picks (their packed update)."""
    clients = [HandClient(n, arena.rng.uniform(-0.3, 0.3, PARAMS), version=VERSION) for n in names]
    arena.driver.open_commits(round_, VERSION, clients)
    mask = arena.keyholder.mask(round_)
    assert mask is not None
    whole = [c.update for c in clients]
    for client in clients:
        client.update, client.mask = mask.gather(client.update), mask.root
    return clients, whole, mask


def test_a_compressed_round_applies_exactly_the_selected_coordinates(arena: Arena) -> None:
    # Prepare
    clients, whole, mask = _masked_clients(arena, 1, ["client-0", "client-1", "client-2"])
    assert mask.sent_blocks == 2 and mask.size == 2 * arena.public.params.values_per_block

    # Execute
    arena.driver.committed_round(1, VERSION, clients)
    arena.driver.apply(1, VERSION, clients)

    # Assert: the average of the selected coordinates, and every other coordinate unchanged
    applied = arena.keyholder.params
    assert applied is not None
    chosen = np.zeros(PARAMS, dtype=bool)
    chosen[mask.indices()] = True
    assert not applied[~chosen].any()
    expected = np.mean(whole, axis=0)
    np.testing.assert_allclose(applied[chosen], expected[chosen], atol=1e-4)


def test_a_commitment_or_push_under_another_mask_is_refused(arena: Arena) -> None:
    # Prepare: two honest clients, one under a mask of its own choosing, one uncompressed
    honest = ["client-0", "client-1"]
    clients, _, mask = _masked_clients(arena, 1, [*honest, "client-2", "client-3"])
    other, whole = clients[2], clients[3]
    other.mask = os.urandom(32)
    whole.update, whole.mask = arena.rng.uniform(-0.3, 0.3, PARAMS), b""

    # Execute / Assert: the key holder refuses both commitments
    with pytest.raises(InvalidArgumentError, match="another mask"):
        arena.driver.commit(1, other)
    with pytest.raises(InvalidArgumentError, match="mask"):
        arena.driver.commit(1, whole)
    for client in clients[:2]:
        arena.driver.commit(1, client)
    commits = arena.driver.freeze(1)
    assert sorted(commits.client_ids) == honest
    arena.driver.open_shards(1, VERSION, clients, commits)
    # and the shards refuse their pushes
    for bad in (other, whole):
        with pytest.raises(FedPSError):
            arena.driver.push(1, bad)
    for client in clients[:2]:
        arena.driver.push(1, client)
    arena.driver.close(1)
    reply = arena.driver.apply(1, VERSION, clients[:2])
    assert reply.version == VERSION + 1 and mask.sent_blocks == 2


def test_a_tampered_block_of_a_compressed_round_is_refused(arena: Arena) -> None:
    # Prepare: the owner of block 1 hands over one client's ciphertext as the aggregate
    clients, _, _ = _masked_clients(arena, 1, ["client-0", "client-1", "client-2"])
    arena.driver.committed_round(1, VERSION, clients)
    victim = clients[0]
    arena.tamper(1, lambda a: replace(a, ciphertext=victim.packed[a.block]))

    # Execute / Assert: refused, nothing decrypted
    arena.assert_refused(1, clients)
    # and an honest compressed round still applies
    honest, _, _ = _masked_clients(arena, 2, ["client-0", "client-1", "client-2"])
    arena.driver.committed_round(2, VERSION, honest)
    assert arena.driver.apply(2, VERSION, honest).version == VERSION + 1


def test_the_mask_is_fresh_every_round_and_from_the_key_holders_secret(arena: Arena) -> None:
    # Prepare / Execute: two rounds opened with the same cohort
    clients = arena.clients()
    masks = []
    for round_ in (1, 2):
        arena.driver.open_commits(round_, VERSION, clients)
        mask = arena.keyholder.mask(round_)
        assert mask is not None
        masks.append(mask)

    # Assert: other seeds, other coordinates, and the seed is the one the cohort derives from
    # the round's challenge (an HMAC under the key holder's secret)
    first, second = masks
    assert first.seed != second.seed
    assert not np.array_equal(first.indices(), second.indices())
    challenge = arena.driver.challenge(1, clients[0])
    assert arena.keyholder.commits.seed(1) == challenge.seed
    assert first.seed == arena.keyholder.commits.mask_seed(1)
