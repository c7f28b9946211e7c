"""A second "host" on this machine: a Linux network namespace on a veth pair, whose link a test
can cut for good.

:func:`isolated_host` creates a namespace and a veth pair on a free ``10.78.N.0/24``: the
namespace's end has ``10.78.N.2/30`` and a default route through the host's end
(``10.78.N.1/30``); the host also gets ``10.78.N.5/32`` on its loopback device, the address the
roles outside the namespace listen on, which stays when the link goes (an address on the veth
would go with it). :meth:`IsolatedHost.cut` deletes the link: from then on nothing outside
reaches the namespace, and nothing inside reaches out. The namespace, the link and the address
are removed on exit, however the block ends. Where namespaces cannot be made (not Linux, no
iproute2, not root), the test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

__all__ = ["IsolatedHost", "isolated_host", "namespaces_unavailable"]

#: Names of this process's namespaces and links (a run beside this one has another pid).
_PREFIX = f"fpn{os.getpid() % 100000}"


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _ip_output(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make a network namespace, or None when it can."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux with iproute2 (ip netns)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"{_PREFIX}probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot create a network namespace: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def _free_subnet() -> str:
    """A ``10.78.N`` that no route or address on this host uses yet."""
    used = _ip_output("-4", "route") + _ip_output("-4", "addr")
    for n in range(256):
        if f"10.78.{n}." not in used:
            return f"10.78.{n}"
    raise RuntimeError("no free 10.78.N.0/24 subnet for a test host")


@dataclass(frozen=True)
class IsolatedHost:
    """A namespace on a veth pair: ``inside`` is its address, ``outside`` the host's."""

    namespace: str
    link: str  # the host's end of the veth pair
    inside: str
    outside: str

    @property
    def prefix(self) -> list[str]:
        """The words that start a command inside the namespace."""
        return ["ip", "netns", "exec", self.namespace]

    def cut(self) -> None:
        """Delete the link for good (both ends of the veth pair go)."""
        _ip("link", "del", self.link)


@contextmanager
def isolated_host() -> Iterator[IsolatedHost]:
    """A namespace on its own veth pair, removed on exit; skips the test where none can be made."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    subnet = _free_subnet()
    host = IsolatedHost(f"{_PREFIX}ns", f"{_PREFIX}v", f"{subnet}.2", f"{subnet}.5")
    peer = f"{_PREFIX}p"
    _ip("netns", "add", host.namespace)
    try:
        _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.namespace)
        _ip("addr", "add", f"{subnet}.1/30", "dev", host.link)
        _ip("link", "set", host.link, "up")
        _ip("addr", "add", f"{host.outside}/32", "dev", "lo")
        _ip("addr", "add", f"{host.inside}/30", "dev", peer, netns=host.namespace)
        _ip("link", "set", peer, "up", netns=host.namespace)
        _ip("link", "set", "lo", "up", netns=host.namespace)
        _ip("route", "add", "default", "via", f"{subnet}.1", netns=host.namespace)
        yield host
    finally:
        for made in (
            ["addr", "del", f"{host.outside}/32", "dev", "lo"],
            ["link", "del", host.link],  # gone already once cut
            ["netns", "del", host.namespace],
        ):
            subprocess.run(["ip", *made], capture_output=True)
