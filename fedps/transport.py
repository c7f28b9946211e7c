"""gRPC plumbing shared by every role: limits, channels, servers and error mapping.

Servicers stay thin: each method calls a plain handler inside :func:`rpc_errors`, which turns
our expected errors into a gRPC status with the error's message. Callers wrap stubs with
:func:`call`, which maps a status back to the same exception class with one table.
Message-size limits are set explicitly on both ends; channels retry UNAVAILABLE with
exponential backoff and jitter through gRPC's own retry policy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import NoReturn, TypeVar

import grpc

from fedps.errors import (
    FedPSError,
    InvalidArgumentError,
    PeerUnavailableError,
    PolicyError,
    RoundClosedError,
    UnknownClientError,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "TARGET_MESSAGE_BYTES",
    "batched",
    "bind",
    "call",
    "create_channel",
    "create_server",
    "rpc_errors",
]

_log = logging.getLogger("fedps")

#: Largest message any fedps endpoint sends or accepts.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: Size at which senders cut a stream of blocks into the next message.
TARGET_MESSAGE_BYTES = 2 * 1024 * 1024

_RETRY_POLICY = {
    "methodConfig": [
        {
            "name": [
                {"service": "fedps.proto.Shard"},
                {"service": "fedps.proto.KeyHolder"},
                {"service": "fedps.proto.Coordinator"},
            ],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}

_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# Status code -> our exception class, for the caller side.
_FROM_STATUS: dict[grpc.StatusCode, type[FedPSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.PERMISSION_DENIED: PolicyError,
    grpc.StatusCode.NOT_FOUND: UnknownClientError,
    grpc.StatusCode.FAILED_PRECONDITION: RoundClosedError,
    grpc.StatusCode.UNAVAILABLE: PeerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgumentError,
}

_T = TypeVar("_T")


def create_channel(address: str) -> grpc.Channel:
    """An insecure channel with fedps's message limits and retry policy."""
    options = [
        *_OPTIONS,
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(_RETRY_POLICY)),
    ]
    return grpc.insecure_channel(address, options=options)


def create_server(max_workers: int = 16) -> grpc.Server:
    """A thread-pool server with fedps's message limits; add servicers, then bind."""
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS)


def bind(server: grpc.Server, address: str) -> int:
    """Bind ``address`` (``host:0`` picks a free port) and return the bound port."""
    port = server.add_insecure_port(address)
    if port == 0:
        raise PeerUnavailableError(f"cannot bind {address}")
    return port


@contextmanager
def rpc_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Turn expected fedps errors raised inside the block into a gRPC status."""
    try:
        yield
    except FedPSError as exc:
        _abort(context, exc.status, str(exc))
    except ValueError as exc:
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    _log.info("refused request: %s: %s", code.name, message)
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort always raises


def call(fn: Callable[[], _T], what: str) -> _T:
    """Run a stub call; map a gRPC error to the matching fedps exception."""
    try:
        return fn()
    except grpc.RpcError as exc:
        raise _from_rpc_error(exc, what) from exc


def _from_rpc_error(exc: grpc.RpcError, what: str) -> FedPSError:
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    cls = _FROM_STATUS.get(code, FedPSError)
    err = cls(f"{what}: {details}")
    err.status = code
    return err


def batched(items: list[_T], size_of: Callable[[_T], int]) -> Iterator[list[_T]]:
    """Cut ``items`` into lists of about :data:`TARGET_MESSAGE_BYTES` each."""
    batch: list[_T] = []
    size = 0
    for item in items:
        n = size_of(item)
        if batch and size + n > TARGET_MESSAGE_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch
