"""gRPC plumbing shared by every role: limits, channels, servers and error mapping.

Servicers stay thin: each method calls a plain handler inside :func:`rpc_errors`, which turns
our expected errors into a gRPC status with the error's message. Callers wrap stubs with
:func:`call`, which raises the same exception class again: one table, :data:`ERROR_STATUS`,
gives each error class its status both ways.
Message-size limits are set explicitly on both ends; channels retry UNAVAILABLE with
exponential backoff and jitter through gRPC's own retry policy.

Mutual TLS is process-wide: a role calls :func:`fedps.provisioning.setup_tls` (or
:func:`crypto.tls.configure_tls` with a loaded identity) once at start, before it creates any
channel or server; from then on
:func:`create_channel` presents the identity's certificate and verifies the peer against the
deployment's CA, :func:`bind` opens TLS ports that require a client certificate signed by that
CA, and servers from :func:`create_server` refuse, with ``UNAUTHENTICATED``, any call whose
peer has no verified certificate.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import grpc

from crypto.tls import TlsMaterial, tls_identity
from fedps.errors import (
    ConfigError,
    CorruptStateError,
    FedPSError,
    InvalidArgumentError,
    NotReadyError,
    PeerUnavailableError,
    PolicyError,
    PrivacyBudgetExceededError,
    QuarantinedError,
    RateLimitedError,
    RoundClosedError,
    ShardStalledError,
    StaleUpdateError,
    UnauthenticatedError,
    UnknownClientError,
)

__all__ = [
    "CALLER_ROLES",
    "ERROR_CLASS_KEY",
    "ERROR_STATUS",
    "MAX_MESSAGE_BYTES",
    "STATUS_CLASS",
    "TARGET_MESSAGE_BYTES",
    "TRANSIENT_STATUS",
    "AddressInUseError",
    "Backoff",
    "batched",
    "bind",
    "call",
    "call_until",
    "certificate_role",
    "channel_credentials",
    "create_channel",
    "create_server",
    "is_transient",
    "peer_common_name",
    "require_peer",
    "rpc_errors",
    "wire_class",
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
        },
        {
            # Streamed replies are not retried by the channel (its retries of a stream whose
            # peer died were seen to hang past the deadline); their callers retry instead.
            "name": [
                {"service": "fedps.proto.Shard", "method": "PullBlocks"},
                {"service": "fedps.proto.Shard", "method": "FetchAggregate"},
                {"service": "fedps.proto.Shard", "method": "TraceBlocks"},
            ],
        },
    ]
}

# Each channel keeps its own connections (gRPC shares them process-wide by default): a new
# channel to a peer restarted on an address must not inherit a dead connection's backoff and
# fail at once with its "connection refused".
_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.use_local_subchannel_pool", 1),
]

# A server closes a connection idle this long: a shard's memory then follows the clients
# pushing now, not every client that ever connected (they reconnect on their next call).
# No SO_REUSEPORT (gRPC sets it by default on Linux): a second process on a port in use must
# fail to bind, not share the port with the first and get half of its connections.
_SERVER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_connection_idle_ms", 10_000),
    ("grpc.so_reuseport", 0),
]

#: The status each of our error classes crosses the wire with, both ways. A servicer's
#: :func:`rpc_errors` sends an error as its class's status with the error's message and names
#: the class in the trailing metadata (:data:`ERROR_CLASS_KEY`); :func:`call` raises that
#: class again when the name is in this table and the status is its status. A subclass that is
#: not in the table (a role's own, such as the key holder's ``TamperingError``) crosses as its
#: nearest ancestor that is.
ERROR_STATUS: dict[type[FedPSError], grpc.StatusCode] = {
    FedPSError: grpc.StatusCode.INTERNAL,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownClientError: grpc.StatusCode.NOT_FOUND,
    RoundClosedError: grpc.StatusCode.FAILED_PRECONDITION,
    StaleUpdateError: grpc.StatusCode.FAILED_PRECONDITION,
    PrivacyBudgetExceededError: grpc.StatusCode.FAILED_PRECONDITION,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    RateLimitedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    PolicyError: grpc.StatusCode.PERMISSION_DENIED,
    QuarantinedError: grpc.StatusCode.ABORTED,
    ShardStalledError: grpc.StatusCode.PERMISSION_DENIED,
    PeerUnavailableError: grpc.StatusCode.UNAVAILABLE,
    NotReadyError: grpc.StatusCode.UNAVAILABLE,
    CorruptStateError: grpc.StatusCode.DATA_LOSS,
}

#: Trailing-metadata key naming the class of an error sent by :func:`rpc_errors`.
ERROR_CLASS_KEY = "fedps-error"

_BY_NAME: dict[str, type[FedPSError]] = {cls.__name__: cls for cls in ERROR_STATUS}

#: The usual class of each status: what a status that names no class of ours becomes on the
#: caller's side (gRPC's own failures: an unreachable peer, a deadline, an oversized message;
#: the mutual-TLS interceptor's refusals; a ValueError that a servicer turned into
#: INVALID_ARGUMENT). Every class in :data:`ERROR_STATUS` is a subclass of its status's usual
#: class, so a caller that catches the usual class catches whatever a peer names.
STATUS_CLASS: dict[grpc.StatusCode, type[FedPSError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.PERMISSION_DENIED: PolicyError,
    grpc.StatusCode.ABORTED: QuarantinedError,
    grpc.StatusCode.NOT_FOUND: UnknownClientError,
    grpc.StatusCode.FAILED_PRECONDITION: RoundClosedError,
    grpc.StatusCode.UNAVAILABLE: PeerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgumentError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.DATA_LOSS: CorruptStateError,
}

_T = TypeVar("_T")


def create_channel(address: str) -> grpc.Channel:
    """A channel with fedps's message limits and retry policy; mutual TLS once configured."""
    options = [
        *_OPTIONS,
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(_RETRY_POLICY)),
        # A peer back from a restart is reached within seconds (gRPC's default backoff
        # grows to 120 s between reconnection attempts)
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 5000),
    ]
    identity = tls_identity()
    if identity is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(identity), options=options)


def channel_credentials(identity: TlsMaterial) -> grpc.ChannelCredentials:
    """Credentials that trust ``identity``'s CA and present its certificate (none if it is empty).

    For one channel, whatever this process's TLS.
    """
    if not identity.cert:
        return grpc.ssl_channel_credentials(root_certificates=identity.ca_cert)
    return grpc.ssl_channel_credentials(
        root_certificates=identity.ca_cert,
        private_key=identity.key,
        certificate_chain=identity.cert,
    )


def create_server(max_workers: int = 16) -> grpc.Server:
    """A thread-pool server with fedps's message limits; add servicers, then bind.

    Once TLS is configured, the server also refuses every call whose peer presented no
    verified client certificate (``UNAUTHENTICATED``), whatever port it came in on, and
    every call to a role's RPC from a certificate of another role (``PERMISSION_DENIED``,
    :data:`CALLER_ROLES`).
    """
    interceptors: list[grpc.ServerInterceptor[Any, Any]] = []
    if tls_identity() is not None:
        interceptors.append(_RequireClientCertificate())
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[*_OPTIONS, *_SERVER_OPTIONS],
        interceptors=interceptors,
    )


class AddressInUseError(PeerUnavailableError):
    """A server cannot listen on its address: another process listens there."""


def bind(server: grpc.Server, address: str, *, role: str = "process") -> int:
    """Bind ``address`` (``host:0`` picks a free port) and return the bound port.

    Once TLS is configured the port speaks only TLS and requires a client certificate signed
    by the deployment's CA. Servers from :func:`create_server` do not share ports, so a
    second server on a port in use fails here.

    Raises
    ------
    AddressInUseError
        Another process listens on ``address`` (``role`` names what this server is, for
        the message).
    PeerUnavailableError
        ``address`` cannot be bound for another reason.
    """
    in_use = AddressInUseError(
        f"{address} is in use (another fedps {role} may be running); stop it or choose another port"
    )
    if _in_use(address):  # checked first: gRPC would also log its own error on stderr
        raise in_use
    identity = tls_identity()
    try:
        if identity is None:
            port = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(identity.key, identity.cert)],
                root_certificates=identity.ca_cert,
                require_client_auth=True,
            )
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # gRPC's "Failed to bind"
        port = 0
    if port == 0:
        raise in_use if _in_use(address) else PeerUnavailableError(f"cannot bind {address}")
    return port


def _in_use(address: str) -> bool:
    """Whether another socket listens on ``address``'s port.

    False for port 0, and for an address this machine cannot bind at all.
    """
    host, _, port = address.rpartition(":")
    try:
        number = int(port)
        infos = (
            socket.getaddrinfo(
                host.strip("[]") or None,
                number,
                type=socket.SOCK_STREAM,
                flags=socket.AI_PASSIVE,
            )
            if number
            else []
        )
    except (ValueError, OSError):
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: SO_REUSEADDR, so connections in TIME_WAIT do not count
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


if TYPE_CHECKING:
    _Interceptor = grpc.ServerInterceptor[Any, Any]  # generic only in the type stubs
else:
    _Interceptor = grpc.ServerInterceptor


# Which roles may call which RPC under mutual TLS. A certificate's role is its common name up
# to the first "-" (``fedps certs`` names them keyholder, coordinator, shard-N, client-N,
# operator; a key-holder party is party-N). RPCs not listed are open to every certificate of
# the deployment. Status answers only the operator (``fedps status``, the demo's watcher); the
# key holder's model state also the coordinator, which reads it when it starts.
CALLER_ROLES: dict[str, frozenset[str]] = {
    "/fedps.proto.Shard/GetStatus": frozenset({"coordinator", "operator"}),
    "/fedps.proto.Coordinator/GetStatus": frozenset({"operator"}),
    "/fedps.proto.KeyHolder/GetModelState": frozenset({"coordinator", "operator"}),
    "/fedps.proto.Shard/OpenRound": frozenset({"coordinator"}),
    "/fedps.proto.Shard/CloseRound": frozenset({"coordinator"}),
    "/fedps.proto.Shard/DiscardRound": frozenset({"coordinator"}),
    "/fedps.proto.Shard/FetchAggregate": frozenset({"keyholder", "party"}),
    "/fedps.proto.Shard/TraceBlocks": frozenset({"keyholder"}),
    "/fedps.proto.Shard/Publish": frozenset({"keyholder"}),
    "/fedps.proto.Shard/PushBlocks": frozenset({"client"}),
    "/fedps.proto.KeyHolder/InitializeModel": frozenset({"coordinator"}),
    "/fedps.proto.KeyHolder/ApplyRound": frozenset({"coordinator"}),
    "/fedps.proto.KeyHolder/OpenCommits": frozenset({"coordinator"}),
    "/fedps.proto.KeyHolder/CloseCommits": frozenset({"coordinator"}),
    "/fedps.proto.KeyHolder/GetChallenge": frozenset({"client"}),
    "/fedps.proto.KeyHolder/Commit": frozenset({"client"}),
    "/fedps.proto.Coordinator/Register": frozenset({"client"}),
    "/fedps.proto.Coordinator/GetTask": frozenset({"client"}),
    "/fedps.proto.Coordinator/ReportUpdate": frozenset({"client"}),
    "/fedps.proto.Coordinator/GetClosedRound": frozenset({"party"}),
    "/fedps.proto.KeyHolderParty/CanaryPartial": frozenset({"keyholder"}),
    "/fedps.proto.KeyHolderParty/PartialDecrypt": frozenset({"keyholder"}),
    "/fedps.proto.KeyHolderParty/Hello": frozenset({"party", "keyholder", "operator"}),
    "/fedps.proto.KeyHolderParty/Deal": frozenset({"party"}),
    "/fedps.proto.KeyHolderParty/Prepare": frozenset({"keyholder"}),
    "/fedps.proto.KeyHolderParty/Rekey": frozenset({"keyholder"}),
    "/fedps.proto.KeyHolderParty/Adopt": frozenset({"keyholder"}),
}


def certificate_role(common_name: str) -> str:
    """The role of a certificate's common name: ``shard-1`` -> ``shard``."""
    return common_name.split("-", 1)[0]


def peer_common_name(context: grpc.ServicerContext) -> str | None:
    """The common name of the caller's verified certificate; ``None`` without one (plaintext).

    Under mutual TLS every call that reaches a servicer has one (the handshake and
    :func:`create_server`'s check refuse the others), and for a client it is the client's
    identity (``client-3``).
    """
    if not context.peer_identities():
        return None
    # gRPC returns a list of bytes per property (its type stubs say bytes)
    auth: Mapping[str, Sequence[bytes]] = cast(Any, context.auth_context())
    names = auth.get("x509_common_name", [])
    return names[0].decode("utf-8", "replace") if names else ""


def require_peer(context: grpc.ServicerContext, client_id: str) -> None:
    """Under mutual TLS, refuse a call for ``client_id`` from a certificate of another name.

    The refusal is a :class:`PolicyError` (``PERMISSION_DENIED``). Without TLS, do nothing (the
    client's credential or signature is then the only check).
    """
    name = peer_common_name(context)
    if name is not None and name != client_id:
        raise PolicyError(f"certificate {name!r} may not act for client {client_id!r}")


#: The four kinds of gRPC method and how to build a handler of each kind.
_HANDLER_KINDS: tuple[tuple[str, Callable[..., grpc.RpcMethodHandler[Any, Any]]], ...] = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


class _RequireClientCertificate(_Interceptor):
    """Abort calls whose peer has no verified certificate, or whose role may not make them.

    The first are aborted with ``UNAUTHENTICATED``; calls from a role :data:`CALLER_ROLES` does not
    allow, with ``PERMISSION_DENIED``.

    TLS ports from :func:`bind` already refuse such peers during the handshake (the caller
    sees ``UNAVAILABLE``: gRPC's Python API cannot request a client certificate without
    requiring it); this catches calls on any port that is not mutual TLS.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        for kind, wrap in _HANDLER_KINDS:
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return wrap(
                    _authenticated(behaviour, method),
                    handler.request_deserializer,
                    handler.response_serializer,
                )
        return handler


def _authenticated(
    behavior: Callable[[Any, grpc.ServicerContext], Any], method: str
) -> Callable[[Any, grpc.ServicerContext], Any]:
    allowed = CALLER_ROLES.get(method)

    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        name = peer_common_name(context)
        if name is None:
            _log.info("refused %s from %s: no verified client certificate", method, context.peer())
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "mutual TLS required: no verified client certificate from the deployment's CA",
            )
        if allowed is not None and certificate_role(name or "") not in allowed:
            _log.info("refused %s from certificate %r: not a caller of it", method, name)
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"certificate {name!r} may not call {method.rsplit('/', 1)[-1]}: only "
                f"{', '.join(sorted(allowed))} certificates may",
            )
        return behavior(request, context)

    return guarded


@contextmanager
def rpc_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Turn expected fedps errors raised inside the block into a gRPC status.

    A :class:`~fedps.errors.FedPSError` becomes its class's status in :data:`ERROR_STATUS`
    with its message, the class named in the trailing metadata; any other ``ValueError``
    becomes ``INVALID_ARGUMENT``.
    """
    try:
        yield
    except FedPSError as exc:
        cls = wire_class(type(exc))
        context.set_trailing_metadata(((ERROR_CLASS_KEY, cls.__name__),))
        _abort(context, ERROR_STATUS[cls], str(exc))
    except ValueError as exc:
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    _log.info("refused request: %s: %s", code.name, message)
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort always raises


def call(fn: Callable[[], _T], what: str) -> _T:
    """Run a stub call; map a gRPC error to the matching fedps exception.

    A TLS handshake that failed for good (:func:`_untrusted_peer`) is this party's own
    configuration, not a peer's answer: a :class:`~fedps.errors.ConfigError` with no cause.
    """
    try:
        return fn()
    except grpc.RpcError as exc:
        untrusted = _untrusted_peer(exc, what)
        if untrusted is not None:
            raise untrusted from None
        raise _from_rpc_error(exc, what) from exc


#: Handshake failures no retry changes, as gRPC words them, and what each means.
_UNTRUSTED = (
    ("certificate has expired", "its certificate has expired, or the clock here is wrong"),
    ("CERTIFICATE_VERIFY_FAILED", "its certificate was not issued by the CA this party trusts"),
    ("Hostname Verification Check failed", "its certificate does not name the address dialled"),
)


def _untrusted_peer(exc: grpc.RpcError, what: str) -> ConfigError | None:
    """The error for a server whose TLS certificate this party refused, or None.

    The peer is reachable and answered the handshake, and the certificate it showed cannot be
    verified against this party's CA: every retry fails the same way until the configuration
    changes. The message names the CA file in use.
    """
    if not isinstance(exc, grpc.Call) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = exc.details() or ""
    reason = next((meaning for marker, meaning in _UNTRUSTED if marker in details), None)
    if reason is None:
        return None
    ca_path = getattr(tls_identity(), "ca_path", "") or "ca.crt in tls.directory"
    return ConfigError(
        f"{what}: the server's TLS certificate is refused: {reason}; this party trusts "
        f"{ca_path}: use the CA (and certificates) of the deployment that issued the servers' "
        "certificates (`fedps certs`), and dial the names they were issued for"
    )


#: The statuses a caller asks again after, with backoff: the peer is unreachable, past the
#: call's deadline, stopping (``CANCELLED``), overloaded (``RESOURCE_EXHAUSTED``, ``ABORTED``)
#: or failed inside (``UNKNOWN``: an ``OSError`` such as a full disk in a handler;
#: ``INTERNAL``). None of them is the caller's fault or an answer to its request.
TRANSIENT_STATUS: frozenset[grpc.StatusCode] = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
    }
)

#: Classes a peer names with a transient status that are final answers: asking again cannot
#: change them (a caller over its rate limit, a quarantined key holder).
_FINAL_ANSWERS = frozenset(cls.__name__ for cls in (RateLimitedError, QuarantinedError))


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc``, raised by :func:`call`, is a peer's transient failure.

    One worth the same call again later.

    True for a status in :data:`TRANSIENT_STATUS` unless the peer named a final answer with
    it (:class:`~fedps.errors.RateLimitedError`, :class:`~fedps.errors.QuarantinedError`),
    and for a :class:`~fedps.errors.PeerUnavailableError` raised without a status. False for
    everything else: the caller's own fault (``INVALID_ARGUMENT``, ``PERMISSION_DENIED``,
    ``UNAUTHENTICATED``) and answers about its request (a closed round, a spent budget, an
    unknown client).
    """
    cause = exc.__cause__
    if not isinstance(cause, grpc.RpcError):
        return isinstance(exc, PeerUnavailableError)
    if not isinstance(cause, grpc.Call):
        return True  # the transport failed without a status
    named = dict(cause.trailing_metadata() or ()).get(ERROR_CLASS_KEY)
    return cause.code() in TRANSIENT_STATUS and named not in _FINAL_ANSWERS


class Backoff:
    """Pauses between attempts: exponential with full jitter.

    The n-th pause (from 0) is drawn uniformly from ``[0, min(cap_s, first_s * 2**n)]``
    (Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015), so callers that
    lost the same peer spread out instead of coming back in lockstep.

    Parameters
    ----------
    first_s
        The ceiling of the first pause (0: no pauses at all, for tests).
    cap_s
        The largest ceiling.
    """

    def __init__(self, *, first_s: float = 0.2, cap_s: float = 2.0) -> None:
        if first_s < 0 or cap_s < first_s:
            raise ValueError("backoff needs 0 <= first_s <= cap_s")
        self._first_s, self._cap_s = first_s, cap_s
        self._ceiling = first_s

    def reset(self) -> None:
        """Start again from the first pause (after a success)."""
        self._ceiling = self._first_s

    def pause(self, stop: threading.Event | None = None) -> None:
        """Sleep the next pause (returning early once ``stop`` is set)."""
        seconds = random.uniform(0.0, self._ceiling)
        self._ceiling = min(self._ceiling * 2, self._cap_s)
        if stop is not None:
            stop.wait(seconds)
        elif seconds > 0:
            time.sleep(seconds)


def call_until(
    fn: Callable[[], _T],
    what: str,
    *,
    retry_on: type[FedPSError] | Callable[[FedPSError], bool] = is_transient,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
    backoff: Backoff | None = None,
) -> _T:
    """:func:`call`, retried until it succeeds.

    ``retry_on`` says which errors are retried: a class (its instances) or a predicate, by
    default :func:`is_transient`. Between attempts it pauses by ``backoff`` (default
    :class:`Backoff`: 0.2 s growing to 2 s, full jitter). It gives up, re-raising the last
    error, after ``timeout_s`` or once ``stop`` is set. The channel's own retry policy (a few
    quick attempts on ``UNAVAILABLE``) runs inside each attempt; this loop outlasts a peer's
    restart.
    """
    retried = (lambda exc: isinstance(exc, retry_on)) if isinstance(retry_on, type) else retry_on
    until = None if timeout_s is None else time.monotonic() + timeout_s
    backoff = backoff or Backoff()
    said = ""  # the failure last logged: a peer that stays down is said once, not every pause
    while True:
        try:
            result = call(fn, what)
        except FedPSError as exc:
            if not retried(exc):
                raise
            if (stop is not None and stop.is_set()) or (until and time.monotonic() > until):
                raise
            said = _say_waiting(exc, said)
            backoff.pause(stop)
        else:
            if said:
                _log.info("%s: the peer answers again", what)
            return result


def _say_waiting(exc: FedPSError, said: str) -> str:
    """Log that a call waits for its peer, once per distinct failure; returns what was said.

    The line carries the error (which names the call and, unreachable, the address) and what to
    do: a peer that cannot be reached may not be started yet.
    """
    text = str(exc)
    if text != said:
        hint = (
            "is it started, at this address? (retrying with backoff; said again if it changes)"
            if isinstance(exc, PeerUnavailableError)
            else "retrying with backoff"
        )
        _log.warning("%s; %s", text, hint)
    return text


def wire_class(cls: type[FedPSError]) -> type[FedPSError]:
    """The class an error of class ``cls`` crosses the wire as.

    ``cls`` itself when it is in :data:`ERROR_STATUS`, else its nearest ancestor that is.
    """
    return next(c for c in cls.__mro__ if c in ERROR_STATUS)


def _from_rpc_error(exc: grpc.RpcError, what: str) -> FedPSError:
    """The error of ours that ``exc`` stands for.

    The class its trailing metadata names when that class is in :data:`ERROR_STATUS` with the status
    received and is the status's usual class or a subclass of it (a peer cannot make a status mean
    another one), otherwise the status's usual class.
    """
    if not isinstance(exc, grpc.Call):
        return FedPSError(f"{what}: {exc}")
    code = exc.code()
    named = dict(exc.trailing_metadata() or ()).get(ERROR_CLASS_KEY)
    usual = STATUS_CLASS.get(code, FedPSError)
    cls = _BY_NAME.get(named) if isinstance(named, str) else None
    if cls is None or ERROR_STATUS[cls] != code or not issubclass(cls, usual):
        cls = usual  # so whoever catches a status's usual class catches every class it names
    return cls(f"{what}: {exc.details()}")


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
