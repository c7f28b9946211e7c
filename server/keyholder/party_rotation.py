"""Key rotation with key-holder parties: a new collective key generation, adopted in two steps.

A single key holder replaces its key pair every ``security.rotate_every_rounds`` rounds
(:meth:`~.decryptor.Decryptor.rotate`). With parties nobody holds the key, so a rotation is a
new collective key generation (:mod:`.party_key_generation`), and since a party alone must
never be left with a share nobody else has, it is adopted in two steps:

1. **Rekey.** Once a round is applied, the combiner asks every party for a new generation
   (:class:`~fedps.rpc.keyholder_party_messages.RekeyRequest`, signed, numbered by the last
   applied round, naming the context it replaces). Each party runs it with every other party
   as on a first start (new nonces, a new common seed, new deals) and writes its new share and
   the new joint context into ``next/`` of its folder, **keeping its current share in use**.
   Every party must answer: with one down, the rotation is postponed to the next applied
   round and the current key stays.
2. **Adopt.** Once every party gives the same new joint context (``next_context`` in its
   hello), the combiner writes it as its own ``joint.ctx`` (from then on it serves it to the
   clients and shards) and asks each party to adopt it
   (:class:`~fedps.rpc.keyholder_party_messages.AdoptRequest`, signed): the party moves
   ``next/`` over its share and context (:func:`adopt_next`, redone at start if it was
   interrupted, :func:`finish_adopting`); the old share is gone from its folder. A party that
   missed the adopt (down, restarted) is asked again when the combiner next finds it on the
   old context with the new one waiting (:meth:`PartyRotation.probe`).

A generation that does not finish within ``wait_s`` leaves every party on its current share
(the next rekey replaces what waits in ``next/``) and the combiner on the current context.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from crypto import PublicContext
from crypto.files import write_atomic
from crypto.signing import BlockSigner
from crypto.threshold import KeyShare
from fedps.errors import FedPSError, NotReadyError, PeerUnavailableError
from fedps.rpc.keyholder_party_messages import AdoptRequest, PartyHello, RekeyRequest
from server.keyholder.party_key_generation import PUBLIC_CONTEXT_FILE, SHARE_FILE

__all__ = [
    "NEXT_DIR",
    "PartyRotation",
    "RotationPeer",
    "adopt_next",
    "finish_adopting",
    "load_next",
]

_log = logging.getLogger("fedps")

#: Where a party keeps a rotation's new share and context until it adopts them.
NEXT_DIR = "next"
#: Written before a party moves ``next/`` into place, removed after: a start redoes the move.
_ADOPTING_FILE = "adopting"
_FILES = (SHARE_FILE, PUBLIC_CONTEXT_FILE)
_POLL_S = 0.2  # how often the combiner asks the parties whether their generation finished


class RotationPeer(Protocol):
    """A party as the combiner rotates the key with it (its gRPC client)."""

    def hello(self) -> PartyHello:
        """The party's hello (its context, and a rotation's new one once it holds it)."""
        ...

    def rekey(self, request: RekeyRequest) -> bool:
        """Start the rotation's key generation; whether it started."""
        ...

    def adopt(self, request: AdoptRequest) -> bool:
        """Adopt the new share; whether it changed anything."""
        ...


class PartyRotation:
    """The combiner's side of a key rotation with every party.

    Parameters
    ----------
    parties
        Every party, by index.
    signer
        The combiner's signing key (the parties check its requests against it).
    context_file
        The combiner's joint context file (``keys/joint.ctx``), replaced by a rotation.
    wait_s
        How long a rotation waits for every party's new generation before it is postponed.
    """

    def __init__(
        self,
        parties: Mapping[int, RotationPeer],
        signer: BlockSigner,
        context_file: Path,
        *,
        wait_s: float = 60.0,
    ) -> None:
        self._parties = dict(parties)
        self._signer = signer
        self._context_file = context_file
        self._wait_s = wait_s

    def rotate(self, generation: int, current: PublicContext) -> PublicContext | None:
        """A new joint key by every party, served and adopted; None: postponed (logged).

        ``generation`` numbers the rotation (above every earlier one). The new context is
        written to the combiner's context file before any party adopts it.
        """
        request = RekeyRequest(generation, current.context_id)
        request = RekeyRequest(generation, current.context_id, self._signer.sign(request.digest()))
        for j, peer in sorted(self._parties.items()):
            try:
                peer.rekey(request)
            except FedPSError as exc:
                _log.warning(
                    "key rotation postponed to the next applied round: party %d (%s)", j, exc
                )
                return None
        data = self._new_context(current)
        if data is None:
            return None
        new = PublicContext.from_bytes(data)
        if new.params != current.params:
            _log.error("key rotation refused: the parties' new context has other parameters")
            return None
        write_atomic(self._context_file, data)  # served from now on, after a restart too
        for j in sorted(self._parties):
            self._adopt(j, new.context_id)
        return new

    def probe(self, index: int, current: PublicContext) -> bool:
        """Whether party ``index`` can decrypt under ``current``; it adopts it if it waits.

        A party on another context, with no new one waiting that is ``current``, cannot
        (it missed a rotation: its ``next/`` was lost); it is named down.
        """
        try:
            hello = self._parties[index].hello()
        except NotReadyError:  # its share made elsewhere (no key generation of its own)
            return True
        except PeerUnavailableError:
            return False
        mine = current.serialize()
        if not hello.context or hello.context == mine:
            return True
        if hello.next_context == mine:
            return self._adopt(index, current.context_id)
        _log.warning("party %d holds a share of another joint key than the one served", index)
        return False

    def _new_context(self, current: PublicContext) -> bytes | None:
        """Every party's new joint context once all give the same one; None after ``wait_s``."""
        until = time.monotonic() + self._wait_s
        old = current.serialize()
        while True:
            contexts: dict[int, bytes] = {}
            for j, peer in self._parties.items():
                try:
                    hello = peer.hello()
                except FedPSError:
                    continue
                if hello.next_context and hello.next_context != old:
                    contexts[j] = hello.next_context
            if len(contexts) == len(self._parties) and len(set(contexts.values())) == 1:
                return next(iter(contexts.values()))
            if len(set(contexts.values())) > 1 or time.monotonic() > until:
                missing = sorted(set(self._parties) - set(contexts))
                _log.warning(
                    "key rotation postponed to the next applied round: the parties' new "
                    "generation %s (waiting for parties %s)",
                    "differs" if len(set(contexts.values())) > 1 else "did not finish",
                    missing,
                )
                return None
            time.sleep(_POLL_S)

    def _adopt(self, index: int, context_id: str) -> bool:
        request = AdoptRequest(context_id)
        request = AdoptRequest(context_id, self._signer.sign(request.digest()))
        try:
            self._parties[index].adopt(request)
        except FedPSError as exc:  # asked again when it is next probed
            _log.warning("party %d did not adopt the rotated key yet (%s)", index, exc)
            return False
        return True


def load_next(folder: Path) -> tuple[KeyShare, PublicContext] | None:
    """The new share and joint context waiting in ``folder``'s ``next/``, or None."""
    next_dir = folder / NEXT_DIR
    if not all((next_dir / name).exists() for name in _FILES):
        return None
    share = KeyShare.load(next_dir / SHARE_FILE)
    return share, PublicContext.from_bytes((next_dir / PUBLIC_CONTEXT_FILE).read_bytes())


def adopt_next(folder: Path) -> None:
    """Move ``next/``'s share and context over the party's own, as one step across restarts."""
    write_atomic(folder / _ADOPTING_FILE, b"")
    finish_adopting(folder)


def finish_adopting(folder: Path) -> None:
    """Finish a move of ``next/`` that a stop interrupted (nothing to do when none was)."""
    marker = folder / _ADOPTING_FILE
    if not marker.exists():
        return
    next_dir = folder / NEXT_DIR
    for name in _FILES:
        if (next_dir / name).exists():
            os.replace(next_dir / name, folder / name)
    _fsync_directory(folder)
    marker.unlink()
    _fsync_directory(folder)


def _fsync_directory(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
