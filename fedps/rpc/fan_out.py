"""One call to each of several peers, all at once: what a role does to every shard.

A client pushes to each shard that owns a block of its update; the coordinator opens and closes
each round on every shard. The shards are separate processes (often hosts): called one after
the other, each waits for the one before, and a round of clients that all push to the shards in
the same order loads one shard at a time while the other waits. :func:`fan_out` makes the calls
from one thread per peer (gRPC waits without holding the GIL) and returns once every call has
ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

__all__ = ["fan_out"]

_K = TypeVar("_K")
_T = TypeVar("_T")


def fan_out(calls: Mapping[_K, Callable[[], _T]]) -> dict[_K, _T]:
    """Run every call at once, each in its own thread; their results by key, in ``calls``' order.

    A single call runs in the caller's thread. Every call runs to its end, whatever the others
    do (each has its own deadline); then the first error, in ``calls``' order, is raised.
    Callers that must survive one peer's failure catch it inside the call and return it.

    Parameters
    ----------
    calls
        What to call, by key (a shard id).

    Returns
    -------
    dict
        Each call's result, by key.
    """
    if len(calls) <= 1:
        return {key: fn() for key, fn in calls.items()}
    results: dict[_K, _T] = {}
    errors: dict[_K, BaseException] = {}

    def run(key: _K, fn: Callable[[], _T]) -> None:
        try:
            results[key] = fn()
        except BaseException as exc:  # raised in the caller's thread below
            errors[key] = exc

    threads = [
        threading.Thread(target=run, args=(key, fn), name=f"fan-out {key}", daemon=True)
        for key, fn in calls.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for key in calls:
        if key in errors:
            raise errors[key]
    return {key: results[key] for key in calls}
