"""What a shard shows the key holder after a failed check: who changed what, and nothing more.

After a canary check failed, the key holder asks for the *canary openings* of the suspect
block's contributors (:class:`crypto.canary.CanaryOpening`): enough to find whose own
ciphertext carries the change, nothing of anyone's values. After a sketch check failed it
reveals the round's challenge (the round is refused for good) and asks for the ciphertexts
that do not match their clients' committed sketches: an honest shard's sum is the sum of what
it was pushed, so a failed check means some contributor's ciphertext does not match its own
sketch, and the shard shows it (its signed root proves it is the client's). A shard that shows
none is the one that changed the sum (:mod:`server.keyholder.blame`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from crypto import PlainContext, PublicContext
from crypto.canary import CanaryOpening
from crypto.sketch import Challenge
from fedps.errors import InvalidArgumentError
from fedps.rpc.shard_messages import HeldCiphertext, OpenedBlock, TraceQuery

__all__ = ["HeldRows", "answer_trace", "canary_openings", "sketch_mismatches"]

#: ``(client, block, packed)`` of each held ciphertext, and their validated coefficients
#: (one row each).
HeldRows = tuple[list[tuple[str, int, bytes]], np.ndarray]


def answer_trace(
    query: TraceQuery,
    public: PublicContext | PlainContext,
    held: Callable[[Collection[int], Collection[str]], HeldRows],
) -> tuple[list[OpenedBlock], list[HeldCiphertext]]:
    """Answer a :class:`~fedps.rpc.shard_messages.TraceQuery`.

    Canary openings, or with a challenge seed the ciphertexts that do not match their committed
    sketches.

    Parameters
    ----------
    query
        The key holder's query: the round, blocks and contributors, and for a sketch trace
        the revealed challenge seed and each contributor's committed sketches.
    public
        The round's public context.
    held
        The shard's held ciphertexts of some blocks from some clients in the closed round.

    Raises
    ------
    InvalidArgumentError
        A malformed query (sketches of the wrong size, a plaintext round), or blocks or
        clients the shard holds no pushes of.
    """
    if not query.contributors or not query.blocks:
        raise InvalidArgumentError("name the blocks and contributors to trace")
    if not isinstance(public, PublicContext):
        raise InvalidArgumentError("a plaintext round has no canaries or sketches to trace")
    if not query.challenge_seed:
        opened = canary_openings(held(query.blocks, query.contributors))
        return [OpenedBlock.of(c, b, o) for c, b, o in opened], []
    challenge = Challenge(
        query.challenge_seed, modulus=public.modulus, coeffs_per_block=public.coeffs_per_block
    )
    if len(query.sketches) != len(query.contributors):
        raise InvalidArgumentError("one entry of sketches per contributor")
    size = 8 * challenge.count * len(query.blocks)
    sketches = {}
    for client, data in zip(query.contributors, query.sketches, strict=True):
        if len(data) != size:
            raise InvalidArgumentError(f"each contributor's sketches are {size} bytes")
        values = np.frombuffer(data, dtype="<u8").astype(np.uint64)
        sketches[client] = values.reshape(challenge.count, len(query.blocks))
    blocks = list(query.blocks)
    found = sketch_mismatches(held(blocks, sketches), blocks, sketches, challenge)
    return [], [HeldCiphertext(c, b, data) for c, b, data in found]


def canary_openings(held: HeldRows) -> list[tuple[str, int, CanaryOpening]]:
    """The canary opening of each held ciphertext, as ``(client, block, opening)``."""
    pushes, rows = held
    return [
        (client, block, CanaryOpening.of(row))
        for (client, block, _), row in zip(pushes, rows, strict=True)
    ]


def sketch_mismatches(
    held: HeldRows,
    blocks: Sequence[int],
    sketches: Mapping[str, np.ndarray],
    challenge: Challenge,
) -> list[tuple[str, int, bytes]]:
    """The held ciphertexts ``(client, block, packed)`` whose sketch is not the committed one.

    Their sketch under ``challenge`` is not the one their client committed (``sketches``: each
    client's committed sketches of ``blocks``, shape (count, len(blocks))).
    """
    pushes, rows = held
    if not pushes:
        return []
    actual = challenge.sketch(rows)
    column = {b: i for i, b in enumerate(blocks)}
    return [
        (client, block, data)
        for i, (client, block, data) in enumerate(pushes)
        if np.any(actual[:, i] != sketches[client][:, column[block]])
    ]
