"""What a shard keeps of one round: the cohort, the running sums and each client's entry."""

from __future__ import annotations

from dataclasses import dataclass, field

from crypto import CiphertextSum, PlainSum
from crypto.signed_update import SignedUpdate

__all__ = ["ROOT_BYTES", "ClientEntry", "RoundState"]

ROOT_BYTES = 32  # a chunk commitment (SHA-256)


@dataclass(slots=True)
class ClientEntry:
    """One client's signed update in a round and the blocks of it that were added.

    Stored compactly, since a shard holds one per client and round: the roots joined into one
    ``bytes``, the blocks as a bitmask. The manifest of a block is derived from the entries.
    A shard without a log keeps each added block's packed ciphertext here (``data``); with
    one, the log holds them and memory stays flat in the number of clients. Either way they
    last as long as the round: the key holder may ask for the sum of a smaller set of clients
    (the set the round closed with) and, after a failed check, for the evidence of who
    changed what (:meth:`server.shard.shard.Shard.trace`).
    """

    weight: float
    version: int
    nonce: bytes
    signature: bytes
    roots: bytes  # every block's chunk root, joined
    multiplier: int
    blocks: int = 0  # bit b set: block b was added into the sum
    data: dict[int, bytes] = field(default_factory=dict)  # each added block (no log only)

    @classmethod
    def of(cls, update: SignedUpdate, multiplier: int) -> ClientEntry:
        """The entry of ``update``, added into the sums with ``multiplier``."""
        return cls(
            update.weight,
            update.version,
            update.nonce,
            update.signature,
            b"".join(update.roots),
            multiplier,
        )

    def has(self, block: int) -> bool:
        """Whether block ``block`` was added into the sum."""
        return bool(self.blocks >> block & 1)

    def root(self, block: int) -> bytes:
        """The committed chunk root of block ``block``."""
        return self.roots[block * ROOT_BYTES : (block + 1) * ROOT_BYTES]

    def signed(self, client_id: str) -> SignedUpdate:
        """The signed update of ``client_id`` this entry holds."""
        roots = tuple(self.root(b) for b in range(len(self.roots) // ROOT_BYTES))
        return SignedUpdate(client_id, self.weight, self.nonce, self.signature, roots, self.version)


@dataclass
class RoundState:
    """One round at a shard.

    Its cohort and commitments, the running sums of the blocks the shard owns, and each client's
    entry.
    """

    round: int
    version: int
    members: dict[str, bytes]  # client id -> Ed25519 public key
    context_id: str
    run_id: str
    # each member's commitment at the key holder: its pushes must carry exactly this
    commitments: dict[str, SignedUpdate] = field(default_factory=dict)
    sums: dict[int, CiphertextSum | PlainSum] = field(default_factory=dict)
    entries: dict[str, ClientEntry] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    #: the ring its opening carried last (a newer one reopens it, closed or not)
    ring_version: int = 0
