"""Durable local state.

The append-only, checksummed record log (:mod:`~fedps.storage.record_log`) and the state folder's
single-instance lock (:mod:`~fedps.storage.state_lock`).
"""

from fedps.storage.record_log import RecordLog
from fedps.storage.state_lock import StateLock

__all__ = ["RecordLog", "StateLock"]
