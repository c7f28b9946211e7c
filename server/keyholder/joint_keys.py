"""The combiner's keys: a joint public context, and the parties that hold its secret in shares.

With ``keyholder.parties`` above 1 the key holder holds no secret key. It serves the joint
public context the parties generated together (:mod:`.party_key_generation`), and it
decrypts a verified round's aggregate by asking ``T`` of the parties
(:class:`.joint_decryptor.JointDecryptor`), each of which checks the round and the joint zero
canaries itself first. :class:`JointKeys` is what :class:`~.decryptor.Decryptor` holds in
place of a :class:`crypto.SecretContext`.

Key rotation is a new collective generation, adopted in two steps (:mod:`.party_rotation`).
Not with parties (yet): blame after a refused round (tracing a canary to one client needs
that client's canaries, which only the parties together can compute).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from crypto import CkksParams, PublicContext
from crypto.ckks_encoder import CkksEncoder
from crypto.files import write_atomic
from crypto.params import TAIL_SIGMAS
from crypto.signing import BlockSigner
from crypto.threshold import flooding_std
from fedps.errors import CorruptStateError, FedPSError
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from server.keyholder.joint_decryptor import JointDecryptor, PartyPeer
from server.keyholder.party_rotation import PartyRotation

__all__ = ["JOINT_CONTEXT_FILE", "JointKeys"]

_log = logging.getLogger("fedps")

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
    probe
        Whether party ``j`` answers (:class:`~.joint_decryptor.JointDecryptor`).
    rotation
        How the key is rotated with the parties (None: it is not); without ``probe``, its
        :meth:`~.party_rotation.PartyRotation.probe` of the current context is the probe.
    """

    def __init__(
        self,
        public: PublicContext,
        parties: Mapping[int, PartyPeer],
        *,
        threshold: int,
        signer: BlockSigner,
        lambda_bits: int,
        probe: Callable[[int], bool] | None = None,
        rotation: PartyRotation | None = None,
    ) -> None:
        self.public = public
        self._rotation = rotation
        if probe is None and rotation is not None:
            probe = lambda j: rotation.probe(j, self.public)  # noqa: E731
        self.parties = len(parties)
        self.threshold = threshold
        self._lambda_bits = lambda_bits
        self._encoder = CkksEncoder(public.params, public.modulus)
        #: the parties, as the combiner asks them (its ``down`` names those that did not answer)
        self.decryptor = JointDecryptor(
            parties, threshold=threshold, modulus=public.modulus, signer=signer, probe=probe
        )

    @classmethod
    def open(
        cls,
        keys_dir: Path,
        addresses: Mapping[int, str],
        *,
        params: CkksParams,
        threshold: int,
        signer: BlockSigner,
        lambda_bits: int,
        wait_s: float = 300.0,
    ) -> JointKeys:
        """The joint context in ``keys_dir`` and a client of every party at ``addresses``.

        On a first start the joint context is asked of every party (:func:`_joint_context`,
        waiting up to ``wait_s`` for their key generation) and kept in ``keys_dir``.

        Raises
        ------
        CorruptStateError
            There is no joint public context, and the parties did not all give the same one
            within ``wait_s``.
        """
        path = keys_dir / JOINT_CONTEXT_FILE
        if not path.exists():
            write_atomic(path, _joint_context(addresses, params, wait_s))
        public = PublicContext.from_bytes(path.read_bytes())
        n = public.params.poly_modulus_degree
        peers = {j: KeyHolderPartyStub(address, n=n) for j, address in addresses.items()}
        return cls(
            public,
            peers,
            threshold=threshold,
            signer=signer,
            lambda_bits=lambda_bits,
            rotation=PartyRotation(peers, signer, path),
        )

    @property
    def can_rotate(self) -> bool:
        """Whether the key can be rotated with the parties (they are reached over the network)."""
        return self._rotation is not None

    def rotate(self, generation: int) -> bool:
        """A new joint key by every party, served from now on; whether it was made.

        :meth:`.party_rotation.PartyRotation.rotate` (``generation``: the last applied round);
        postponed (False) while a party is down or its generation does not finish.
        """
        if self._rotation is None:
            return False
        new = self._rotation.rotate(generation, self.public)
        if new is None:
            return False
        self.public = new  # same parameters: the decoder and the parties' modulus stay
        return True

    def prepare(self, round_: int, contributors: Sequence[str]) -> None:
        """Have the parties expected to decrypt ``round_`` prepare it while it is checked.

        :meth:`.joint_decryptor.JointDecryptor.prepare`; returns at once.
        """
        self.decryptor.prepare(round_, contributors)

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


def _joint_context(addresses: Mapping[int, str], params: CkksParams, wait_s: float) -> bytes:
    """The joint public context every party at ``addresses`` computed, once all give the same.

    Raises
    ------
    CorruptStateError
        Not every party gave one within ``wait_s`` (the message names those that did not), or
        two parties gave different ones.
    """
    until = time.monotonic() + wait_s
    n = params.poly_modulus_degree
    peers = {j: KeyHolderPartyStub(address, n=n) for j, address in addresses.items()}
    try:
        contexts = _contexts(peers, until, wait_s)
    finally:
        for peer in peers.values():
            peer.close()
    if len(set(contexts.values())) != 1:
        raise CorruptStateError(
            "the key-holder parties computed different joint public contexts: their key "
            "generation failed; remove their folders and start them again"
        )
    _log.info("the joint public context of %d parties", len(peers))
    return next(iter(contexts.values()))


def _contexts(
    peers: Mapping[int, KeyHolderPartyStub], until: float, wait_s: float
) -> dict[int, bytes]:
    """Every party's joint public context, asked until each has one or ``until`` passed."""
    contexts: dict[int, bytes] = {}
    while len(contexts) < len(peers):
        for j, peer in peers.items():
            if j not in contexts:
                try:
                    if context := peer.hello().context:
                        contexts[j] = context
                except FedPSError as exc:  # not up yet
                    _log.debug("party %d: %s", j, exc)
        missing = sorted(set(peers) - set(contexts))
        if missing and time.monotonic() > until:
            raise CorruptStateError(
                f"key-holder parties {missing} gave no joint public context within "
                f"{wait_s:.0f} s: their collective key generation has not finished (their logs "
                "say whom they wait for)"
            )
        if missing:
            time.sleep(0.2)
    return contexts
