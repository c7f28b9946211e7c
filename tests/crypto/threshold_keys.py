"""A collective key generation kept whole, and real aggregates under it, for threshold tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crypto import BlockEncryptor, CiphertextSum, CkksParams, PublicContext, unpack_block
from crypto import threshold as th
from crypto.public_context import make_seal_context
from crypto.rlwe import RingProduct

#: The derived defaults: N = 2048, one 46-bit prime, scale 2^37.
PARAMS = CkksParams.for_workload(max_clients=100, max_abs_value=1.0, precision=1e-5)
N = PARAMS.poly_modulus_degree
SEED = b"a seed every party agreed on"


@dataclass(frozen=True)
class Joint:
    """What every party drew, together: the tests may see the secret no party holds."""

    modulus: int
    keys: list[th.PartyKey]
    public: PublicContext

    @property
    def secret(self) -> np.ndarray:
        """``s = sum s_i`` modulo q."""
        total = sum(key.secret for key in self.keys)
        return (np.asarray(total) % self.modulus).astype(np.uint64)

    def shares(self, threshold: int) -> list[th.KeyShare]:
        """Every party's share of a fresh T-of-P dealing of the parties' secrets."""
        q, parties = self.modulus, len(self.keys)
        dealt = [th.deal(k.secret, q, threshold=threshold, parties=parties) for k in self.keys]
        return [
            th.KeyShare(j, threshold, parties, q, th.gather([d[j] for d in dealt], q))
            for j in range(1, parties + 1)
        ]

    def exact(self, rows: np.ndarray) -> np.ndarray:
        """The single-key decryption ``c0 + c1 s`` (centred) under the summed secret."""
        product = RingProduct(self.secret, self.modulus).times(rows[:, N:])
        return th.combine(rows[:, :N], [product], self.modulus)


def generate(parties: int) -> Joint:
    """A collective key generation of ``parties`` parties, its public context as clients load it."""
    parms, _ = make_seal_context(PARAMS)
    q = int(parms.coeff_modulus()[0].value())
    common = th.common_polynomial(SEED, N, q)
    keys = [th.draw_party_key(common, q) for _ in range(parties)]
    public_key = th.joint_public_key(common, [k.public_share for k in keys], q)
    public = PublicContext.from_bytes(th.joint_public_context(PARAMS, public_key).serialize())
    return Joint(q, keys, public)


def aggregate(public: PublicContext, clients: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``blocks`` blocks summed over ``clients`` clients' real ciphertexts, and the plain sum."""
    encryptor = BlockEncryptor(public)  # the unchanged client code
    values = np.random.default_rng(7).uniform(-1, 1, (clients, blocks, PARAMS.values_per_block))
    sums = [CiphertextSum(public) for _ in range(blocks)]
    for update in values:
        for block, total in zip(update, sums, strict=True):
            total.add(unpack_block(public, encryptor.encrypt_block(block)))
    return np.stack([s.coefficients for s in sums]), values.sum(axis=0)
