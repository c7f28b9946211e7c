"""The dashboard's web app (Starlette) and its server (uvicorn in a thread).

Routes
------
Every request first passes the Host check (:class:`~fedps.dashboard.host_guard.HostGuard`,
421 otherwise): its ``Host`` must be the dashboard's address or an allowed name.

``GET /``
    The page (``static/index.html``; plain JavaScript and inline SVG, nothing fetched from
    elsewhere). ``/?token=T`` with the operator's or the viewer's token sets its cookie
    (HttpOnly, SameSite=Strict) and redirects to ``/``, so the token leaves the address bar.
``GET /api/snapshot``
    Readers (below): the latest snapshot
    (:class:`~fedps.dashboard.status_collector.StatusCollector`).
``GET /api/events``
    Readers: server-sent events, one snapshot (``data: JSON``) at once, then whenever it
    changes and at least every second.
``GET /api/session``
    Readers: whether the viewer is the operator, whether runs can be started here, and the
    form's defaults.
``POST /api/runs``
    Operator only (the cookie or ``Authorization: Bearer T``; 403 otherwise): start the next
    run with the JSON body's settings (``{"training.rounds": "5", ...}``). 422 with
    ``{"errors": {field: message}}`` for invalid settings, 409 while a run is in progress,
    202 with the run's state folder once started.
``GET /api/runs``
    Readers: ``{"runs": [...]}``, one line per run of the dashboard's state folder, the latest
    first (:meth:`~fedps.dashboard.run_store.RunStore.summaries`).
``GET /api/runs/{id}``
    Readers: the run's record (what the page shows of it) with ``files``, what of it can be
    downloaded. 400 for an id that cannot name a run, 404 for an unknown one.
``POST /api/runs/{id}/stop``
    Operator only (403 otherwise): stop run ``id``, in progress from this dashboard, with
    every process it started; 200 once stopped, 404 for an unknown run, 409 for a run not in
    progress here.
``GET /api/runs/{id}/model`` and ``GET /api/runs/{id}/logs/{name}``
    Operator only (403 otherwise): the model the run exported (``model.pt``, a ``state_dict``),
    and one of its processes' logs (a name ``files`` lists; 404 otherwise).

The run (the configuration, which holds addresses and paths but never a key; the client ids
with their epsilon; the detections) is read by the holders of the operator's or the viewer's
token only (its cookie or ``Authorization: Bearer T``; 401 otherwise, 403 from a page of
another origin), unless the dashboard is public; only the operator changes anything.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from fedps.config import FedPSConfig, is_loopback
from fedps.dashboard.host_guard import HostGuard
from fedps.dashboard.run_launcher import RunInProgressError, RunLauncher, RunNotInProgressError
from fedps.dashboard.run_store import RunStore
from fedps.dashboard.status_collector import StatusCollector
from fedps.errors import ConfigError, FedPSError

__all__ = [
    "COOKIE",
    "VIEWER_COOKIE",
    "DashboardServer",
    "create_app",
    "new_token",
    "parse_bind",
    "serve_dashboard",
    "write_token",
]

#: The operator cookie's name.
COOKIE = "fedps_operator"
#: The viewer cookie's name (read-only).
VIEWER_COOKIE = "fedps_viewer"
#: Longest interval between two events of the stream (seconds).
HEARTBEAT_S = 1.0
#: How often an event stream looks for a new snapshot (seconds).
POLL_S = 0.2

_log = logging.getLogger("fedps")

_STATIC = resources.files("fedps.dashboard") / "static"


def new_token() -> str:
    """A fresh random operator token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def _viewer_token(token: str) -> str:
    """The viewer token that goes with the operator's ``token``.

    It is as stable as it (with ``--token-file``), and there is no way back to it (an HMAC).
    """
    digest = hmac.new(token.encode(), b"fedps dashboard viewer", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _same(presented: str, expected: str | None) -> bool:
    """Whether ``presented`` is ``expected`` (constant time; no or an empty token: never)."""
    return bool(expected) and hmac.compare_digest(presented.encode(), (expected or "").encode())


def write_token(path: Path, token: str) -> None:
    """Write ``token`` to ``path``, readable by its owner only (mode 600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(token + "\n")


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) as ``(host, port)``.

    Raises
    ------
    ConfigError
        Not ``HOST:PORT``.
    """
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"dashboard address {bind!r} is not HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def create_app(
    collector: StatusCollector,
    *,
    token: str | None = None,
    viewer_token: str | None = None,
    launcher: RunLauncher | None = None,
    public: bool = False,
    allowed_hosts: Sequence[str] = (),
    store: RunStore | None = None,
) -> ASGIApp:
    """The dashboard of ``collector``'s cluster, behind its Host check.

    ``token``: the operator's token (``None``: nobody is the operator, the page is read-only).
    ``viewer_token``: a token that reads the run and changes nothing (``None``: none).
    ``launcher``: starts runs for the operator (``None``: this dashboard starts nothing, as
    beside ``fedps demo`` or ``fedps up``).
    ``public``: everyone who reaches the port reads the run, without a token.
    ``allowed_hosts``: names (``NAME`` or ``NAME:PORT``) served besides the address reached,
    such as a proxy's (:class:`~fedps.dashboard.host_guard.HostGuard`).
    ``store``: the runs of the dashboard's state folder (``None``: none are listed).

    Raises
    ------
    ConfigError
        An allowed host is not ``NAME[:PORT]``.
    """

    def foreign(request: Request) -> bool:
        """Whether the request comes from a page of another origin.

        Even one that has the cookies sent.
        """
        origin = request.headers.get("origin")
        return origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}"

    def presented(request: Request) -> list[str]:
        """The tokens the request presents (none from a page of another origin)."""
        if foreign(request):
            return []
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return [auth[7:].strip()]
        return [request.cookies.get(COOKIE, ""), request.cookies.get(VIEWER_COOKIE, "")]

    def is_operator(request: Request) -> bool:
        return any(_same(offered, token) for offered in presented(request))

    def operator_only(
        what: str,
    ) -> Callable[
        [Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]
    ]:
        """Answer 403 with ``only the operator WHAT`` to anyone but the operator."""

        def wrap(
            handler: Callable[[Request], Awaitable[Response]],
        ) -> Callable[[Request], Awaitable[Response]]:
            async def guarded(request: Request) -> Response:
                if not is_operator(request):
                    return _error(f"only the operator {what}: present the operator token", 403)
                return await handler(request)

            return guarded

        return wrap

    def run_of(request: Request) -> tuple[str, Response | None]:
        """The run the path names, or the answer that refuses it (400, 404)."""
        run_id = request.path_params["run_id"]
        try:
            RunStore.check_id(run_id)
        except ValueError as exc:
            return run_id, _error(str(exc), 400)
        if store is None or store.get(run_id) is None:
            return run_id, _error(f"no run {run_id} in this dashboard's state folder", 404)
        return run_id, None

    def read_refusal(request: Request) -> Response | None:
        """``None`` if the request may read the run, else the answer that refuses it."""
        offered = presented(request)
        if public or any(_same(t, token) or _same(t, viewer_token) for t in offered):
            return None
        if foreign(request):
            return JSONResponse(
                {"error": "a page of another origin does not read this dashboard"},
                status_code=403,
            )
        return JSONResponse(
            {
                "error": "present this dashboard's token: open the link (/?token=...) that "
                "fedps printed when it started, or send Authorization: Bearer TOKEN"
            },
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    def readers_only(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            return read_refusal(request) or await handler(request)

        return guarded

    async def index(request: Request) -> Response:
        offered = request.query_params.get("token")
        if offered is not None:
            if _same(offered, token):
                cookie = COOKIE
            elif _same(offered, viewer_token):
                cookie = VIEWER_COOKIE
            else:
                return PlainTextResponse(
                    "403: this is not a token of this dashboard (they change at every start "
                    "unless fedps ui is given --token-file)",
                    status_code=403,
                )
            response: Response = RedirectResponse("/", status_code=303)
            response.set_cookie(
                cookie, offered, httponly=True, samesite="strict", secure=request.url.is_secure
            )
            return response
        html = (_STATIC / "index.html").read_text()
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @readers_only
    async def snapshot(request: Request) -> Response:
        return JSONResponse(collector.snapshot()[1])

    @readers_only
    async def session(request: Request) -> Response:
        operator = is_operator(request)
        defaults: dict[str, Any] = {}
        if launcher is not None:
            try:
                defaults = await asyncio.to_thread(launcher.defaults)
            except ConfigError as exc:  # the file was edited badly: the page still shows
                return JSONResponse(
                    {
                        "operator": operator,
                        "can_start": False,
                        "reason": f"the configuration does not load: {exc}",
                        "defaults": {},
                        "local_clients": launcher.local_clients,
                    }
                )
        if launcher is None:
            reason = "this dashboard watches a run started elsewhere; start runs from fedps ui"
        elif not operator:
            reason = (
                "read-only: only the operator starts runs (open the operator's link that "
                "fedps ui printed)"
            )
        else:
            reason = ""
        body: dict[str, Any] = {
            "operator": operator,
            "can_start": operator and launcher is not None,
            "reason": reason,
            "defaults": defaults,
            "local_clients": launcher is not None and launcher.local_clients,
        }
        return JSONResponse(body)

    @readers_only
    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            # The loop awaits on the event loop only: a stream holds no worker thread, so
            # open streams (anyone's) cannot starve the operator's requests.
            serial, data = collector.snapshot()
            yield f"data: {json.dumps(data)}\n\n"
            sent = loop.time()
            while not collector.stopped:
                await asyncio.sleep(POLL_S)
                if await request.is_disconnected():
                    return
                latest, data = collector.snapshot()
                if latest != serial or loop.time() - sent >= HEARTBEAT_S:
                    serial, sent = latest, loop.time()
                    yield f"data: {json.dumps(data)}\n\n"

        loop = asyncio.get_running_loop()

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    @operator_only("starts runs")
    async def start_run(request: Request) -> Response:
        if launcher is None:
            return JSONResponse(
                {"error": "this dashboard starts no runs (it watches fedps demo or up)"},
                status_code=403,
            )
        try:
            form = await request.json()
        except ValueError:
            return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
        if not isinstance(form, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
        try:
            config = await asyncio.to_thread(launcher.start, form)
        except ConfigError as exc:
            errors = exc.fields or {"form": str(exc)}
            return JSONResponse({"errors": errors}, status_code=422)
        except RunInProgressError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        except (FedPSError, OSError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=500)
        collector.poke()
        return JSONResponse({"state_dir": str(config.cluster.state_dir)}, status_code=202)

    @readers_only
    async def list_runs(request: Request) -> Response:
        return JSONResponse({"runs": [] if store is None else store.summaries()})

    @readers_only
    async def one_run(request: Request) -> Response:
        run_id, refusal = run_of(request)
        if refusal is not None or store is None:
            return refusal or _error("no runs here", 404)
        return JSONResponse({**(store.get(run_id) or {}), "files": store.files(run_id)})

    @operator_only("stops runs")
    async def stop_run(request: Request) -> Response:
        run_id, refusal = run_of(request)
        if refusal is not None:
            return refusal
        if launcher is None:
            return _error("this dashboard stops no runs (it watches fedps demo or up)", 403)
        try:
            if not run_id.isdigit():
                raise RunNotInProgressError(f"run {run_id} was not started from this dashboard")
            await asyncio.to_thread(launcher.stop_run, int(run_id))
        except RunNotInProgressError as exc:
            return _error(str(exc), 409)
        collector.poke()
        return JSONResponse({"stopped": run_id})

    @operator_only("downloads a run's files")
    async def model(request: Request) -> Response:
        run_id, refusal = run_of(request)
        path = None if store is None else store.model_path(run_id)
        if refusal is not None or path is None:
            return refusal or _error(f"run {run_id} exported no model", 404)
        return FileResponse(path, filename=f"fedps-run-{run_id}-model.pt")

    @operator_only("downloads a run's files")
    async def log(request: Request) -> Response:
        run_id, refusal = run_of(request)
        name = request.path_params["name"]
        path = None if store is None else store.log_path(run_id, name)
        if refusal is not None or path is None:
            return refusal or _error(f"run {run_id} has no log {name!r}", 404)
        return FileResponse(
            path, media_type="text/plain; charset=utf-8", filename=f"fedps-run-{run_id}-{name}"
        )

    routes = [
        Route("/", index),
        Route("/api/snapshot", snapshot),
        Route("/api/session", session),
        Route("/api/events", events),
        Route("/api/runs", start_run, methods=["POST"]),
        Route("/api/runs", list_runs, methods=["GET"]),
        Route("/api/runs/{run_id}", one_run, methods=["GET"]),
        Route("/api/runs/{run_id}/stop", stop_run, methods=["POST"]),
        Route("/api/runs/{run_id}/model", model, methods=["GET"]),
        Route("/api/runs/{run_id}/logs/{name}", log, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=str(_STATIC)), name="static"),
    ]
    return HostGuard(Starlette(routes=routes), allowed_hosts)


class DashboardServer:
    """Serves ``app`` with uvicorn in a daemon thread (port 0: any free port).

    Call :meth:`start`, read :attr:`port`, and :meth:`stop` at the end. Uvicorn's access log
    is off: a request line can carry the operator token.
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, name="fedps-dashboard-http", daemon=True
        )
        self.port = port

    @property
    def remote(self) -> bool:
        """Whether the address is reachable from other machines (not loopback)."""
        return not is_loopback(self.host)

    def url(self, token: str | None = None) -> str:
        """The page's address (with ``token``: the link that opens it with ``token``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        query = f"/?token={token}" if token else "/"
        return f"http://{host}:{self.port}{query}"

    def start(self) -> DashboardServer:
        """Start serving; returns once the port is bound.

        Raises
        ------
        FedPSError
            The address cannot be bound (in use, not an address of this machine).
        """
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise FedPSError(f"the dashboard cannot listen on {self.host}:{self.port}")
            self._thread.join(0.02)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        """Stop serving (open event streams are closed)."""
        self._server.should_exit = True
        self._thread.join(10)


def _error(message: str, status: int) -> JSONResponse:
    """A refusal the page shows: ``{"error": message}`` with HTTP ``status``."""
    return JSONResponse({"error": message}, status_code=status)


def _is_name(host: str) -> bool:
    """Whether ``host`` is a name (not an IP address, nor empty: every address)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(host)
    return False


def _training_elsewhere(collector: StatusCollector) -> str:
    """Why no run may start: the followed coordinator trains a run not finished yet."""
    snapshot = collector.snapshot()[1]
    run, coordinator = snapshot.get("run"), snapshot.get("coordinator")
    if run and coordinator and coordinator["up"] and not run["finished"]:
        return (
            f"the coordinator at {coordinator['address']} is training run {run['run_id']}; "
            "start the next one once it has finished"
        )
    return ""


def _open_store(config: FedPSConfig | None, launcher: RunLauncher | None) -> RunStore | None:
    """The runs of the dashboard's state folder (``None``: it has none, no configuration).

    Raises
    ------
    FedPSError
        The folder cannot be created.
    """
    root = launcher.state_root if launcher is not None else None
    if root is None and config is not None:
        root = config.cluster.state_dir
    if root is None:
        return None
    try:
        return RunStore.open(root / "dashboard")
    except OSError as exc:
        raise FedPSError(
            f"cannot create the dashboard's state folder {root / 'dashboard'}: "
            f"{exc.strerror or exc}"
        ) from None


@contextmanager
def serve_dashboard(
    config: FedPSConfig | None,
    bind: str,
    *,
    echo: Callable[[str], None],
    token: str | None = None,
    launcher: RunLauncher | None = None,
    public: bool = False,
    allowed_hosts: Sequence[str] = (),
) -> Iterator[StatusCollector]:
    """Serve the dashboard of ``config``'s cluster on ``bind`` (``HOST:PORT``) inside the block.

    Poll the cluster, serve the page, ``echo`` its links once, and stop both at the end. Yields the
    collector (``follow`` switches cluster). A launcher's runs are followed as they start. The
    runs seen are kept in the dashboard's state folder, ``dashboard/`` in the launcher's state
    root (else in ``config``'s state folder): one JSON record each
    (:class:`~fedps.dashboard.run_store.RunStore`).

    The run is read with a viewer token (derived from ``token``, else new at each start),
    whose link is echoed, beside the operator's link with ``token``; ``public``: by everyone
    who reaches the port, without a token (warns). ``allowed_hosts``: names served besides
    the address (:func:`create_app`).

    Raises
    ------
    ConfigError
        ``bind`` is not ``HOST:PORT``, or an allowed host is not ``NAME[:PORT]``.
    FedPSError
        The address cannot be bound, or the dashboard's state folder cannot be created.
    """
    host, port = parse_bind(bind)
    viewer = None if public else _viewer_token(token) if token else new_token()
    names = [*allowed_hosts, *([host] if _is_name(host) else [])]
    store = _open_store(config, launcher)
    extra = launcher.state if launcher is not None else None
    collector = StatusCollector(config, extra=extra, store=store)
    if launcher is not None:
        launcher.on_change = collector.follow
        launcher.busy = lambda: _training_elsewhere(collector)
        launcher.store = store
    app = create_app(
        collector,
        token=token,
        viewer_token=viewer,
        launcher=launcher,
        public=public,
        allowed_hosts=names,
        store=store,
    )
    server = DashboardServer(app, host, port)
    collector.start()
    try:
        server.start()
        if public:
            _log.warning(
                "the dashboard is public (--public): anyone who can reach %s:%d reads the run "
                "without a token (its configuration, the client ids with their epsilon, the "
                "detections)",
                host,
                server.port,
            )
        if server.remote:
            _log.warning(
                "the dashboard listens on %s, which is not loopback: its page is plain HTTP, "
                "so its tokens cross the network in the clear unless a TLS proxy fronts it",
                host,
            )
        if token is not None:
            echo(f"dashboard: {server.url(viewer)} (operator: {server.url(token)})")
        else:
            echo(f"dashboard (read-only): {server.url(viewer)}")
        yield collector
    finally:
        server.stop()
        collector.stop()
