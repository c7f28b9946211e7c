"""The shared call helpers of the typed service clients."""

from __future__ import annotations

import threading

import grpc
import pytest

from fedps.errors import FedPSError
from fedps.service_call import stream_replies


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

    # Execute / Assert: the watchdog cancels it after the deadline (plus its grace), and the
    # caller gets an error instead of waiting forever
    with pytest.raises(FedPSError):
        list(stream_replies(stuck, "pull", timeout_s=0.01))
    assert stuck.cancelled.is_set()
