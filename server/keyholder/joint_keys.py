"""The combiner's keys: a joint public context, and the parties that hold its secret in shares.

With ``keyholder.parties`` above 1 the key holder holds no secret key. It serves the joint
public context the parties generated together (:mod:`.party_key_generation`), and it
decrypts a verified round's aggregate by asking ``T`` of the parties
(:class:`.joint_decryptor.JointDecryptor`), each of which checks the round and the joint zero
canaries itself first. :class:`JointKeys` is what :class:`~.decryptor.Decryptor` holds in
place of a :class:`crypto.SecretContext`.

Not with parties (yet): key rotation (a new collective generation), and blame after a refused
round (tracing a canary to one client needs that client's canaries, which only the parties
together can compute).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from crypto import PublicContext
from crypto.ckks_encoder import CkksEncoder
from crypto.params import TAIL_SIGMAS
from crypto.signing import BlockSigner
from crypto.threshold import flooding_std
from fedps.errors import CorruptStateError
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from server.keyholder.joint_decryptor import JointDecryptor, PartyPeer

__all__ = ["JOINT_CONTEXT_FILE", "JointKeys"]

#: The joint public context in the key holder's ``keys`` folder.
JOINT_CONTEXT_FILE = "joint.ctx"


class JointKeys:
    """A joint public context and the ``T``-of-``P`` parties that decrypt under it.

    Parameters
    ----------
    public
        The joint public context (what clients encrypt under).
    parties
        Every party, by index ``1..P``.
    threshold
        T.
    signer
        The combiner's signing key (the parties hold its public key).
    lambda_bits
        The statistical security of each party's flooding.
    """

    def __init__(
        self,
        public: PublicContext,
        parties: Mapping[int, PartyPeer],
        *,
        threshold: int,
        signer: BlockSigner,
        lambda_bits: int,
    ) -> None:
        self.public = public
        self.parties = len(parties)
        self.threshold = threshold
        self._lambda_bits = lambda_bits
        self._encoder = CkksEncoder(public.params, public.modulus)
        #: the parties, as the combiner asks them (its ``down`` names those that did not answer)
        self.decryptor = JointDecryptor(
            parties, threshold=threshold, modulus=public.modulus, signer=signer
        )

    @classmethod
    def open(
        cls,
        keys_dir: Path,
        addresses: Mapping[int, str],
        *,
        threshold: int,
        signer: BlockSigner,
        lambda_bits: int,
    ) -> JointKeys:
        """The joint context in ``keys_dir`` and a client of every party at ``addresses``.

        Raises
        ------
        CorruptStateError
            There is no joint public context (the parties' key generation has not run).
        """
        path = keys_dir / JOINT_CONTEXT_FILE
        if not path.exists():
            raise CorruptStateError(
                f"{path} is missing: key-holder parties need the joint public context of their "
                "collective key generation (docs/security.md, Key-holder parties)"
            )
        public = PublicContext.from_bytes(path.read_bytes())
        n = public.params.poly_modulus_degree
        peers = {j: KeyHolderPartyStub(address, n=n) for j, address in addresses.items()}
        return cls(public, peers, threshold=threshold, signer=signer, lambda_bits=lambda_bits)

    def open_round(
        self,
        round_: int,
        contributors: Sequence[str],
        blocks: Sequence[int],
        rows: np.ndarray,
        *,
        c0: np.ndarray,
    ) -> np.ndarray:
        """The values of a verified aggregate, decrypted by ``T`` parties, ``(B, values)``.

        ``rows`` are the aggregate as the shards summed it (what the parties check), ``c0`` its
        first polynomial with the contributors' pads removed (:mod:`crypto.blinding`).

        Raises
        ------
        PolicyError
            A party refused the round (its check, or the joint canaries, failed).
        PeerUnavailableError
            Fewer than ``T`` parties answer (the message names those that are down).
        """
        plain = self.decryptor.decrypt(round_, contributors, blocks, rows, c0=c0)
        return self._encoder.decode(plain)

    def flooding_bound(self, noise_weight: float) -> float:
        """The largest error the parties' flooding adds to a released value (13 sigmas)."""
        sigma = flooding_std(
            self.public.params, noise_weight, parties=self.parties, lambda_bits=self._lambda_bits
        )
        return TAIL_SIGMAS * math.sqrt(self.threshold) * sigma / self.public.params.scale
