"""Tests for fedps.rpc.transport: calls retried through a peer's transient failures, and only
then."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedps.errors import (
    FedPSError,
    InvalidArgumentError,
    NotReadyError,
    PeerUnavailableError,
    PrivacyBudgetExceededError,
    QuarantinedError,
    RateLimitedError,
    RoundClosedError,
    ShardStalledError,
    UnknownClientError,
)
from fedps.rpc.transport import Backoff, bind, call_until, create_server, is_transient, rpc_errors


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
    attempts: list[str] = []

    def attempt() -> str:
        attempts.append("call")
        if len(attempts) < 3:
            raise _RpcError(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    # Execute
    result = call_until(attempt, "flaky", timeout_s=30, backoff=Backoff(first_s=0.0))
    # Assert
    assert result == "ok" and len(attempts) == 3


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
    with pytest.raises(PeerUnavailableError):
        call_until(down, "down", timeout_s=0.2, backoff=Backoff(first_s=0.01, cap_s=0.01))
    assert calls.count("down") >= 2
    with pytest.raises(InvalidArgumentError):
        call_until(refused, "refused", timeout_s=5)
    assert calls.count("refused") == 1


def test_call_until_stops_when_asked() -> None:
    # Prepare: the third failure sets the stop event
    stop = threading.Event()
    calls: list[str] = []

    def down() -> None:
        calls.append("down")
        if len(calls) == 3:
            stop.set()
        raise _RpcError(grpc.StatusCode.UNAVAILABLE)

    # Execute / Assert
    with pytest.raises(PeerUnavailableError):
        call_until(down, "down", stop=stop)
    assert len(calls) == 3


def test_backoff_doubles_its_ceiling_up_to_the_cap_with_full_jitter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: record each pause's range and sleep, drawing the top of the range
    ranges: list[tuple[float, float]] = []
    slept: list[float] = []

    def uniform(low: float, high: float) -> float:
        ranges.append((low, high))
        return high

    monkeypatch.setattr(random, "uniform", uniform)
    monkeypatch.setattr(time, "sleep", slept.append)
    backoff = Backoff(first_s=0.5, cap_s=3.0)

    # Execute
    for _ in range(5):
        backoff.pause()
    backoff.reset()
    backoff.pause()

    # Assert: every pause is drawn from [0, ceiling]; the ceiling doubles, capped, and a
    # reset starts it over
    assert ranges == [(0.0, 0.5), (0.0, 1.0), (0.0, 2.0), (0.0, 3.0), (0.0, 3.0), (0.0, 0.5)]
    assert slept == [0.5, 1.0, 2.0, 3.0, 3.0, 0.5]
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s=2.0, cap_s=1.0)


# ---------------------------------------------------------------- a real server that fails
_METHOD = "/fedps.test.Flaky/Call"
_FAILURES = 2  # a transient failure is answered this many times, then the call succeeds


def _abort_with(code: grpc.StatusCode) -> Callable[[grpc.ServicerContext], None]:
    def fail(context: grpc.ServicerContext) -> None:
        context.abort(code, f"{code.name.lower()} on purpose")

    return fail


def _raise_our(error: FedPSError) -> Callable[[grpc.ServicerContext], None]:
    def fail(context: grpc.ServicerContext) -> None:
        with rpc_errors(context):
            raise error

    return fail


def _disk_full(context: grpc.ServicerContext) -> None:
    raise OSError(28, "No space left on device")  # gRPC answers UNKNOWN


#: How a server fails, and whether a caller asks again.
_FAILURE_MODES: dict[str, tuple[Callable[[grpc.ServicerContext], None], bool]] = {
    "unknown: an OSError in the handler": (_disk_full, True),
    "cancelled: a server stopping": (_abort_with(grpc.StatusCode.CANCELLED), True),
    "unavailable": (_abort_with(grpc.StatusCode.UNAVAILABLE), True),
    "deadline exceeded": (_abort_with(grpc.StatusCode.DEADLINE_EXCEEDED), True),
    "aborted": (_abort_with(grpc.StatusCode.ABORTED), True),
    "resource exhausted": (_abort_with(grpc.StatusCode.RESOURCE_EXHAUSTED), True),
    "internal": (_abort_with(grpc.StatusCode.INTERNAL), True),
    "our FedPSError (internal)": (_raise_our(FedPSError("broken")), True),
    "not ready": (_raise_our(NotReadyError("no model yet")), True),
    "invalid argument": (_abort_with(grpc.StatusCode.INVALID_ARGUMENT), False),
    "permission denied": (_abort_with(grpc.StatusCode.PERMISSION_DENIED), False),
    "unauthenticated": (_abort_with(grpc.StatusCode.UNAUTHENTICATED), False),
    "rate limited": (_raise_our(RateLimitedError("too many calls")), False),
    "quarantined": (_raise_our(QuarantinedError("tampering")), False),
    "shard stalled": (_raise_our(ShardStalledError("shard-1 missed its deadline")), False),
    "privacy budget spent": (_raise_our(PrivacyBudgetExceededError("spent")), False),
    "round closed": (_raise_our(RoundClosedError("round 3 is already applied")), False),
    "unknown client": (_raise_our(UnknownClientError("who?")), False),
}


@pytest.fixture(scope="module")
def flaky_server() -> Iterator[tuple[grpc.Channel, list[Callable[[grpc.ServicerContext], None]]]]:
    """A real gRPC server on port 0 whose one method answers each queued failure in turn,
    then ``b"ok"``; and a channel to it (without gRPC's own retries)."""
    failures: list[Callable[[grpc.ServicerContext], None]] = []

    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        if failures:
            failures.pop(0)(context)
        return b"ok"

    server = create_server(max_workers=2)
    handler = grpc.unary_unary_rpc_method_handler(handle)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("fedps.test.Flaky", {"Call": handler}),)
    )
    port = bind(server, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, failures
    channel.close()
    server.stop(grace=None)


@pytest.mark.parametrize("mode", sorted(_FAILURE_MODES))
def test_every_transient_failure_is_retried_and_nothing_else(
    flaky_server: tuple[grpc.Channel, list[Callable[[grpc.ServicerContext], None]]], mode: str
) -> None:
    # Prepare: the server fails _FAILURES times in this mode, then answers
    channel, failures = flaky_server
    fail, transient = _FAILURE_MODES[mode]
    failures[:] = [fail] * _FAILURES
    stub = channel.unary_unary(_METHOD, request_serializer=None, response_deserializer=None)
    calls: list[str] = []

    def attempt() -> bytes:
        calls.append("call")
        return bytes(stub(b"", timeout=30))

    # Execute / Assert: transient: asked again until it answers; otherwise raised at once
    if transient:
        assert call_until(attempt, mode, timeout_s=60, backoff=Backoff(first_s=0.0)) == b"ok"
        assert len(calls) == _FAILURES + 1
    else:
        with pytest.raises(FedPSError) as raised:
            call_until(attempt, mode, timeout_s=60, backoff=Backoff(first_s=0.0))
        assert not is_transient(raised.value)
        assert len(calls) == 1
    failures.clear()


def test_a_peer_unavailable_error_without_a_status_is_transient() -> None:
    # A local PeerUnavailableError (no gRPC status behind it) is worth asking again; a bare
    # FedPSError that no peer sent is not.
    assert is_transient(PeerUnavailableError("cannot connect"))
    assert not is_transient(FedPSError("a bug of ours"))


def test_caller_roles_name_existing_rpcs_and_roles() -> None:
    # Every RPC the role policy names exists in the generated services, and every role is
    # one `fedps certs` issues: a renamed RPC cannot silently drop out of the policy.
    from fedps.proto import (
        coordinator_pb2_grpc,
        keyholder_party_pb2_grpc,
        keyholder_pb2_grpc,
        shard_pb2_grpc,
    )
    from fedps.rpc.transport import CALLER_ROLES, certificate_role

    services = (coordinator_pb2_grpc, keyholder_pb2_grpc, keyholder_party_pb2_grpc, shard_pb2_grpc)
    sources = "".join(Path(module.__file__).read_text() for module in services if module.__file__)
    for method, roles in CALLER_ROLES.items():
        assert f"'{method}'" in sources, method
        assert roles <= {"client", "coordinator", "keyholder", "party", "shard", "operator"}
    assert certificate_role("shard-12") == "shard"
    assert certificate_role("coordinator") == "coordinator"


def test_a_peer_that_stays_down_is_said_once_with_a_hint_and_its_return_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: a peer down for five attempts
    attempts: list[str] = []

    def attempt() -> str:
        attempts.append("call")
        if len(attempts) < 6:
            raise _RpcError(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    # Execute
    with caplog.at_level(logging.INFO, logger="fedps"):
        call_until(attempt, "register", timeout_s=30, backoff=Backoff(first_s=0.0))

    # Assert: one warning that asks whether it is started, one line when it answers
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("register:") and "is it started" in warnings[0]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "register: the peer answers again"
    ]
