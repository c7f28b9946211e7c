"""The shared call helpers of the typed service clients."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from fedps.errors import PeerUnavailableError
from fedps.rpc.service_call import stream_replies


class _StuckStream(grpc.RpcError):
    """A streamed reply whose peer died mid-stream and whose deadline never fires (as
    gRPC's core was seen to do): its next message waits until the call is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True

    def __iter__(self) -> _StuckStream:
        return self

    def __next__(self) -> bytes:
        self.cancelled.wait()
        raise self

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "cancelled by the watchdog"

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_a_streamed_reply_that_outlives_its_deadline_is_cancelled() -> None:
    # Prepare
    stuck = _StuckStream()

    # Execute / Assert: past the deadline (plus its grace) the caller gets an error instead
    # of waiting forever, and the call is cancelled
    with pytest.raises(PeerUnavailableError, match="past the call's deadline"):
        list(stream_replies(stuck, "pull", timeout_s=0.01))
    assert stuck.cancelled.is_set()


def test_a_streamed_reply_is_read_one_message_at_a_time() -> None:
    # Prepare: a reply that records how far it was read
    read: list[int] = []

    def replies() -> Iterator[int]:
        for i in range(3):
            read.append(i)
            yield i

    # Execute: the caller takes the first message and looks at what was read meanwhile
    stream = stream_replies(replies(), "fetch", timeout_s=60)
    first = next(stream)
    read_after_first = list(read)
    rest = list(stream)

    # Assert: nothing was read ahead of the caller, and every message arrives in order
    assert (first, read_after_first, rest) == (0, [0], [1, 2])
