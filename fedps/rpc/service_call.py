"""What every typed service client shares.

One call with the status -> exception mapping and optional retries, and a streamed reply read under
the same mapping.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from fedps.errors import PeerUnavailableError
from fedps.rpc.transport import call, call_until

__all__ = ["invoke", "stream_replies"]

_T = TypeVar("_T")

#: How long after a streamed call's deadline the watchdog cancels it
_WATCHDOG_GRACE_S = 5.0


def invoke(fn: Callable[[], _T], what: str, retry_s: float | None = None) -> _T:
    """Run ``fn`` (a stub call with its deadline).

    A gRPC status becomes our exception (:func:`fedps.rpc.transport.call`). With ``retry_s``, a
    peer's transient failure (:func:`fedps.rpc.transport.is_transient`: unreachable, restarting,
    stopping, overloaded or failed inside) is retried with backoff for up to that long
    (:func:`fedps.rpc.transport.call_until`); the caller's own faults and answers (a closed round,
    an unknown client) are raised at once.
    """
    if retry_s is None:
        return call(fn, what)
    return call_until(fn, what, timeout_s=retry_s)


def stream_replies(
    replies: Iterable[_T], what: str, *, timeout_s: float | None = None
) -> Iterator[_T]:
    """The messages of a streamed reply, as they arrive.

    A gRPC error mid-stream is mapped as by :func:`invoke`.

    With ``timeout_s`` (the call's own deadline) the caller never waits longer than that
    (plus a grace): a streamed reply whose peer died mid-stream has been seen to outlive its
    deadline in gRPC's core, and even a cancel, which left a client waiting forever. The
    messages are then read by a helper thread one at a time (the caller still checks each
    before the next is read); past the deadline the call is cancelled and
    :class:`~fedps.errors.PeerUnavailableError` raised, and a reader stuck in gRPC is left
    behind (a daemon thread).
    """
    iterator = iter(replies)

    def next_message() -> list[_T]:
        return call(lambda: list(itertools.islice(iterator, 1)), what)

    if timeout_s is None:
        while head := next_message():
            yield head[0]
        return
    until = time.monotonic() + timeout_s + _WATCHDOG_GRACE_S
    wanted = threading.Semaphore(0)  # one message is read per release: no read-ahead
    ready: queue.Queue[tuple[list[_T], BaseException | None]] = queue.Queue()

    def read() -> None:
        while wanted.acquire(timeout=max(0.0, until - time.monotonic())):
            try:
                head = next_message()
            except BaseException as exc:  # handed to the caller
                ready.put(([], exc))
                return
            ready.put((head, None))
            if not head:
                return

    threading.Thread(target=read, name=f"{what} reader", daemon=True).start()
    while True:
        wanted.release()
        try:
            head, error = ready.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            cancel = getattr(replies, "cancel", None)
            if cancel is not None:
                cancel()
            raise PeerUnavailableError(
                f"{what}: no reply {_WATCHDOG_GRACE_S:g} s past the call's deadline"
            ) from None
        if error is not None:
            raise error
        if not head:
            return
        yield head[0]
