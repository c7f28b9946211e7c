"""Who reads the dashboard: attacks on a real HTTP server on 127.0.0.1 (port 0).

A local user or a web page (through DNS rebinding, its Host header then names the
attacker's domain) must not read the run: the configuration, the client ids with their
epsilon, the detections. Reads need the operator's or the viewer's token unless the
dashboard is started public; a Host that is not the dashboard's address is refused on every
path, before anything else, token or not.
"""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from fedps.config import FedPSConfig
from fedps.dashboard import (
    DashboardServer,
    RunLauncher,
    StatusCollector,
    create_app,
    serve_dashboard,
)

pytestmark = pytest.mark.attack

TOKEN = "operator-token-for-tests-0123456789"
VIEWER = "viewer-token-for-tests-0123456789"
READS = ["/api/snapshot", "/api/events", "/api/session"]
EVERY_PATH = ["/", "/static/dashboard.js", f"/?token={TOKEN}", *READS]


@contextmanager
def _serve(collector: StatusCollector, **options: Any) -> Iterator[httpx.Client]:
    """The dashboard of ``collector`` on 127.0.0.1 (a free port), and a client for it."""
    collector.stop()  # a stopped collector ends each event stream after its first event
    server = DashboardServer(create_app(collector, **options)).start()
    try:
        with _browser(server.url()) as client:
            yield client
    finally:
        server.stop()


def _browser(base_url: str = "") -> httpx.Client:
    """A client that follows redirects and keeps cookies, as a browser does."""
    return httpx.Client(base_url=base_url, timeout=30, follow_redirects=True)


def _port(client: httpx.Client) -> int:
    port = client.base_url.port
    assert port is not None
    return port


def _get(client: httpx.Client, path: str, **kwargs: Any) -> tuple[int, str]:
    """Status and body of ``GET path`` (an event stream: up to its first event)."""
    with client.stream("GET", path, **kwargs) as response:
        body = ""
        for line in response.iter_lines():
            body += line + "\n"
            if line.startswith("data: "):
                break
        return response.status_code, body


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("path", READS)
def test_reading_the_run_without_a_token_is_refused(
    collector: StatusCollector, config: FedPSConfig, path: str
) -> None:
    # Prepare
    with _serve(collector, token=TOKEN, viewer_token=VIEWER) as client:
        # Execute
        status, body = _get(client, path)
        wrong, _ = _get(client, path, headers=_bearer("guess-guess-guess-guess"))
        client.cookies.set("fedps_viewer", "guess-guess-guess-guess")
        wrong_cookie, _ = _get(client, path)

    # Assert: nothing of the run comes back
    assert status == 401
    assert wrong == 401
    assert wrong_cookie == 401
    assert config.cluster.coordinator not in body
    assert "token" in json.loads(body)["error"]


def test_a_page_of_another_site_cannot_read_with_the_viewer_cookie(
    collector: StatusCollector,
) -> None:
    # Prepare: the viewer's cookie is set; the request comes from a page of another origin
    with _serve(collector, token=TOKEN, viewer_token=VIEWER) as client:
        client.cookies.set("fedps_viewer", VIEWER)

        # Execute
        status, _ = _get(client, "/api/snapshot", headers={"Origin": "http://evil.example"})

    # Assert
    assert status == 403


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1:1", "localhost:1"])
@pytest.mark.parametrize("path", EVERY_PATH)
def test_a_foreign_host_is_refused_even_with_the_token(
    collector: StatusCollector, host: str, path: str
) -> None:
    # Prepare: DNS rebinding (evil.example now resolves to 127.0.0.1), or another port
    with _serve(collector, token=TOKEN, viewer_token=VIEWER) as client:
        header = f"{host}:{_port(client)}" if host == "evil.example" else host

        # Execute
        status, body = _get(client, path, headers={"Host": header, **_bearer(TOKEN)})
        start = client.post(
            "/api/runs", json={"training.rounds": "3"}, headers={"Host": header, **_bearer(TOKEN)}
        )

    # Assert: one line that says why
    assert status == 421
    assert start.status_code == 421
    assert body.strip().count("\n") == 0
    assert header in body
    assert "--allowed-host" in body


def test_a_public_dashboard_still_refuses_a_foreign_host(collector: StatusCollector) -> None:
    # Prepare
    with _serve(collector, token=TOKEN, public=True) as client:
        # Execute
        status, _ = _get(client, "/api/snapshot", headers={"Host": f"evil.example:{_port(client)}"})

    # Assert
    assert status == 421


def test_a_request_without_host_is_refused(collector: StatusCollector) -> None:
    # Prepare
    with _serve(collector, token=TOKEN) as client:
        request = f"GET /api/snapshot HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"

        # Execute
        with socket.create_connection(("127.0.0.1", _port(client))) as conn:
            conn.sendall(request.encode())
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk

    # Assert
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"421"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
@pytest.mark.parametrize("token", [TOKEN, VIEWER])
def test_the_token_and_the_bound_address_read_the_run(
    collector: StatusCollector, config: FedPSConfig, host: str, token: str
) -> None:
    # Prepare
    with _serve(collector, token=TOKEN, viewer_token=VIEWER) as client:
        headers = {"Host": f"{host}:{_port(client)}", **_bearer(token)}

        # Execute
        answers = {path: _get(client, path, headers=headers) for path in READS}
        page, _ = _get(client, "/", headers={"Host": headers["Host"]})

    # Assert
    assert {path: status for path, (status, _) in answers.items()} == dict.fromkeys(READS, 200)
    snapshot = json.loads(answers["/api/snapshot"][1])
    assert snapshot["config"]["cluster"]["coordinator"] == config.cluster.coordinator
    assert answers["/api/events"][1].startswith("data: ")
    assert page == 200


def test_the_viewer_reads_but_starts_nothing(
    collector: StatusCollector, launcher: RunLauncher
) -> None:
    # Prepare
    with _serve(collector, token=TOKEN, viewer_token=VIEWER, launcher=launcher) as client:
        # Execute
        session = client.get("/api/session", headers=_bearer(VIEWER))
        start = client.post("/api/runs", json={"training.rounds": "3"}, headers=_bearer(VIEWER))

    # Assert
    assert session.status_code == 200
    assert session.json()["operator"] is False
    assert start.status_code == 403
    assert not launcher.running


def test_the_viewer_link_sets_a_cookie_that_reads(collector: StatusCollector) -> None:
    # Prepare
    with _serve(collector, token=TOKEN, viewer_token=VIEWER) as client:
        # Execute
        link = client.get(f"/?token={VIEWER}")
        status, _ = _get(client, "/api/snapshot")

    # Assert: the link lands on the page (the token leaves the address bar), which then reads
    assert link.status_code == 200
    assert link.url.query == b""
    assert status == 200


def test_a_public_dashboard_is_read_without_a_token(
    collector: StatusCollector, launcher: RunLauncher
) -> None:
    # Prepare
    with _serve(collector, token=TOKEN, public=True, launcher=launcher) as client:
        # Execute
        answers = {path: _get(client, path)[0] for path in READS}
        start = client.post("/api/runs", json={"training.rounds": "3"})

    # Assert: everyone reads, only the operator starts runs
    assert answers == dict.fromkeys(READS, 200)
    assert start.status_code == 403
    assert not launcher.running


@pytest.mark.parametrize("host", ["dash.example", "dash.example:443", "DASH.example:{port}"])
def test_an_allowed_host_name_is_served(collector: StatusCollector, host: str) -> None:
    # Prepare: a TLS-terminating proxy at dash.example forwards to the dashboard
    with _serve(collector, token=TOKEN, allowed_hosts=["dash.example"]) as client:
        headers = {"Host": host.format(port=_port(client)), **_bearer(TOKEN)}

        # Execute
        status, _ = _get(client, "/api/snapshot", headers=headers)
        other, _ = _get(client, "/api/snapshot", headers={**headers, "Host": "other.example"})

    # Assert
    assert status == 200
    assert other == 421


def _links(line: str) -> list[str]:
    return re.findall(r"http://[^\s)]+", line)


def test_a_read_only_dashboard_prints_one_link_that_opens_it(
    config: FedPSConfig, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: as fedps demo --ui and fedps up --ui serve it (no operator)
    lines: list[str] = []
    with serve_dashboard(config, "127.0.0.1:0", echo=lines.append):
        (link,) = _links(lines[0])
        page = link.split("?")[0]
        with (
            _browser() as stranger,
            _browser() as viewer,
        ):
            # Execute
            refused = stranger.get(f"{page}api/snapshot")
            opened = viewer.get(link)
            read = viewer.get(f"{page}api/snapshot")

    # Assert
    assert len(lines) == 1
    assert "read-only" in lines[0]
    assert "?token=" in link
    assert refused.status_code == 401
    assert opened.status_code == 200
    assert read.status_code == 200
    assert not any("public" in r.getMessage() for r in caplog.records)


def test_the_operators_dashboard_prints_a_viewer_link_and_the_operators(
    config: FedPSConfig,
) -> None:
    # Prepare
    lines: list[str] = []
    with serve_dashboard(config, "127.0.0.1:0", echo=lines.append, token=TOKEN):
        viewer_link, operator_link = _links(lines[0])
        page = viewer_link.split("?")[0]
        with _browser() as viewer:
            # Execute
            viewer.get(viewer_link)
            session = viewer.get(f"{page}api/session")

    # Assert: the viewer's token is not the operator's, and reads without being the operator
    assert operator_link == f"{page}?token={TOKEN}"
    assert "?token=" in viewer_link
    assert TOKEN not in viewer_link
    assert session.status_code == 200
    assert session.json()["operator"] is False


def test_a_public_dashboard_warns_on_start(
    config: FedPSConfig, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    lines: list[str] = []

    # Execute
    with (
        caplog.at_level(logging.WARNING, logger="fedps"),
        serve_dashboard(config, "127.0.0.1:0", echo=lines.append, token=TOKEN, public=True),
    ):
        (page, _) = _links(lines[0])
        with _browser() as stranger:
            read = stranger.get(f"{page}api/snapshot")

    # Assert
    assert "?token=" not in page
    assert read.status_code == 200
    assert any("public" in r.getMessage() and "anyone" in r.getMessage() for r in caplog.records)
