"""Tests for fedps.rpc.transport's servers: a port in use is refused, never shared."""

from __future__ import annotations

import socket

import pytest

from fedps.errors import PeerUnavailableError
from fedps.rpc.transport import AddressInUseError, bind, create_server


def test_a_second_server_on_a_bound_port_is_refused() -> None:
    # Prepare: a fedps server listening on a loopback port
    first = create_server(max_workers=1)
    port = bind(first, "127.0.0.1:0")
    first.start()
    try:
        # Execute
        with pytest.raises(AddressInUseError) as refused:
            bind(create_server(max_workers=1), f"127.0.0.1:{port}", role="shard-0")
    finally:
        first.stop(grace=None)

    # Assert: one line naming the address and what may hold it
    message = str(refused.value)
    assert message == (
        f"127.0.0.1:{port} is in use (another fedps shard-0 may be running); stop it or "
        "choose another port"
    )
    assert isinstance(refused.value, PeerUnavailableError)


def test_a_port_another_program_listens_on_is_refused() -> None:
    # Prepare: a plain socket listening, as any other program would
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        # Execute / Assert
        with pytest.raises(AddressInUseError, match="is in use"):
            bind(create_server(max_workers=1), f"127.0.0.1:{port}")


def test_a_port_freed_by_a_stopped_server_binds_again() -> None:
    # Prepare: a server that served, then stopped
    first = create_server(max_workers=1)
    port = bind(first, "127.0.0.1:0")
    first.start()
    first.stop(grace=None).wait()
    # Execute
    second = create_server(max_workers=1)
    bound = bind(second, f"127.0.0.1:{port}")
    second.stop(grace=None)
    # Assert
    assert bound == port
