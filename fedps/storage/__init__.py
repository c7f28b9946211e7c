"""Durable local state.

The append-only, checksummed record log (:mod:`~fedps.storage.record_log`), the state folder's
single-instance lock (:mod:`~fedps.storage.state_lock`), and a write retried until it is
written (:mod:`~fedps.storage.write_retry`).
"""

from fedps.storage.record_log import RecordLog
from fedps.storage.state_lock import StateLock
from fedps.storage.write_retry import write_until_written

__all__ = ["RecordLog", "StateLock", "write_until_written"]
