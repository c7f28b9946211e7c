"""Quantized packing against the key holder's and the shards' checks.

Real key holder and shards on loopback, driven by hand (:class:`tests.round_driver.RoundDriver`),
with ``compression.bits = 8``: an honest round applies exactly the dequantized average of what
its clients quantized; a tampered block is refused before anything is decrypted; a client that
changes ``c1`` of its own ciphertext is caught on its canaries and blamed; and a client that
encrypts a value off the grid of the lowest field (to read the decryption error from how the
key holder rounds) or past a field's headroom gets the round refused, with nothing released.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from crypto.quantized_packing import QuantizedPacking
from fedps.errors import PolicyError
from tests.round_driver import HandClient
from tests.security.arena import PARAMS, VERSION, Arena, open_arena
from tests.security.test_key_material import _change, _malicious

pytestmark = [pytest.mark.attack, pytest.mark.integration]


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    arena = open_arena(tmp_path, "sync", compression={"bits": 8})
    yield arena
    arena.cluster.stop()


def _packing(arena: Arena) -> QuantizedPacking:
    packing = arena.keyholder.settings.packing
    assert packing is not None
    return packing


def _quantized_clients(
    arena: Arena, names: list[str], *, at: int = VERSION
) -> tuple[list[HandClient], list[np.ndarray]]:
    """Clients whose updates are quantized and packed, with what each quantized."""
    packing = _packing(arena)
    clients = arena.clients(names, at=at)
    quantized = [packing.quantize(c.update, arena.rng) for c in clients]
    for client, values in zip(clients, quantized, strict=True):
        client.update = packing.pack(values)
    return clients, quantized


def _refused(arena: Arena, round_: int, clients: list[HandClient], match: str) -> None:
    """The round is refused (naming ``match``) and the model stays as it was."""
    before, version = arena.keyholder.params, arena.keyholder.version
    assert before is not None
    arena.driver.committed_round(round_, VERSION, clients)
    with pytest.raises(PolicyError, match=match):
        arena.driver.apply(round_, VERSION, clients)
    assert arena.keyholder.version == version
    assert arena.keyholder.params is before


def test_a_quantized_round_applies_exactly_the_dequantized_average(arena: Arena) -> None:
    # Prepare
    packing = _packing(arena)
    names = ["client-0", "client-1", "client-2"]
    clients, quantized = _quantized_clients(arena, names)
    assert arena.keyholder.commits.num_blocks == 2  # 5,000 values, 4,032 to a ciphertext

    # Execute
    arena.driver.committed_round(1, VERSION, clients)
    arena.driver.apply(1, VERSION, clients)

    # Assert: the exact sum of the integers, dequantized (the model started at zero)
    expected = packing.dequantize(np.sum(quantized, axis=0), 3) / 3
    applied = arena.keyholder.params
    assert applied is not None and applied.size == PARAMS
    np.testing.assert_allclose(applied, expected, rtol=0, atol=1e-12)
    assert len(arena.decryptions) == 1


def test_a_tampered_block_of_a_quantized_round_is_refused(arena: Arena) -> None:
    # Prepare: the owner of block 1 hands over one client's ciphertext as the aggregate
    clients, _ = _quantized_clients(arena, ["client-0", "client-1", "client-2"])
    arena.driver.committed_round(1, VERSION, clients)
    victim = clients[0]
    arena.tamper(1, lambda a: replace(a, ciphertext=victim.packed[a.block]))

    # Execute / Assert: refused, nothing decrypted
    arena.assert_refused(1, clients)


def test_a_client_that_changes_c1_in_a_quantized_round_is_blamed(arena: Arena) -> None:
    # Prepare: mallory adds t = scale * X^5 to c1 of its own block 1 and commits to it
    clients, quantized = _quantized_clients(arena, ["client-0", "client-1", "mallory"])
    mallory = clients[-1]
    _malicious(arena, mallory, _change(arena, "monomial", arena.public.params.scale))

    # Execute
    arena.driver.committed_round(1, VERSION, clients)
    arena.driver.apply(1, VERSION, clients)

    # Assert: caught on its canaries, blamed, and the others' exact sum applied
    assert "carries key material" in arena.keyholder.blamed["mallory"]
    packing = _packing(arena)
    expected = packing.dequantize(quantized[0] + quantized[1], 2) / 2
    applied = arena.keyholder.params
    assert applied is not None
    np.testing.assert_allclose(applied, expected, rtol=0, atol=1e-12)


def test_a_value_off_the_grid_gets_the_round_refused(arena: Arena) -> None:
    # Prepare: mallory shifts one coefficient by half a step of the lowest field, so that how
    # the sum rounds would tell the sign of the decryption error
    clients, _ = _quantized_clients(arena, ["client-0", "client-1", "mallory"])
    clients[-1].update = clients[-1].update + np.eye(1, clients[-1].update.size, 7)[0] * 0.5

    # Execute / Assert
    _refused(arena, 1, clients, "farther from an integer")


def test_a_field_past_its_headroom_gets_the_round_refused(arena: Arena) -> None:
    # Prepare: mallory's lowest field holds 1,000, more than three 8-bit values can sum to
    # (though not enough to carry into the next field, which would go unseen)
    clients, _ = _quantized_clients(arena, ["client-0", "client-1", "mallory"])
    update = clients[-1].update.copy()
    update[3] = float((int(update[3]) >> 15 << 15) + 1000)
    clients[-1].update = update

    # Execute / Assert
    _refused(arena, 1, clients, "overflowed")
