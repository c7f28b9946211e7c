"""A client's peers' refusals counted and told apart from its own faults
(clients/peer_failures.py), with the refusals a real gRPC server on loopback gives."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients.peer_failures import (
    COORDINATOR,
    KEY_HOLDER,
    PeerFailures,
    failures_text,
    from_peer,
    own_fault,
)
from fedps.errors import (
    ConfigError,
    CorruptStateError,
    FedPSError,
    InvalidArgumentError,
    PeerUnavailableError,
    UnauthenticatedError,
)
from fedps.rpc.transport import (
    ERROR_CLASS_KEY,
    ERROR_STATUS,
    bind,
    call,
    create_channel,
    create_server,
)

_SERVICE = "probe.Probe"


def _refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Answer with the status of the class the request names, naming that class."""
    named = {cls.__name__: cls for cls in ERROR_STATUS}[request.decode()]
    context.set_trailing_metadata(((ERROR_CLASS_KEY, named.__name__),))
    context.abort(ERROR_STATUS[named], f"the peer says {named.__name__}")
    raise AssertionError("unreachable")  # context.abort always raises


@pytest.fixture(scope="module")
def peer() -> Iterator[grpc.Channel]:
    """A channel to a real server whose ``Refuse`` names whatever class it is asked to, and
    which implements nothing else."""
    server = create_server(max_workers=2)
    handler = grpc.unary_unary_rpc_method_handler(_refuse)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE, {"Refuse": handler}),)
    )
    port = bind(server, "127.0.0.1:0")
    server.start()
    channel = create_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(grace=None)


def _answer(channel: grpc.Channel, method: str, request: bytes = b"") -> FedPSError:
    """What the caller raises for the peer's answer to ``method``."""
    stub = channel.unary_unary(f"/{_SERVICE}/{method}", None, None)
    with pytest.raises(FedPSError) as caught:
        call(lambda: stub(request, timeout=10), method)
    return caught.value


def _failures() -> PeerFailures:
    return PeerFailures("edge-0", identity="client-0", tls_directory=Path("/etc/fedps/certs"))


def test_a_peer_that_names_the_clients_own_faults_is_not_the_clients_fault(
    peer: grpc.Channel,
) -> None:
    # Execute: the peer names ConfigError, CorruptStateError; the client finds its own
    classes = (ConfigError, CorruptStateError)
    named = [_answer(peer, "Refuse", cls.__name__.encode()) for cls in classes]
    own = [ConfigError("my configuration"), CorruptStateError("my state folder")]

    # Assert: the same classes, but only the client's own end it
    assert [type(e) for e in named] == [ConfigError, CorruptStateError]
    assert all(from_peer(e) and not own_fault(e) for e in named)
    assert all(not from_peer(e) and own_fault(e) for e in own)
    assert from_peer(PeerUnavailableError("unreachable"))
    assert not own_fault(InvalidArgumentError("my request"))


def test_refusals_are_counted_by_peer_and_reason_and_shown_once(peer: grpc.Channel) -> None:
    # Prepare: a named class, a bare status (a method the peer does not have), a local error
    failures = _failures()
    refused = _answer(peer, "Refuse", b"InvalidArgumentError")
    unimplemented = _answer(peer, "Missing")

    # Execute
    failures.failed("shard-1", refused)
    failures.failed("shard-1", refused)
    failures.failed(KEY_HOLDER, unimplemented)
    shown = failures.take_refused()

    # Assert: by "peer: reason", a bare status by its name; the refusals are taken once
    assert failures.counts == {"shard-1: invalid_argument": 2, "key holder: unimplemented": 1}
    assert failures.total == 3
    assert shown == ("shard-1 (invalid_argument)",) * 2 + ("key holder (unimplemented)",)
    assert failures.take_refused() == ()


def test_only_the_latest_32_refusals_are_shown_but_all_are_counted() -> None:
    # Prepare
    failures = _failures()

    # Execute
    for i in range(40):
        failures.failed(f"shard-{i}", PeerUnavailableError("down"))

    # Assert
    shown = failures.take_refused()
    assert len(shown) == 32 and shown[0] == "shard-8 (peer_unavailable)"
    assert failures.total == 40


def test_a_refused_credential_names_the_token_to_check(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare
    failures = _failures()

    # Execute: the coordinator refuses the credential; a commitment after its round closed
    with caplog.at_level(logging.INFO, logger="fedps"):
        failures.failed(COORDINATOR, UnauthenticatedError("bad token"))
        failures.failed(KEY_HOLDER, InvalidArgumentError("closed"), expected=True)

    # Assert: a warning that names the token's folder; the expected one is only news
    warning, info = caplog.records
    assert warning.levelno == logging.WARNING
    assert "client-0's enrolment token (/etc/fedps/certs)" in warning.getMessage()
    assert "1 peer failure so far" in warning.getMessage()
    assert info.levelno == logging.INFO and "2 peer failures so far" in info.getMessage()


def test_failures_text_counts_in_words() -> None:
    # Execute / Assert
    assert [failures_text(n) for n in (1, 3)] == ["1 peer failure", "3 peer failures"]
