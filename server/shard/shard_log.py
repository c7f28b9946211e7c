"""A shard's durable state: a write-ahead log per round, the published model, public contexts.

A shard acknowledges a push only after the push is in its log: each accepted change (round
opened, blocks added, round closed or discarded) is one ``ShardLogRecord`` in a
:class:`~fedps.storage.record_log.RecordLog` (``log/round-NNNNNNNNNNNN.wal``), fsynced by default
before the RPC returns. A restarted shard replays the logs in round order and rebuilds its
running sums and manifests exactly. Rounds the shard no longer keeps are deleted with their
log. The published model (already signed by the key holder) and the public contexts the shard
fetched are checked state files (:func:`crypto.files.write_checked`: written atomically, with a
SHA-256 verified at load) beside the logs. A corrupt log record or state file stops the shard
with :class:`~fedps.errors.CorruptStateError` naming the file and how to recover. Nothing here
is secret: ciphertexts under a public key, signed plaintext model blocks and public contexts.

The handler logs plain :class:`ShardLogRecord` values; their protobuf encoding (the log's
format on disk) lives here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from crypto.files import private_directory, read_checked, write_checked
from fedps.proto import shard_pb2
from fedps.rpc.messages import framed, varint_field
from fedps.rpc.shard_messages import Publication, PushBatch, RoundOpening
from fedps.storage.record_log import RecordLog

__all__ = ["ShardLog", "ShardLogRecord", "discard_shard_state", "load_published_model"]

_SAFE_ID = re.compile(r"[0-9A-Za-z_-]{1,128}")
_LOG_HINT = (
    "restore the file from a backup, or move it aside to drop that round's pushes (the "
    "round is then abandoned, as if this shard had lost it)"
)
_MODEL_HINT = (
    "delete it; the key holder republishes the model to this shard when the coordinator starts"
)
_CONTEXT_HINT = "delete it; the shard fetches the public context from the key holder again"


@dataclass(frozen=True)
class ShardLogRecord:
    """One acknowledged change.

    A round opened (``opening``), a push's added blocks (``push``, with the staleness ``multiplier``
    applied), a round closed or discarded.
    """

    kind: Literal["open", "push", "close", "discard"]
    round: int
    opening: RoundOpening | None = None
    push: PushBatch | None = None
    multiplier: int = 1

    def serialize(self) -> bytes:
        """The on-disk bytes: :meth:`to_proto`, serialised.

        A push's record is framed around its ciphertexts (:func:`_push_record`) rather than
        copied into protobuf messages block by block and serialised again: the same message to
        every reader.
        """
        if self.push is not None:
            return _push_record(self.push, self.multiplier)
        return bytes(self.to_proto().SerializeToString())

    def to_proto(self) -> shard_pb2.ShardLogRecord:
        """The on-disk form."""
        if self.opening is not None:
            return shard_pb2.ShardLogRecord(open=self.opening.to_proto())
        if self.push is not None:
            logged = shard_pb2.LoggedPush(push=self.push.to_proto(), multiplier=self.multiplier)
            return shard_pb2.ShardLogRecord(push=logged)
        closing = shard_pb2.CloseRoundRequest(round=self.round)
        if self.kind == "discard":
            return shard_pb2.ShardLogRecord(discard=closing)
        return shard_pb2.ShardLogRecord(close=closing)

    @classmethod
    def from_proto(cls, record: shard_pb2.ShardLogRecord) -> ShardLogRecord:
        """From the on-disk form."""
        kind = record.WhichOneof("kind")
        if kind == "open":
            return cls("open", record.open.round, opening=RoundOpening.from_proto(record.open))
        if kind == "push":
            push = PushBatch.from_proto(record.push.push)
            return cls("push", push.round, push=push, multiplier=record.push.multiplier)
        if kind == "discard":
            return cls("discard", record.discard.round)
        return cls("close", record.close.round)


def _push_record(push: PushBatch, multiplier: int) -> bytes:
    """The serialised ``ShardLogRecord`` of ``push``'s added blocks, ciphertexts copied twice.

    The push's wire bytes (:meth:`~fedps.rpc.shard_messages.PushBatch.serialize`), framed as
    ``LoggedPush.push`` (1) beside its ``multiplier`` (2), framed as ``ShardLogRecord.push``
    (2): field numbers from ``shard.proto``.
    """
    logged = [*framed(1, push.serialize()), varint_field(2, multiplier)]
    return b"".join(framed(2, *logged))


class ShardLog:
    """One shard's logs and snapshots.

    Parameters
    ----------
    directory
        The shard's state directory (created if missing).
    fsync
        Flush every record to disk before it is acknowledged.
    """

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self.directory = private_directory(directory)
        self._log = RecordLog(directory / "log", fsync=fsync, what="shard log", hint=_LOG_HINT)
        self._contexts = private_directory(directory / "contexts")

    def append(self, round_: int, record: ShardLogRecord) -> None:
        """Append one record to ``round_``'s log; durable when this returns."""
        self._log.append(round_, record.serialize())

    def records(self) -> Iterator[tuple[int, ShardLogRecord]]:
        """Every logged record, in round order then write order (a torn tail cut off).

        Raises
        ------
        CorruptStateError
            A logged record is damaged (see :class:`~fedps.storage.record_log.RecordLog`).
        """
        for round_, payload in self._log.records():
            yield round_, ShardLogRecord.from_proto(shard_pb2.ShardLogRecord.FromString(payload))

    def pushed(self, round_: int, wanted: set[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        """The packed ciphertexts of the ``(client, block)`` pairs ``wanted`` in ``round_``'s log.

        Read back from disk: a shard keeps only running sums in memory; this is the evidence the key
        holder may ask for after a failed check.

        Raises
        ------
        CorruptStateError
            A logged record is damaged.
        """
        found: dict[tuple[str, int], bytes] = {}
        for payload in self._log.round_records(round_):
            record = shard_pb2.ShardLogRecord.FromString(payload)
            if record.WhichOneof("kind") != "push":
                continue
            push = record.push.push
            for block in push.blocks:
                key = (push.client_id, block.block)
                if key in wanted:
                    found[key] = block.ciphertext
        return found

    def forget_before(self, round_: int) -> None:
        """Delete the logs of every round before ``round_``."""
        self._log.forget_before(round_)

    def close(self) -> None:
        """Close the open log files."""
        self._log.close()

    def save_model(self, model: Publication) -> None:
        """Replace the saved published model (every owned block, signed), atomically."""
        write_checked(self.directory / "model.pb", model.to_proto().SerializeToString())

    def load_model(self) -> Publication | None:
        """The last saved published model, or None.

        Raises
        ------
        CorruptStateError
            ``model.pb`` is damaged.
        """
        return load_published_model(self.directory)

    def save_context(self, context_id: str, data: bytes) -> None:
        """Keep a fetched public context (public data) for a restart."""
        if _SAFE_ID.fullmatch(context_id):
            write_checked(self._contexts / f"{context_id}.ctx", data)

    def load_context(self, context_id: str) -> bytes | None:
        """A saved public context, or None.

        Raises
        ------
        CorruptStateError
            The saved context is damaged.
        """
        if not _SAFE_ID.fullmatch(context_id):
            return None
        path = self._contexts / f"{context_id}.ctx"
        return read_checked(path, what=f"public context {context_id}", hint=_CONTEXT_HINT)


def load_published_model(directory: Path) -> Publication | None:
    """The published model a shard saved in its state folder ``directory``.

    Every block it owns, signed; None when it saved none.

    Raises
    ------
    CorruptStateError
        ``model.pb`` is damaged.
    """
    data = read_checked(directory / "model.pb", what="the published model", hint=_MODEL_HINT)
    if data is None:
        return None
    return Publication.from_proto(shard_pb2.PublishRequest.FromString(data))


def discard_shard_state(directory: Path) -> Path | None:
    """Set a shard's rounds and published model aside, so that it starts empty.

    For a shard declared gone that comes back (``fedps shard --empty``): its log and saved model
    move into ``directory/discarded-<UTC time>/`` (kept for the operator, never read again);
    the public contexts stay (public data, fetched again otherwise). The caller holds the
    shard's state lock. Returns the folder they went to (None: there was nothing to set aside).
    """
    held = [p for p in (directory / "log", directory / "model.pb") if p.exists()]
    if not held:
        return None
    aside = private_directory(directory / time.strftime("discarded-%Y%m%dT%H%M%SZ", time.gmtime()))
    for path in held:
        path.rename(aside / path.name)
    return aside
