"""No decryption releases key material: ``c1`` changes by a client alone, or by a shard with
one colluding client, against real servers (sync and async).

A client pushes ``(c0, c1 + t)`` and commits to exactly those bytes, so every commitment check
passes; decrypted and released, the round would carry ``t * s``. With ``t = D * X^k`` the
published model then hands out the secret key ``s`` coefficient by coefficient: the control
test switches the canary check off and recovers the key from the published model, which is
what the attack did before the canaries. With the check on, every change is refused before
anything is decrypted, and the key-recovery routine, run on every published model, recovers
nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from crypto import SecretContext, bitpack, unpack_block
from crypto.params import CANARIES
from fedps.errors import PolicyError
from fedps.learning.staleness import multiplier
from fedps.rpc.messages import Aggregate
from tests.round_driver import HandClient
from tests.security.arena import VERSION, Arena

pytestmark = [pytest.mark.attack, pytest.mark.integration]

BLOCK = 1  # the attacked block (of three)
SHIFT = 5  # t = D * X^SHIFT


def _secret(arena: Arena) -> np.ndarray:
    """The key holder's secret key in coefficient form, centred (to judge a recovery)."""
    keys = arena.keyholder.keys
    assert isinstance(keys, SecretContext)
    raw = keys._from_ntt(keys._plain_coefficients(keys._secret_key.data())).astype(np.int64)
    q = keys.public.modulus
    out: np.ndarray = np.where(raw > q // 2, raw - q, raw)
    return out


def _change(arena: Arena, kind: str, delta: float) -> np.ndarray:
    """A change ``t`` to one block's ``c1`` (N coefficients, integers mod q)."""
    n, q = arena.public.params.poly_modulus_degree, arena.public.modulus
    t = np.zeros(n, dtype=object)
    if kind == "monomial":
        t[SHIFT] = int(delta)
    elif kind == "sparse":  # a few random large terms
        for k in arena.rng.choice(n, 6, replace=False):
            t[int(k)] = int(arena.rng.integers(1, q))
    elif kind == "dense":  # c1 replaced by garbage: a random ciphertext, honestly committed
        t[:] = [int(v) for v in arena.rng.integers(0, q, n, dtype=np.uint64)]
    elif kind == "canary-aimed":  # two terms N/K apart: they meet on every canary
        t[0], t[n // CANARIES] = int(delta), -int(delta)
    return t


def _apply_change(arena: Arena, row: np.ndarray, t: np.ndarray) -> np.ndarray:
    n, q = arena.public.params.poly_modulus_degree, arena.public.modulus
    out = row.copy()
    c1 = (np.array([int(v) for v in row[n:]], dtype=object) + t) % q
    out[n:] = np.array([int(v) for v in c1], dtype=np.uint64)
    return out


def _malicious(arena: Arena, client: HandClient, t: np.ndarray) -> None:
    """The client's own ciphertext of BLOCK carries ``t``; it commits to those bytes."""
    arena.driver.encrypt(client, 0)  # encrypts honestly; the round signs again below
    client.coefficients = client.coefficients.copy()
    client.coefficients[BLOCK] = _apply_change(arena, client.coefficients[BLOCK], t)
    bits = arena.public.coeff_bits
    client.packed = dict(client.packed)
    client.packed[BLOCK] = bitpack.pack_rows(client.coefficients[BLOCK : BLOCK + 1], bits)[0]
    client.signed_round = -1


def _recovered(
    arena: Arena, before: np.ndarray, clients: list[HandClient], delta: float, multiplier: float
) -> float:
    """The key-recovery routine on a published model: the share of the coefficients of ``s``
    that ``t = delta * X^SHIFT``, pushed with staleness ``multiplier``, gives back (about 1/3
    by chance, 1.0 for a leak)."""
    kh = arena.keyholder
    assert kh.params is not None
    result = kh._released[kh.last_round]
    weights = result.contributors
    total = sum(weights.values())
    honest = sum(weights[c.client_id] * c.update for c in clients if c.client_id in weights)
    layout = kh.layout
    residual = layout.block_of(kh.params - before - honest / total, BLOCK)
    params = arena.public.params
    n = params.poly_modulus_degree
    estimate = np.rint(residual * total * params.scale / (multiplier * delta)).clip(-1, 1)
    secret = _secret(arena)
    positions = np.array(params.value_positions)
    sign = np.where(positions >= SHIFT, 1, -1)
    truth = sign * secret[(positions - SHIFT) % n]
    return float(np.mean(estimate == truth))


def _multiplier(arena: Arena, client: HandClient) -> float:
    """The staleness multiplier of ``client``'s update (1 in sync rounds)."""
    staleness = arena.keyholder.settings.staleness
    if staleness is None:
        return 1.0
    return float(multiplier(staleness, arena.keyholder.version - client.version))


@pytest.mark.parametrize(
    ("kind", "exponents"),
    [
        ("monomial", [-20, -16, -12, -8, -4, 0, 4]),  # D = 2^e x scale
        ("sparse", [0]),
        ("dense", [0]),
        ("canary-aimed", [-8, 0]),
    ],
)
def test_a_client_alone_cannot_release_key_material(
    arena: Arena,
    kind: str,
    exponents: list[int],
) -> None:
    for i, exponent in enumerate(exponents):
        # Prepare: a new attacker changes c1 of its own ciphertext and commits to it honestly
        round_, version = i + 1, arena.keyholder.version
        clients = arena.clients(["client-0", "client-1", f"mallory-{i}"], at=version)
        mallory = clients[-1]
        delta = 2.0**exponent * arena.public.params.scale
        _malicious(arena, mallory, _change(arena, kind, delta))
        before = arena.keyholder.params
        assert before is not None
        # Execute
        arena.driver.committed_round(round_, version, clients)
        arena.driver.apply(round_, version, clients)
        # Assert: the attacker is blamed on its own canaries and excluded; the others' sum is
        # applied (one decryption a round), and the published model gives nothing away
        assert "carries key material" in arena.keyholder.blamed[mallory.client_id]
        result = arena.keyholder._released[round_]
        assert set(result.contributors) == {"client-0", "client-1"}
        assert len(arena.decryptions) == round_
        assert arena.keyholder.detections == {}
        assert _recovered(arena, before, clients, delta, _multiplier(arena, mallory)) < 0.5
    # ... and a blamed client takes part in nothing any more
    with pytest.raises(PolicyError, match="excluded"):
        arena.driver.open_commits(99, arena.keyholder.version, clients)
        arena.driver.commit(99, clients[-1])


def test_a_shard_with_a_colluding_client_cannot_release_key_material(arena: Arena) -> None:
    # Prepare: the client pushes honest bytes but commits sketches of c + t; its shard adds
    # t to the aggregate, so the aggregate matches every commitment.
    clients = arena.clients()
    colluder = clients[-1]
    t = _change(arena, "monomial", 2.0**-4 * arena.public.params.scale)
    arena.driver.encrypt(colluder, 1)
    changed = colluder.coefficients.copy()
    changed[BLOCK] = _apply_change(arena, changed[BLOCK], t)

    def add_t(a: Aggregate) -> Aggregate:
        coeffs = unpack_block(arena.public, a.ciphertext)
        row = _apply_change(arena, coeffs, t)
        packed = bitpack.pack_rows(row[None, :], arena.public.coeff_bits)[0]
        return Aggregate(a.block, packed, a.contributions)

    arena.tamper(BLOCK, add_t)
    driver = arena.driver
    driver.open_commits(1, VERSION, clients)
    for client in clients:
        driver.commit(1, client, sketch_of=changed if client is colluder else None)
    commits = driver.freeze(1)
    driver.open_shards(1, VERSION, clients, commits)
    for client in clients:
        driver.push(1, client)
    driver.close(1)
    # Execute / Assert: refused, nothing decrypted, and a guilty party blamed, never an honest
    # one: the shard, when the openings of the block show that its aggregate is not the
    # contributors' sum (sync), or the colluder, when its sketch (weighted by its staleness)
    # fails and the shard shows its ciphertext does not match it (async)
    arena.assert_refused(1, clients)
    shard = arena.owner(BLOCK).shard_id
    blamed = set(arena.keyholder.blamed) | set(arena.keyholder.detections)
    assert blamed in ({shard}, {colluder.client_id}), blamed
    assert arena.keyholder.detections in ({}, {shard: {"aggregate": 1}})


def test_control_without_the_canary_check_the_published_model_gives_the_key_away(
    arena: Arena,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The attack as it worked before the canaries: the check switched off, one round of
    ``t = scale/4 * X^5`` publishes a model from which the routine recovers the key. (This
    is what makes the tests above able to fail.)"""
    # Prepare
    monkeypatch.setattr("crypto.secret_context.canary_bound", lambda *_a, **_k: float("inf"))
    clients = arena.clients()
    delta = arena.public.params.scale / 4
    _malicious(arena, clients[-1], _change(arena, "monomial", delta))
    before = arena.keyholder.params
    assert before is not None
    # Execute
    arena.driver.committed_round(1, VERSION, clients)
    arena.driver.apply(1, VERSION, clients)
    # Assert: nearly every coefficient of s comes back
    assert _recovered(arena, before, clients, delta, _multiplier(arena, clients[-1])) > 0.99


def test_a_change_below_the_noise_passes_and_recovers_nothing(arena: Arena) -> None:
    """The smallest change that passes the canaries for sure is buried in the released
    noise: the routine recovers no more than chance."""
    # Prepare: t = b/8 * X^5, far below the canary bound b of one round
    from crypto.canary import canary_bound

    clients = arena.clients()
    delta = float(int(canary_bound(arena.public.params, 1.0) / 8))
    _malicious(arena, clients[-1], _change(arena, "monomial", delta))
    before = arena.keyholder.params
    assert before is not None
    # Execute
    arena.driver.committed_round(1, VERSION, clients)
    arena.driver.apply(1, VERSION, clients)
    # Assert: the round applied, and what it published says nothing about s
    assert arena.keyholder.params is not before
    assert _recovered(arena, before, clients, delta, _multiplier(arena, clients[-1])) < 0.5
