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

from crypto import bitpack
from crypto.canary import canary_bound
from crypto.ckks_encoder import CkksEncoder
from crypto.params import TAIL_SIGMAS
from crypto.quantized_packing import QuantizedPacking
from fedps.errors import PolicyError
from server.keyholder.aggregate_verifier import TamperingError
from tests.round_driver import HandClient
from tests.security.arena import PARAMS, VERSION, Arena, open_arena
from tests.security.sketch_forgery import isolating_aggregate
from tests.security.test_key_material import BLOCK, SHIFT, _change, _malicious, _secret

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
    arena.tamper(1, lambda a: replace(a, ciphertext=victim.sent[a.block]))

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


def _probe(arena: Arena, mallory: HandClient, coefficient: int, secret_weight: float) -> None:
    """Mallory's block 1 becomes a noiseless ``(m + delta X^j, D X^SHIFT)``, committed honestly.

    Decrypted, coefficient ``j`` of the round's sum is off its integer by ``delta + D s_(j-SHIFT)``
    plus the others' error: ``D`` stays below the canaries' bound (every canary passes) and
    ``delta`` puts the residual past the off-grid bound exactly when ``s_(j-SHIFT) = 1``.
    """
    params, q = arena.public.params, arena.public.modulus
    canary = canary_bound(params, secret_weight)
    change = int(canary * (1 - 6.5 / TAIL_SIGMAS))  # 6.5 sigmas of the canaries' own noise
    grid = params.error_bound(secret_weight) * params.scale  # the off-grid bound, coefficients
    arena.driver.encrypt(mallory, 0)  # block 0 stays honest
    values = mallory.update.reshape(-1, params.values_per_block)[BLOCK].copy()
    values[params.value_positions.index(coefficient)] += (grid - change / 2) / params.scale
    c0 = CkksEncoder(params, q).encode(values[None, :])[0]
    t = _change(arena, "monomial", change)
    c1 = np.array([int(v) % q for v in t], dtype=np.uint64)
    mallory.coefficients = mallory.coefficients.copy()
    mallory.coefficients[BLOCK] = np.concatenate([c0, c1])
    mallory.packed = dict(mallory.packed)
    rows = mallory.coefficients[BLOCK : BLOCK + 1]
    mallory.packed[BLOCK] = bitpack.pack_rows(rows, arena.public.coeff_bits)[0]
    mallory.signed_round = -1


def test_the_off_grid_refusal_reads_one_key_at_most_once(arena: Arena) -> None:
    """The off-grid check's accept/refuse decision depends on the secret key.

    A client alone (no shard) offsets one coefficient of its own plaintext and adds a change
    to ``c1`` below the canaries' bound: whether the round is refused then says whether one
    chosen coefficient of ``s`` is 1, and nobody is blamed, so it may ask every round. The
    decision cannot be made independent of ``s`` (telling the client apart would mean
    decrypting its update alone), so a refusal must end the key: under one key the decisions
    are then a run of accepted rounds and at most one refusal, a few bits of a key that is
    never used again, instead of one chosen coefficient of ``s`` per round.
    """
    # Prepare: probe a coefficient of s that is 1 (refused), 1 again, 0, 1, 0 and -1
    plan = [1, 1, 0, 1, 0, -1]
    outcomes: list[tuple[str, bool, bool]] = []
    for round_, wanted in enumerate(plan, start=1):
        kh = arena.keyholder
        arena.driver.public = kh.keys.public  # after a rotation, the new context
        version, context = kh.version, kh.context_id
        clients, _ = _quantized_clients(arena, ["client-0", "client-1", "mallory"], at=version)
        secret = _secret(arena)
        params = arena.public.params
        coefficient = next(
            j for j in params.value_positions[::-1] if j >= SHIFT and secret[j - SHIFT] == wanted
        )
        _probe(arena, clients[-1], coefficient, 3.0)

        # Execute
        arena.driver.committed_round(round_, version, clients)
        try:
            arena.driver.apply(round_, version, clients)
            refused = False
        except PolicyError as exc:
            assert "farther from an integer" in str(exc)
            refused = True
        outcomes.append((context, wanted == 1, refused))

    # Assert: the decision is s's (every probe, or all but one: the others' error is random),
    # nobody is blamed, and no key answers a probe after it refused one
    assert sum(w == r for _, w, r in outcomes) >= len(plan) - 1, outcomes
    assert arena.keyholder.blamed == {} and arena.keyholder.detections == {}
    refusals_per_key: dict[str, int] = {}
    for context, _, refused in outcomes:
        assert refusals_per_key.get(context, 0) == 0, "a key answered after a refusal"
        refusals_per_key[context] = refusals_per_key.get(context, 0) + refused


def test_a_shard_with_a_colluding_client_cannot_isolate_one_client(arena: Arena) -> None:
    """The shard that owns block 1 hands over victim + mallory, leaving out client-1.

    Mallory, a cohort client, gives the shard the round's challenge. The shard sees every
    push, so it knows client-1's sketch ``<r, c_1>`` too, and adds to ``c_victim + c_mallory``
    a correction ``Y`` in ``c0`` at the value positions, entries in {-1, 0, 1} (far below the
    decryption error, so rounding erases it), with ``<r, Y> = <r, c_1>``: the aggregate's sketch
    is then the sum of all three committed sketches, the manifest names all three, and the
    canaries see two fresh ciphertexts. Without the blinding pads (crypto/blinding.py) the
    round was released, and mallory read the victim's quantized update off it exactly; with
    them, client-1's pad stays in the sum and the round is refused.
    """
    # Prepare: an honest round, then the shard's substitute for block 1
    packing = _packing(arena)
    clients, quantized = _quantized_clients(arena, ["client-0", "client-1", "mallory"])
    victim, left_out, mallory = clients
    arena.driver.committed_round(1, VERSION, clients)
    challenge = arena.driver.challenge(1, mallory)  # what the colluder hands its shard
    substitute = isolating_aggregate(challenge, arena.public, BLOCK, [victim, mallory], left_out)
    packed = bitpack.pack_rows(substitute, arena.public.coeff_bits)[0]
    arena.tamper(BLOCK, lambda a: replace(a, ciphertext=packed))

    # Execute
    try:
        arena.driver.apply(1, VERSION, clients)
    except PolicyError as refused:
        # the forgery passes every check of the aggregate: the pads leave it unreadable
        assert not isinstance(refused, TamperingError), refused
        return

    # Assert: what was released is not the victim's update with mallory's own
    params_now = arena.keyholder.params
    assert params_now is not None
    start = BLOCK * packing.values_per_block
    sums = np.rint((params_now[start:] * 3 + 3 * packing.max_abs_value) / packing.step)
    read = sums.astype(np.int64) - quantized[2][start:]
    assert not np.array_equal(read, quantized[0][start:]), "the victim's update was released"
