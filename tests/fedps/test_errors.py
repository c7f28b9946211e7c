"""The error table both ways (fedps/errors.py, fedps/rpc/transport.py): every error class of ours
that crosses the wire comes back as the same class with the same message, through a real gRPC
server on loopback."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import fedps.errors
from fedps.errors import FedPSError, InvalidArgumentError, PolicyError
from fedps.rpc.transport import (
    ERROR_CLASS_KEY,
    ERROR_STATUS,
    STATUS_CLASS,
    bind,
    call,
    create_channel,
    create_server,
    rpc_errors,
    wire_class,
)

_ROOT = Path(__file__).resolve().parents[2]
# The code a servicer runs: the roles' handlers and what they use (not the commands and the layers
# that compose the roles (runtime, experiments, bench, dashboard), not
# Flower interop, not generated code).
_SERVICER_CODE = ("server", "fedps", "crypto")
_NOT_SERVICER_CODE = (
    "server/flower",
    "fedps/cli",
    "fedps/runtime",
    "fedps/experiments",
    "fedps/bench",
    "fedps/dashboard",
    "fedps/proto",
)
_SERVICE = "fedps.test.Errors"


class _RoleError(PolicyError):
    """A role's own error class, like the key holder's ``TamperingError``."""


def _raise(name: str, message: str) -> None:
    """What the test servicer does for a request ``name:message``."""
    if name == "ValueError":
        raise ValueError(message)
    if name == "_RoleError":
        raise _RoleError(message)
    if name == "forged":  # a peer naming a class whose status is another one
        raise _ForgedError(message)
    raise vars(fedps.errors)[name](message)


class _ForgedError(Exception):
    """Makes the test servicer name a class whose status is not the one it sends."""


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    name, _, message = request.decode().partition(":")
    try:
        with rpc_errors(context):
            _raise(name, message)
    except _ForgedError:
        context.set_trailing_metadata(((ERROR_CLASS_KEY, "QuarantinedError"),))
        context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
    return b""


def _stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first"
    _unary(request, context)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = create_server(max_workers=2)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                _SERVICE,
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(_unary),
                    "Stream": grpc.unary_stream_rpc_method_handler(_stream),
                },
            ),
        )
    )
    port = bind(server, "127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def _unary_call(address: str, name: str, message: str) -> Callable[[], bytes]:
    method = create_channel(address).unary_unary(
        f"/{_SERVICE}/Unary", request_serializer=None, response_deserializer=None
    )
    return lambda: method(f"{name}:{message}".encode(), timeout=10)


def _stream_call(address: str, name: str, message: str) -> Callable[[], list[bytes]]:
    method = create_channel(address).unary_stream(
        f"/{_SERVICE}/Stream", request_serializer=None, response_deserializer=None
    )
    return lambda: list(method(f"{name}:{message}".encode(), timeout=10))


@pytest.mark.parametrize("cls", list(ERROR_STATUS), ids=lambda cls: cls.__name__)
def test_every_class_in_the_table_comes_back_as_itself(address: str, cls: type[Exception]) -> None:
    # Prepare
    message = f"{cls.__name__} refused: block 3 of round 7"

    # Execute
    with pytest.raises(FedPSError) as unary:
        call(_unary_call(address, cls.__name__, message), "unary")
    with pytest.raises(FedPSError) as stream:
        call(_stream_call(address, cls.__name__, message), "stream")
    with pytest.raises(grpc.RpcError) as raw:
        _unary_call(address, cls.__name__, message)()

    # Assert: the same class, the same message, and the status of the table
    assert type(unary.value) is cls and str(unary.value) == f"unary: {message}"
    assert type(stream.value) is cls and str(stream.value) == f"stream: {message}"
    assert isinstance(raw.value, grpc.Call)
    assert raw.value.code() == ERROR_STATUS[cls] and raw.value.details() == message


def test_a_role_s_own_class_crosses_as_its_nearest_class_in_the_table(address: str) -> None:
    # Execute
    with pytest.raises(FedPSError) as info:
        call(_unary_call(address, "_RoleError", "tampered"), "apply")

    # Assert
    assert type(info.value) is PolicyError and str(info.value) == "apply: tampered"


def test_a_value_error_and_a_forged_class_name_come_back_by_status(address: str) -> None:
    # Execute
    with pytest.raises(FedPSError) as value_error:
        call(_unary_call(address, "ValueError", "bad size"), "push")
    with pytest.raises(FedPSError) as forged:
        call(_unary_call(address, "forged", "no"), "apply")

    # Assert: a name that does not match the status is ignored
    assert type(value_error.value) is InvalidArgumentError
    assert str(value_error.value) == "push: bad size"
    assert type(forged.value) is PolicyError


def test_every_class_a_status_can_name_is_caught_as_the_status_s_usual_class() -> None:
    # A peer names the class of its error; a caller that catches what a status meant before
    # classes were named (RoundClosedError for FAILED_PRECONDITION, ...) must still catch it.
    for cls, code in ERROR_STATUS.items():
        usual = STATUS_CLASS.get(code, FedPSError)
        # Assert
        assert issubclass(cls, usual), f"{cls.__name__} would escape `except {usual.__name__}`"


def test_the_table_holds_every_class_of_fedps_errors() -> None:
    # Prepare
    classes = {
        obj
        for obj in vars(fedps.errors).values()
        if inspect.isclass(obj) and issubclass(obj, FedPSError)
    }

    # Assert
    assert classes == set(ERROR_STATUS)
    assert len({cls.__name__ for cls in ERROR_STATUS}) == len(ERROR_STATUS)


def _raised_classes() -> Iterator[tuple[str, int, type[FedPSError]]]:
    """``(file, line, class)`` for every ``raise X(...)`` of servicer code whose ``X`` is one
    of our error classes."""
    for package in _SERVICER_CODE:
        for path in sorted((_ROOT / package).rglob("*.py")):
            relative = path.relative_to(_ROOT).as_posix()
            if relative.startswith(_NOT_SERVICER_CODE):
                continue
            module = importlib.import_module(relative.removesuffix(".py").replace("/", "."))
            for node in ast.walk(ast.parse(path.read_text(), relative)):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                obj = _resolve(module, target)
                if inspect.isclass(obj) and issubclass(obj, FedPSError):
                    yield relative, node.lineno, obj


def _resolve(module: object, node: ast.expr) -> object:
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    if isinstance(node, ast.Attribute):
        return getattr(_resolve(module, node.value), node.attr, None)
    return None


def test_every_error_class_a_servicer_raises_is_in_the_table() -> None:
    # Prepare
    raised = list(_raised_classes())

    # Assert: a class of fedps.errors is in the table; a role's own class crosses as a class of
    # the table more specific than the root (a status that says what went wrong)
    assert {cls for _, _, cls in raised} >= {InvalidArgumentError, PolicyError}
    for file, line, cls in raised:
        if cls.__module__ == "fedps.errors":
            assert cls in ERROR_STATUS, f"{file}:{line}: {cls.__name__} is not in ERROR_STATUS"
        else:
            assert wire_class(cls) is not FedPSError, (
                f"{file}:{line}: {cls.__name__} crosses the wire as the bare FedPSError: derive "
                "it from a class of fedps.errors"
            )
