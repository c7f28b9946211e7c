"""The dashboard's web app, with Starlette's test client and no cluster behind it.

Roles that are not running show as down; the run launcher is real, but no test here lets a
run start (a run in progress is simulated by a busy launcher). Who may read the run, and the
Host check, are attacked on a real server in test_dashboard_access.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from fedps.config import FedPSConfig, load_config
from fedps.dashboard import RunLauncher, StatusCollector, create_app
from fedps.dashboard.dashboard import COOKIE, VIEWER_COOKIE
from fedps.runtime.deployment import local_cluster
from tests.fedps.dashboard.conftest import INSECURE

TOKEN = "operator-token-for-tests-0123456789"
VIEWER = "viewer-token-for-tests-0123456789"


@pytest.fixture
def client(collector: StatusCollector, launcher: RunLauncher) -> TestClient:
    return TestClient(create_app(collector, token=TOKEN, viewer_token=VIEWER, launcher=launcher))


def _operator(client: TestClient) -> TestClient:
    client.headers["Authorization"] = f"Bearer {TOKEN}"
    return client


def test_snapshot_shows_down_roles_and_the_configuration(
    client: TestClient, config: FedPSConfig
) -> None:
    # Execute
    response = _operator(client).get("/api/snapshot")

    # Assert
    assert response.status_code == 200
    snapshot = response.json()
    assert snapshot["coordinator"]["up"] is False
    assert snapshot["keyholder"]["up"] is False
    assert [s["id"] for s in snapshot["shards"]] == ["shard-0", "shard-1"]
    assert not any(s["up"] for s in snapshot["shards"])
    assert snapshot["run"] is None
    assert snapshot["config"]["training"]["rounds"] == config.training.rounds
    assert snapshot["config"]["cluster"]["coordinator"] == config.cluster.coordinator


def test_event_stream_starts_with_a_snapshot(
    client: TestClient, collector: StatusCollector
) -> None:
    # Prepare: a stopped collector ends each stream after its first event (the test client
    # returns a response once it is complete)
    collector.stop()

    # Execute
    with _operator(client).stream("GET", "/api/events") as response:
        content_type = response.headers["content-type"]
        first = next(line for line in response.iter_lines() if line)

    # Assert
    assert content_type.startswith("text/event-stream")
    assert first.startswith("data: ")
    assert json.loads(first.removeprefix("data: "))["coordinator"]["up"] is False


def test_page_is_self_contained(client: TestClient) -> None:
    # Execute
    page = client.get("/").text
    script = client.get("/static/dashboard.js").text

    # Assert: nothing is fetched from another host
    assert "EventSource" in script
    for text in (page, script):
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text


@pytest.mark.parametrize(("token", "name"), [(TOKEN, COOKIE), (VIEWER, VIEWER_COOKIE)])
def test_token_link_sets_an_http_only_strict_cookie(
    client: TestClient, token: str, name: str
) -> None:
    # Execute
    response = client.get(f"/?token={token}", follow_redirects=False)
    wrong = client.get("/?token=guess", follow_redirects=False)

    # Assert
    assert response.status_code == 303
    assert response.headers["location"] == "/"
    cookie = response.headers["set-cookie"]
    assert f"{name}={token}" in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert wrong.status_code == 403


def test_session_says_who_is_the_operator(client: TestClient) -> None:
    # Execute
    client.cookies.set(VIEWER_COOKIE, VIEWER)
    viewer = client.get("/api/session").json()
    client.cookies.set(COOKIE, TOKEN)
    operator = client.get("/api/session").json()

    # Assert
    assert viewer["operator"] is False
    assert viewer["can_start"] is False
    assert "read-only" in viewer["reason"]
    assert operator["operator"] is True
    assert operator["can_start"] is True
    assert operator["defaults"]["training.rounds"] == 30


def test_starting_a_run_without_the_token_is_forbidden(
    client: TestClient, launcher: RunLauncher
) -> None:
    # Prepare
    client.headers["Authorization"] = "Bearer not-the-token"

    # Execute
    response = client.post("/api/runs", json={"training.rounds": "3"})

    # Assert
    assert response.status_code == 403
    assert "operator" in response.json()["error"]
    assert not launcher.running


def test_bad_settings_are_refused_field_by_field(client: TestClient, launcher: RunLauncher) -> None:
    # Prepare
    form = {
        "training.rounds": "0",
        "training.lr": "fast",
        "training.mode": "sync",
        "privacy.delta": "2",
        "training.clients": "4",
    }

    # Execute
    response = _operator(client).post("/api/runs", json=form)

    # Assert
    assert response.status_code == 422
    errors = response.json()["errors"]
    assert set(errors) == {"training.rounds", "training.lr", "privacy.delta"}
    assert "greater than or equal to 1" in errors["training.rounds"]
    assert not launcher.running


def test_a_field_the_form_does_not_offer_is_refused(client: TestClient) -> None:
    # Execute
    response = _operator(client).post("/api/runs", json={"cluster.state_dir": "/"})

    # Assert
    assert response.status_code == 422
    assert "cluster.state_dir" in response.json()["errors"]


def test_no_run_starts_while_one_is_in_progress(client: TestClient, launcher: RunLauncher) -> None:
    # Prepare: the followed coordinator trains a run
    launcher.busy = lambda: "run abc is in progress"

    # Execute
    response = _operator(client).post("/api/runs", json={"training.rounds": "3"})

    # Assert
    assert response.status_code == 409
    assert "in progress" in response.json()["error"]
    assert not launcher.running


def test_a_dashboard_without_launcher_starts_nothing(collector: StatusCollector) -> None:
    # Prepare
    client = TestClient(create_app(collector, token=TOKEN))

    # Execute
    response = _operator(client).post("/api/runs", json={"training.rounds": "3"})

    # Assert
    assert response.status_code == 403


def test_a_page_of_another_site_cannot_start_a_run(
    client: TestClient, launcher: RunLauncher
) -> None:
    # Prepare: the operator's cookie is set, but the request comes from another origin
    client.cookies.set(COOKIE, TOKEN)

    # Execute
    foreign = client.post(
        "/api/runs", json={"training.rounds": "3"}, headers={"Origin": "http://evil.example"}
    )

    # Assert
    assert foreign.status_code == 403
    assert not launcher.running


def test_an_empty_token_makes_nobody_the_operator(collector: StatusCollector) -> None:
    # Prepare
    client = TestClient(create_app(collector, token="", viewer_token=VIEWER))
    client.cookies.set(VIEWER_COOKIE, VIEWER)

    # Execute
    session = client.get("/api/session").json()
    response = client.post(
        "/api/runs", json={"training.rounds": "3"}, headers={"Authorization": "Bearer "}
    )

    # Assert
    assert session["operator"] is False
    assert response.status_code == 403


def test_an_empty_viewer_token_opens_no_reads(collector: StatusCollector) -> None:
    # Prepare
    client = TestClient(create_app(collector, viewer_token=""))

    # Execute
    bearer = client.get("/api/snapshot", headers={"Authorization": "Bearer "})
    client.cookies.set(VIEWER_COOKIE, "")
    cookie = client.get("/api/snapshot")

    # Assert
    assert bearer.status_code == 401
    assert cookie.status_code == 401


def test_a_configuration_file_that_no_longer_loads_leaves_the_page_working(
    collector: StatusCollector, tmp_path: Path
) -> None:
    # Prepare: the operator's file is edited into something invalid
    path = tmp_path / "fedps.toml"
    path.write_text("[training]\nrounds = 0\n")
    launcher = RunLauncher(path, state_root=tmp_path / "ui")
    client = _operator(TestClient(create_app(collector, token=TOKEN, launcher=launcher)))

    # Execute
    response = client.get("/api/session")

    # Assert: an answer the page can show, with the reason and no Start
    assert response.status_code == 200
    assert response.json()["can_start"] is False
    assert "training.rounds" in response.json()["reason"]


def test_snapshot_names_each_key_holder_party_up_or_down(tmp_path: Path) -> None:
    # Prepare: three parties configured, none listening
    cluster = local_cluster(tmp_path / "state", parties=3)
    keyholder = {"parties": 3, "threshold": 2}
    config = load_config(None, cluster=cluster, keyholder=keyholder, **INSECURE)
    collector = StatusCollector(config, call_s=0.2)
    # Execute
    try:
        snapshot = collector.poll_once()
    finally:
        collector.stop()
    # Assert: each party by name and address, down, with why
    parties = snapshot["parties"]
    assert [p["id"] for p in parties] == ["party-1", "party-2", "party-3"]
    assert [p["address"] for p in parties] == cluster["parties"]
    assert not any(p["up"] for p in parties) and all(p["error"] for p in parties)
