"""The key holder's commitment log: every change of a commit phase it acknowledged, in order.

Each record is a :class:`~fedps.rpc.keyholder_messages.CommitOpening`,
:class:`~fedps.rpc.keyholder_messages.UpdateCommitment` or
:class:`~fedps.rpc.keyholder_messages.CommitClosing`, kept in a
:class:`~fedps.storage.record_log.RecordLog`
as a ``CommitLogRecord`` (its protobuf encoding lives here, nowhere else).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fedps.proto import keyholder_pb2
from fedps.rpc.keyholder_messages import CommitClosing, CommitOpening, UpdateCommitment
from fedps.storage.record_log import RecordLog

__all__ = ["CommitLog", "CommitRecord"]

_HINT = (
    "restore the file from a backup, or move it aside to drop that round's commitments (the "
    "key holder then refuses that round as never opened; later rounds proceed)"
)

#: One logged change of a commit phase.
CommitRecord = CommitOpening | UpdateCommitment | CommitClosing


class CommitLog:
    """The commit board's durable record.

    Parameters
    ----------
    directory
        Where the log files live.
    fsync
        Flush every record to disk before it is acknowledged.
    """

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self._log = RecordLog(directory, fsync=fsync, what="commit log", hint=_HINT)

    def append(self, record: CommitRecord) -> None:
        """Append one record to its round's log; durable when this returns."""
        if isinstance(record, CommitOpening):
            message = keyholder_pb2.CommitLogRecord(open=record.to_proto())
        elif isinstance(record, UpdateCommitment):
            message = keyholder_pb2.CommitLogRecord(commit=record.to_proto())
        else:
            message = keyholder_pb2.CommitLogRecord(close=record.to_proto())
        self._log.append(record.round, message.SerializeToString())

    def records(self) -> Iterator[CommitRecord]:
        """Every logged record, in round order then write order.

        Raises
        ------
        CorruptStateError
            A logged record is damaged (see :class:`~fedps.storage.record_log.RecordLog`).
        """
        for _, payload in self._log.records():
            message = keyholder_pb2.CommitLogRecord.FromString(payload)
            kind = message.WhichOneof("kind")
            if kind == "open":
                yield CommitOpening.from_proto(message.open)
            elif kind == "commit":
                yield UpdateCommitment.from_proto(message.commit)
            elif kind == "close":
                yield CommitClosing.from_proto(message.close)

    def forget_before(self, round_: int) -> None:
        """Delete the logs of every round before ``round_``."""
        self._log.forget_before(round_)

    def close(self) -> None:
        """Close the open log files."""
        self._log.close()
