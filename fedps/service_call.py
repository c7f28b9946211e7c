"""What every typed service client shares: one call with the status -> exception mapping
and optional retries, and a streamed reply read under the same mapping."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from fedps.transport import call, call_until

__all__ = ["invoke", "stream_replies"]

_T = TypeVar("_T")

#: How long after a streamed call's deadline the watchdog cancels it
_WATCHDOG_GRACE_S = 5.0


def invoke(fn: Callable[[], _T], what: str, retry_s: float | None = None) -> _T:
    """Run ``fn`` (a stub call with its deadline); a gRPC status becomes our exception
    (:func:`fedps.transport.call`). With ``retry_s``, a peer's transient failure
    (:func:`fedps.transport.is_transient`: unreachable, restarting, stopping, overloaded or
    failed inside) is retried with backoff for up to that long
    (:func:`fedps.transport.call_until`); the caller's own faults and answers (a closed
    round, an unknown client) are raised at once."""
    if retry_s is None:
        return call(fn, what)
    return call_until(fn, what, timeout_s=retry_s)


def stream_replies(
    replies: Iterable[_T], what: str, *, timeout_s: float | None = None
) -> Iterator[_T]:
    """The messages of a streamed reply, as they arrive, a gRPC error mid-stream mapped as
    by :func:`invoke`.

    With ``timeout_s`` (the call's own deadline), a watchdog cancels the call a little after
    it: a streamed reply whose peer died mid-stream has been seen to outlive its deadline in
    gRPC's core, which left a client waiting forever."""
    cancel = getattr(replies, "cancel", None)
    watchdog = None
    if timeout_s is not None and cancel is not None:
        watchdog = threading.Timer(timeout_s + _WATCHDOG_GRACE_S, cancel)
        watchdog.daemon = True
        watchdog.start()
    iterator = iter(replies)
    try:
        while True:
            head = call(lambda: list(itertools.islice(iterator, 1)), what)
            if not head:
                return
            yield head[0]
    finally:
        if watchdog is not None:
            watchdog.cancel()
