"""Tests for the collective key generation as the parties run it: one key nobody holds."""

from __future__ import annotations

import itertools
import stat
from pathlib import Path

import numpy as np
import pytest

from crypto import BlockEncryptor, CiphertextSum, PublicContext, unpack_block
from crypto import threshold as th
from crypto.ckks_encoder import CkksEncoder
from fedps.errors import InvalidArgumentError, NotReadyError
from server.keyholder.party_key_generation import (
    PUBLIC_CONTEXT_FILE,
    SHARE_FILE,
    PartyKeyGeneration,
)
from tests.crypto.threshold_keys import PARAMS, N

SEED = b"the parties' common seed"


def _generations(parties: int, threshold: int) -> dict[int, PartyKeyGeneration]:
    generations = {
        j: PartyKeyGeneration(j, parties=parties, threshold=threshold, params=PARAMS, seed=SEED)
        for j in range(1, parties + 1)
    }
    for generation in generations.values():
        generation.start()
    for sender, source in generations.items():  # every commitment before any deal
        for target in generations.values():
            target.commit(sender, source.commitment)
    return generations


def _exchange(generations: dict[int, PartyKeyGeneration]) -> None:
    """Every party's public share and deal to every other, as their channels carry them."""
    for (sender, source), (receiver, target) in itertools.permutations(generations.items(), 2):
        target.receive(sender, public_share=source.public_share, dealt=source.dealt_to(receiver))


def test_every_party_ends_with_its_share_and_the_same_public_context(tmp_path: Path) -> None:
    # Prepare
    generations = _generations(3, 2)
    _exchange(generations)
    # Execute
    results = {j: g.finish(tmp_path / f"party-{j}") for j, g in generations.items()}
    # Assert: one context id everywhere, shares 0600, and any two decrypt what clients encrypt
    ids = {public.context_id for _, public in results.values()}
    assert len(ids) == 1
    for j in results:
        assert stat.S_IMODE((tmp_path / f"party-{j}" / SHARE_FILE).stat().st_mode) == 0o600
    public = PublicContext.from_bytes((tmp_path / "party-1" / PUBLIC_CONTEXT_FILE).read_bytes())
    values = np.random.default_rng(3).uniform(-1, 1, (4, PARAMS.values_per_block))
    total = CiphertextSum(public)
    encryptor = BlockEncryptor(public)
    for update in values:
        total.add(unpack_block(public, encryptor.encrypt_block(update)))
    rows = total.coefficients[None]
    sigma = th.flooding_std(PARAMS, 4, parties=3, lambda_bits=16)
    for participants in ([1, 2], [2, 3]):
        partials = [
            th.partial_decryption(
                results[j][0], rows[:, N:], participants=participants, sigma=sigma
            )
            for j in participants
        ]
        plain = CkksEncoder(PARAMS, public.modulus).decode(
            th.combine(rows[:, :N], partials, public.modulus)
        )
        assert np.abs(plain[0] - values.sum(axis=0)).max() < 14 * 1.5 * sigma / PARAMS.scale


def test_a_party_finishes_only_with_every_deal_once(tmp_path: Path) -> None:
    # Prepare
    generations = _generations(3, 3)
    first, second = generations[1], generations[2]
    # Execute / Assert: one deal missing, a second deal from one party, a stranger
    first.receive(2, public_share=second.public_share, dealt=second.dealt_to(1))
    with pytest.raises(NotReadyError, match=r"deals of parties \[3\]"):
        first.finish(tmp_path)
    with pytest.raises(InvalidArgumentError, match="unexpected deal from party 2"):
        first.receive(2, public_share=second.public_share, dealt=second.dealt_to(1))
    with pytest.raises(InvalidArgumentError, match="unexpected deal from party 4"):
        first.receive(4, public_share=second.public_share, dealt=second.dealt_to(1))
    unstarted = PartyKeyGeneration(1, parties=3, threshold=2, params=PARAMS, seed=SEED)
    with pytest.raises(NotReadyError):
        unstarted.dealt_to(2)
