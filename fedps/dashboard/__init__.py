"""The web dashboard of ``fedps ui`` (and of ``fedps demo --ui`` / ``fedps up --ui``).

A Starlette app (:func:`create_app`) served by uvicorn in a thread (:class:`DashboardServer`):
rounds, privacy, participation, the roles' health and the configuration, live by
server-sent events from one polling thread (:class:`StatusCollector`), to the holders of the
operator's or a viewer's token; the operator starts the next run (:class:`RunLauncher`) and
stops it; every run stays, one JSON record each in the dashboard's state folder
(:class:`RunStore`), to open from the run list. A request whose Host is not the dashboard's
address is refused first (``host_guard``). See docs/dashboard.md.
"""

from fedps.dashboard.dashboard import (
    DashboardServer,
    create_app,
    new_token,
    parse_bind,
    serve_dashboard,
    write_token,
)
from fedps.dashboard.run_launcher import RunInProgressError, RunLauncher, RunNotInProgressError
from fedps.dashboard.run_store import RunStore
from fedps.dashboard.status_collector import StatusCollector

__all__ = [
    "DashboardServer",
    "RunInProgressError",
    "RunLauncher",
    "RunNotInProgressError",
    "RunStore",
    "StatusCollector",
    "create_app",
    "new_token",
    "parse_bind",
    "serve_dashboard",
    "write_token",
]
