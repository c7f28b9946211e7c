"""The dashboard's Host check: ASGI middleware that refuses a request for another name.

A web page can reach a dashboard on loopback through DNS rebinding: its domain, resolved
again to 127.0.0.1, makes the browser send the page's requests to the dashboard with the
page's own name in the ``Host`` header. :class:`HostGuard` answers such a request 421 before
the app sees it, on every path (static files included), whatever token it carries.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fedps.config import is_loopback
from fedps.errors import ConfigError

__all__ = ["HostGuard", "parse_host"]

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def parse_host(value: str) -> tuple[str, int | None] | None:
    """``NAME[:PORT]`` (an IPv6 address in brackets) as ``(name, port)``.

    The name in lower case without brackets; ``None`` if it is not that.
    """
    value = value.strip().lower()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or not name:
            return None
        if not rest:
            return name, None
        if not rest.startswith(":"):
            return None
        port = rest[1:]
    else:
        name, colon, port = value.partition(":")
        if not name or ":" in port or (colon and not port):
            return None
        if not colon:
            return name, None
    if not port.isdigit() or int(port) > 65535:
        return None
    return name, int(port)


class HostGuard:
    """Serve ``app`` only to requests whose ``Host`` names this server.

    A request passes when its ``Host`` is the address it reached (the listening socket's
    address and port; on loopback any loopback name: ``127.0.0.1``, ``localhost``,
    ``[::1]``), or one of ``names``: ``NAME`` with any port (a proxy's name) or
    ``NAME:PORT``. Any other request, one without ``Host`` included, is answered 421 with a
    one-line reason, before ``app`` sees it.

    Raises
    ------
    ConfigError
        A name is not ``NAME[:PORT]``.
    """

    def __init__(self, app: ASGIApp, names: Iterable[str] = ()) -> None:
        self._app = app
        self._names: set[tuple[str, int | None]] = set()
        for name in names:
            parsed = parse_host(name)
            if parsed is None:
                raise ConfigError(f"allowed host {name!r} is not NAME or NAME:PORT")
            self._names.add(parsed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request to ``app``, or refuse it (421; a websocket closed with 1008)."""
        if scope["type"] in ("http", "websocket"):
            reason = self.refusal(scope)
            if reason:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008, "reason": reason})
                    return
                response = PlainTextResponse(f"421: {reason}\n", status_code=421)
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def refusal(self, scope: Scope) -> str:
        """Why the request of ``scope`` is refused (``""``: it is not)."""
        header = Headers(scope=scope).get("host")
        if header is None:
            return "the request has no Host header"
        parsed = parse_host(header)
        if parsed is None:
            return f"the Host header {header!r} is not NAME[:PORT]"
        name, port = parsed
        if (name, None) in self._names or (name, port) in self._names:
            return ""
        server = scope.get("server")
        if server is not None:
            local, local_port = str(server[0]).lower(), server[1]
            port = _DEFAULT_PORTS.get(scope["scheme"], 80) if port is None else port
            if port == local_port and (name == local or (is_loopback(local) and is_loopback(name))):
                return ""
        return (
            f"Host {header!r} is not this dashboard's address; to serve it under another "
            "name, start it with --allowed-host NAME (fedps up or demo: --ui-allowed-host)"
        )
