"""One key-holder party against the collective key generation: a rogue public share.

Party 3 of P = 3 (T = 2) is malicious. It lets the honest parties deal first, so that it
holds their public shares ``b_1`` and ``b_2``, then deals ``b_3 = b' - b_1 - b_2`` where
``b' = -a s' + e'`` is a key it drew itself. Every honest party would then compute the joint
public key ``b_1 + b_2 + b_3 = b'``: the same context at every party (the combiner's check
passes), whose secret ``s'`` the attacker alone holds, and it would decrypt any client's
update (it did, to 3e-8, before commitments came first). Now an honest party gives out
nothing of ``b_j`` before every party committed to its own public share, and refuses a deal
whose public share is not the committed one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crypto import BlockEncryptor, CiphertextSum, PublicContext, unpack_block
from crypto import threshold as th
from crypto.ckks_encoder import CkksEncoder
from fedps.errors import NotReadyError, PolicyError
from server.keyholder.party_key_generation import PartyKeyGeneration, generate_in_one_process
from tests.crypto.threshold_keys import PARAMS, N

pytestmark = [pytest.mark.attack]

SEED = b"the parties' common seed, public"


def _decrypt_with(secret: np.ndarray, public: PublicContext, block: bytes) -> np.ndarray:
    """What the holder of ``secret`` reads of one client's encrypted block."""
    total = CiphertextSum(public)
    total.add(unpack_block(public, block))
    rows = total.coefficients[None]
    q = public.modulus
    own = th.KeyShare(1, 1, 1, q, (secret % q).astype(np.uint64))
    partial = th.partial_decryption(own, rows[:, N:], participants=[1], sigma=0.0)
    decoded: np.ndarray = CkksEncoder(PARAMS, q).decode(th.combine(rows[:, :N], [partial], q))
    first: np.ndarray = decoded[0]
    return first


def test_a_party_that_deals_last_cannot_choose_the_joint_key(tmp_path: Path) -> None:
    # Prepare: the honest parties start; party 3 runs a generation of its own to commit with
    parties = {
        j: PartyKeyGeneration(j, parties=3, threshold=2, params=PARAMS, seed=SEED)
        for j in (1, 2, 3)
    }
    for generation in parties.values():
        generation.start()
    honest = {j: parties[j] for j in (1, 2)}
    for generation in honest.values():  # nothing of b_j before every commitment is in
        with pytest.raises(NotReadyError, match="commitments"):
            generation.dealt_to(3)
    for sender, source in parties.items():  # party 3 must commit before it sees b_1, b_2
        for target in honest.values():
            target.commit(sender, source.commitment)
    for sender, receiver in ((1, 2), (2, 1)):
        source = honest[sender]
        honest[receiver].receive(
            sender, public_share=source.public_share, dealt=source.dealt_to(receiver)
        )
    seen = {j: g.public_share for j, g in honest.items()}  # what their deals to party 3 carry
    q = honest[1].modulus
    common = th.common_polynomial(SEED, N, q)
    rogue = th.draw_party_key(common, q)
    b3 = (rogue.public_share + 2 * np.uint64(q) - seen[1] - seen[2]) % np.uint64(q)
    # Execute: party 3 deals its rogue share; the honest parties finish
    for generation in honest.values():
        generation.receive(3, public_share=b3, dealt=np.zeros(N, dtype=np.uint64))
    # Assert: no joint key is made of it, and nothing is written
    for j, generation in honest.items():
        with pytest.raises(PolicyError, match="party 3's public share is not the one it"):
            generation.finish(tmp_path / f"party-{j}")
        assert not (tmp_path / f"party-{j}").exists()


def test_the_decryption_with_the_attackers_secret_is_what_the_attack_would_read(
    tmp_path: Path,
) -> None:
    """The control: the holder of a joint key's secret reads a client's block this way."""
    # Prepare
    generations = generate_in_one_process(PARAMS, parties=1, threshold=1, seed=SEED)
    share, public = generations[1].finish(tmp_path)
    values = np.random.default_rng(7).uniform(-1, 1, PARAMS.values_per_block)
    # Execute
    read = _decrypt_with(
        share.share.astype(np.int64), public, BlockEncryptor(public).encrypt_block(values)
    )
    # Assert
    assert np.abs(read - values).max() < 1e-6
