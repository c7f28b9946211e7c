"""Tests for fedps.transport: calls retried through a peer's restart, and only then."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedps.errors import InvalidArgumentError, PeerUnavailableError
from fedps.transport import call_until


class _RpcError(grpc.RpcError, grpc.Call):
    """The error a stub raises, with its status code."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    # grpc's stubs say float; the documented value of a call without a deadline is None.
    def time_remaining(self) -> float | None:  # type: ignore[override]
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def test_call_until_outlasts_an_unavailable_peer() -> None:
    # Prepare: a peer that is down for two attempts
    attempts: list[float] = []

    def attempt() -> str:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise _RpcError(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    # Execute
    result = call_until(attempt, "flaky", timeout_s=30)
    # Assert: two jittered pauses of 0.1-0.2 s, then 0.15-0.3 s
    assert result == "ok" and len(attempts) == 3
    assert 0.25 <= attempts[2] - attempts[0] < 2.0


def test_call_until_gives_up_after_its_timeout_and_never_retries_a_refusal() -> None:
    # Prepare
    calls: list[str] = []

    def down() -> None:
        calls.append("down")
        raise _RpcError(grpc.StatusCode.UNAVAILABLE)

    def refused() -> None:
        calls.append("refused")
        raise _RpcError(grpc.StatusCode.INVALID_ARGUMENT)

    # Execute / Assert
    started = time.monotonic()
    with pytest.raises(PeerUnavailableError):
        call_until(down, "down", timeout_s=0.5)
    # (at least its timeout; the upper bound only shows that it stops, so it is loose)
    assert 0.5 <= time.monotonic() - started < 30 and calls.count("down") >= 2
    with pytest.raises(InvalidArgumentError):
        call_until(refused, "refused", timeout_s=5)
    assert calls.count("refused") == 1


def test_call_until_stops_when_asked() -> None:
    # Prepare
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()

    def down() -> None:
        raise _RpcError(grpc.StatusCode.UNAVAILABLE)

    # Execute / Assert
    with pytest.raises(PeerUnavailableError):
        call_until(down, "down", stop=stop)
    assert stop.is_set()


def test_caller_roles_name_existing_rpcs_and_roles() -> None:
    # Every RPC the role policy names exists in the generated services, and every role is
    # one `fedps certs` issues: a renamed RPC cannot silently drop out of the policy.
    from fedps.proto import coordinator_pb2_grpc, keyholder_pb2_grpc, shard_pb2_grpc
    from fedps.transport import CALLER_ROLES, certificate_role

    sources = "".join(
        Path(module.__file__).read_text()
        for module in (coordinator_pb2_grpc, keyholder_pb2_grpc, shard_pb2_grpc)
        if module.__file__
    )
    for method, roles in CALLER_ROLES.items():
        assert f"'{method}'" in sources, method
        assert roles <= {"client", "coordinator", "keyholder", "shard", "operator"}
    assert certificate_role("shard-12") == "shard"
    assert certificate_role("coordinator") == "coordinator"
