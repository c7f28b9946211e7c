"""Shared random-k sparsification: the coordinates every client of a round sends.

Secure aggregation adds ciphertexts slot by slot, so every client of a round must put the same
values in the same slots: the coordinates sent are a mask shared by the round, drawn from a
seed nobody can choose or predict before the round opens. The seed is derived from the round's
challenge seed (:meth:`server.keyholder.commit_board.CommitBoard.challenge_seed`, an HMAC under
32 bytes the key holder drew from its CSPRNG, over everything that defines the round), hashed
with a label of its own (:func:`mask_seed`): a cohort member gets it from the key holder with
the challenge, and what it reveals (the mask, public by design) says nothing of the challenge.
The positions depend on the seed only, never on any client's data.

A round sends ``ceil(density x blocks)`` ciphertexts (:attr:`SparseMask.sent_blocks`, which a
shard computes from the published model's block count alone), filled with as many values as
they hold, ``min(num_params, sent blocks x values_per_block)`` (:attr:`SparseMask.size`; a
ciphertext costs the same bytes full or not, so the coordinates sent are a slightly larger
fraction than ``density`` when ``density x blocks`` is not whole). They are the coordinates
with the smallest keys of a keystream seeded by the mask seed, in increasing order, packed
densely and laid out in blocks as a full update is (:attr:`SparseMask.packed`). The key
holder decrypts that packed sum and scatters it back (:meth:`SparseMask.scatter`). A client's
signed commitment ends with the mask seed as one more root (:meth:`SparseMask.root`), so a
commitment under another mask is refused by name.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from fedps.errors import InvalidArgumentError
from fedps.sharding.blocks import BlockLayout

__all__ = ["SparseMask", "mask_seed", "sent_blocks", "upload_layout"]

_LABEL = b"fedps-sparse-mask-v1"
_SEED_BYTES = 32


def mask_seed(challenge_seed: bytes) -> bytes:
    """The round's mask seed, from its challenge seed (one-way: it reveals nothing of it)."""
    return hashlib.sha256(_LABEL + challenge_seed).digest()


def sent_blocks(num_blocks: int, density: float, fields: int = 1) -> int:
    """The blocks (ciphertexts) a round sends of a model of ``num_blocks`` blocks.

    Parameters
    ----------
    num_blocks
        The whole model's blocks.
    density
        The fraction of the update sent, in (0, 1].
    fields
        Values packed to one coefficient (quantized packing, :mod:`crypto.quantized_packing`;
        1: one real value): an update of the whole model fills ``ceil(num_blocks / fields)``
        blocks, which is ``ceil(num_params / (fields x values_per_block))``.

    Returns
    -------
    int
        ``ceil(density x ceil(num_blocks / fields))``, at least 1 (rounded to 9 digits first,
        so that 0.1 x 30 is 3, not 4).
    """
    if not 0 < density <= 1:
        raise InvalidArgumentError(f"density must be in (0, 1], got {density}")
    if fields < 1:
        raise InvalidArgumentError(f"fields must be at least 1, got {fields}")
    packed = -(-num_blocks // fields)
    return min(packed, max(1, math.ceil(round(density * packed, 9))))


def upload_layout(layout: BlockLayout, fields: int) -> BlockLayout:
    """The layout of an update of the model of ``layout``: ``fields`` values per coefficient.

    Parameters
    ----------
    layout
        The model's block layout (one value per coefficient).
    fields
        Values packed to one coefficient (1: one real value).

    Returns
    -------
    BlockLayout
        ``layout.num_params`` values, ``fields x layout.values_per_block`` per ciphertext.
    """
    return BlockLayout(layout.num_params, fields * layout.values_per_block)


@dataclass(frozen=True)
class SparseMask:
    """One round's mask over a model of ``layout.num_params`` values.

    Parameters
    ----------
    layout
        The whole update's block layout: ``values_per_block`` is what one ciphertext holds
        (``K x V`` with quantized packing, :func:`upload_layout`).
    density
        The fraction sent, in (0, 1].
    seed
        The round's mask seed (:func:`mask_seed`), 32 bytes.

    Raises
    ------
    InvalidArgumentError
        A density outside (0, 1] or a seed that is not 32 bytes.
    """

    layout: BlockLayout
    density: float
    seed: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != _SEED_BYTES:
            raise InvalidArgumentError(f"a mask seed is {_SEED_BYTES} bytes")
        sent_blocks(self.layout.num_blocks, self.density)  # checks the density

    @property
    def sent_blocks(self) -> int:
        """The ciphertexts each client sends."""
        return sent_blocks(self.layout.num_blocks, self.density)

    @property
    def size(self) -> int:
        """The values sent (k): as many as the sent blocks hold."""
        return min(self.layout.num_params, self.sent_blocks * self.layout.values_per_block)

    @property
    def packed(self) -> BlockLayout:
        """The layout of the packed values: :attr:`sent_blocks` blocks."""
        return BlockLayout(self.size, self.layout.values_per_block)

    @property
    def root(self) -> bytes:
        """What a commitment carries as its last root: the mask seed."""
        return self.seed

    def indices(self) -> np.ndarray:
        """The coordinates sent, increasing (int64, :attr:`size` of them; read-only).

        The :attr:`size` coordinates with the smallest keys of a Philox keystream keyed by the
        seed (a bit stream numpy keeps stable across releases), ties broken by position.
        Computed once per mask.
        """
        return self._chosen

    @functools.cached_property
    def _chosen(self) -> np.ndarray:
        key = int.from_bytes(self.seed[:16], "little")
        counter = int.from_bytes(self.seed[16:], "little")
        generator = np.random.Philox(key=key, counter=counter)
        keys = generator.random_raw(self.layout.num_params)
        chosen = np.sort(np.argsort(keys, kind="stable")[: self.size]).astype(np.int64)
        chosen.flags.writeable = False
        return chosen

    def gather(self, vector: np.ndarray) -> np.ndarray:
        """The coordinates of ``vector`` (a whole update) that are sent, packed.

        Raises
        ------
        InvalidArgumentError
            ``vector`` is not ``num_params`` long.
        """
        if vector.shape != (self.layout.num_params,):
            raise InvalidArgumentError(
                f"an update has {self.layout.num_params} values, got {vector.shape}"
            )
        sent: np.ndarray = vector[self.indices()]
        return sent

    def scatter(self, packed: np.ndarray) -> np.ndarray:
        """A whole vector holding ``packed`` at the coordinates sent, zero elsewhere.

        Raises
        ------
        InvalidArgumentError
            ``packed`` is not :attr:`size` long.
        """
        if packed.shape != (self.size,):
            raise InvalidArgumentError(
                f"a packed update has {self.size} values, got {packed.shape}"
            )
        out = np.zeros(self.layout.num_params, dtype=packed.dtype)
        out[self.indices()] = packed
        return out
