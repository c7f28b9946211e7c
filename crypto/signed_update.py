"""A client's signed commitment to its whole encrypted update for one round.

:class:`SignedUpdate` is the one form every role handles: the edge client signs it
(:meth:`SignedUpdate.sign`), the key holder's commit board and a shard check it
(:meth:`SignedUpdate.verify`), and the aggregate verifier compares what a shard forwards with
what was committed. The digest it signs is :func:`crypto.signing.update_digest`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from crypto.signing import BlockSigner, chunk_roots, update_digest, verify_block

__all__ = ["SignedUpdate"]


@dataclass(frozen=True, slots=True)
class SignedUpdate:
    """What a client signs for one round (or async buffer), with its signature.

    Parameters
    ----------
    client_id
        The signing client.
    weight
        Its declared aggregation weight.
    nonce
        16 random bytes, fresh for every signature.
    signature
        Ed25519 over :meth:`digest`.
    roots
        The commitment (:func:`crypto.signing.chunk_root`) of every block of the update.
    version
        The model version the update was trained on (it sets its staleness).
    """

    client_id: str
    weight: float
    nonce: bytes
    signature: bytes
    roots: tuple[bytes, ...]
    version: int = 0

    @classmethod
    def sign(
        cls,
        signer: BlockSigner,
        coefficients: np.ndarray,
        *,
        run_id: str,
        round_: int,
        client_id: str,
        context_id: str,
        weight: float,
        version: int = 0,
        mask: bytes = b"",
    ) -> SignedUpdate:
        """Commit to every block (one row of ``coefficients`` each) of an update and sign.

        A sparsified update (:mod:`fedps.sharding.sparse_mask`) names its round's ``mask``
        (32 bytes) as one more root after the blocks', so the signature covers it too.
        """
        roots = [*chunk_roots(coefficients), *([mask] if mask else [])]
        unsigned = cls(client_id, weight, os.urandom(16), b"", tuple(roots), version)
        digest = unsigned.digest(run_id=run_id, round_=round_, context_id=context_id)
        return cls(client_id, weight, unsigned.nonce, signer.sign(digest), unsigned.roots, version)

    def digest(self, *, run_id: str, round_: int, context_id: str) -> bytes:
        """The message signed for this run, round and key generation."""
        return update_digest(
            run_id=run_id,
            round_=round_,
            client_id=self.client_id,
            context_id=context_id,
            weight=self.weight,
            nonce=self.nonce,
            roots=list(self.roots),
            version=self.version,
        )

    def verify(self, public_key: bytes, *, run_id: str, round_: int, context_id: str) -> bool:
        """Whether the signature is ``public_key``'s over :meth:`digest`."""
        digest = self.digest(run_id=run_id, round_=round_, context_id=context_id)
        return verify_block(public_key, digest, self.signature)
