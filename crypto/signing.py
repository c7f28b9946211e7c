"""Ed25519 signatures that bind each encrypted block to where it belongs.

For every round, a client commits to each of its encrypted blocks with a root over the
block's coefficients (:func:`chunk_root`: three digests, so that its canaries can be opened
alone, :class:`crypto.canary.CanaryOpening`) and signs one
digest binding ``(run, round, client, context id, weight, nonce, all roots)``
(:func:`update_digest`; :class:`crypto.signed_update.SignedUpdate` signs and checks it). The key
holder keeps each contributor's signed update as its commitment
(``server.keyholder.commit_board``); a shard checks the signature and that each block it adds
hashes to its signed root; the key holder checks that every contribution of an aggregate is
the committed one and that the aggregate is their sum
(``server.keyholder.aggregate_verifier``), so a shard can neither invent, re-weight, replay nor
swap a contribution undetected.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from crypto.canary import CanaryOpening, opening_roots
from crypto.files import check_key, private_directory, write_key
from fedps.errors import InvalidArgumentError

__all__ = [
    "CHUNKS",
    "BlockSigner",
    "chunk_commitment",
    "chunk_hashes",
    "chunk_root",
    "chunk_roots",
    "context_digest",
    "is_weak_key",
    "model_block_digest",
    "model_verifier",
    "update_digest",
    "verify_block",
]

#: Committed chunks per block (each 2N / 16 coefficients).
CHUNKS = 16
_DOMAIN = b"fedps-update-v1"


def chunk_hashes(coeffs: np.ndarray) -> list[bytes]:
    """SHA-256 of each of the :data:`CHUNKS` chunks of the raw bytes of ``coeffs``.

    ``coeffs`` are uint64 coefficients, or float64 values with encryption off.
    """
    data = np.ascontiguousarray(coeffs).data.cast("B")
    if len(data) % CHUNKS:
        raise InvalidArgumentError("coefficient count must be a multiple of the chunk count")
    size = len(data) // CHUNKS
    return [hashlib.sha256(data[i : i + size]).digest() for i in range(0, len(data), size)]


def chunk_commitment(hashes: list[bytes]) -> bytes:
    """The root committing to a block, from its :data:`CHUNKS` chunk hashes."""
    return hashlib.sha256(b"\x01" + b"".join(hashes)).digest()


def chunk_root(coeffs: np.ndarray) -> bytes:
    """Commitment to one block.

    For a ciphertext (``2N`` uint64 coefficients) the root of its
    :class:`~crypto.canary.CanaryOpening`, which lets the key holder check its canaries without
    seeing its values; for plaintext values (float64, encryption off) SHA-256 over its
    :data:`CHUNKS` chunk hashes.
    """
    if coeffs.dtype == np.uint64:
        return CanaryOpening.of(coeffs).root()
    return chunk_commitment(chunk_hashes(coeffs))


def chunk_roots(coeffs: np.ndarray) -> list[bytes]:
    """:func:`chunk_root` of each row of ``coeffs``; ciphertexts (uint64) in one pass.

    Parameters
    ----------
    coeffs
        ``(B, 2N)`` ciphertext coefficients (uint64), or ``(B, N)`` plaintext values (float64).

    Returns
    -------
    list of bytes
        The commitment to each row.
    """
    if coeffs.dtype == np.uint64:
        return opening_roots(coeffs)
    return [chunk_root(row) for row in coeffs]


def update_digest(
    *,
    run_id: str,
    round_: int,
    client_id: str,
    context_id: str,
    weight: float,
    nonce: bytes,
    roots: list[bytes],
    version: int = 0,
) -> bytes:
    """The message a client signs for one round (or async buffer).

    Every block's root, bound to its context and to the model version it trained on (which sets its
    staleness).
    """
    out = hashlib.sha256()
    for part in [_DOMAIN, run_id.encode(), client_id.encode(), context_id.encode(), nonce]:
        out.update(struct.pack("<I", len(part)) + part)
    out.update(struct.pack("<QQdI", round_, version, weight, len(roots)))
    for root in roots:
        if len(root) != 32:
            raise InvalidArgumentError("a chunk root is 32 bytes")
        out.update(root)
    return out.digest()


class BlockSigner:
    """A client's Ed25519 key; :attr:`public_key` (32 bytes) is registered with the cluster."""

    def __init__(self, key: Ed25519PrivateKey | None = None) -> None:
        self._key = key or Ed25519PrivateKey.generate()
        self.public_key = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def __repr__(self) -> str:
        return f"BlockSigner(public_key={self.public_key.hex()[:16]}..., private=<hidden>)"

    def sign(self, digest: bytes) -> bytes:
        """Sign a block digest."""
        return self._key.sign(digest)

    @classmethod
    def load_or_create(cls, path: Path) -> BlockSigner:
        """A signing key kept in a 0600 file, created on first use.

        Created atomically, and never over an existing one: of two processes creating it, both end
        with the same key.

        Raises
        ------
        CorruptStateError
            The file exists but holds no raw 32-byte Ed25519 private key, or not the one its
            checksum (``NAME.sha256``, beside it) was written for.
        """
        if not path.exists():
            signer = cls()
            private_directory(path.parent)
            raw = signer._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            try:
                write_key(path, raw, exclusive=True)  # never replaces a key
                return signer
            except FileExistsError:
                pass  # another process created it first: use that one
        raw = path.read_bytes()
        check_key(path, raw, size=32, what="signing key")
        return cls(Ed25519PrivateKey.from_private_bytes(raw))


def context_digest(context: bytes, context_id: str) -> bytes:
    """What the key holder signs to vouch for its public context."""
    return hashlib.sha256(b"fedps-context-v1" + context_id.encode() + context).digest()


def model_block_digest(version: int, block: int, values: bytes) -> bytes:
    """What the key holder signs for each published model block."""
    head = b"fedps-model-v1" + struct.pack("<QI", version, block)
    return hashlib.sha256(head + hashlib.sha256(values).digest()).digest()


def model_verifier(public_key: bytes) -> Callable[[int, int, bytes, bytes], bool]:
    """A check of published model blocks against the key holder's key (for pulls)."""

    def verify(version: int, block: int, values: bytes, signature: bytes) -> bool:
        return verify_block(public_key, model_block_digest(version, block, values), signature)

    return verify


# Encodings of the Ed25519 points of small order (and their non-canonical twins), as listed by
# libsodium: with such a "public key", a forged signature can verify for any message.
_SMALL_ORDER_KEYS = frozenset(
    bytes.fromhex(h)
    for h in (
        "0000000000000000000000000000000000000000000000000000000000000000",
        "0100000000000000000000000000000000000000000000000000000000000000",
        "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
        "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
        "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
        "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
        "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
        "0000000000000000000000000000000000000000000000000000000000000080",
        "0100000000000000000000000000000000000000000000000000000000000080",
        "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
        "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
        "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
        "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
        "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    )
)


def is_weak_key(public_key: bytes) -> bool:
    """Whether ``public_key`` is malformed or a small-order point (never accept it)."""
    return len(public_key) != 32 or public_key in _SMALL_ORDER_KEYS


def verify_block(public_key: bytes, digest: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature of ``digest`` by ``public_key``."""
    if is_weak_key(public_key) or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, digest)
    except (InvalidSignature, ValueError):
        return False
    return True
