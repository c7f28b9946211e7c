"""The dashboard's run endpoints: the run list, one run, stopping it, its model and logs.

Starlette's test client with the runs of a store and no cluster behind them: who may read
and who may change, and every bad request answered with a status and a message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from fedps.dashboard import RunLauncher, RunStore, StatusCollector, create_app
from fedps.dashboard.dashboard import COOKIE, VIEWER_COOKIE

TOKEN = "operator-token-for-tests-0123456789"
VIEWER = "viewer-token-for-tests-0123456789"


@pytest.fixture
def runs(store: RunStore, tmp_path: Path) -> RunStore:
    """Run 1 finished with its model and a log; run 2 failed before it wrote anything."""
    state_dir = tmp_path / "ui" / "runs" / "1"
    (state_dir / "logs").mkdir(parents=True)
    (state_dir / "logs" / "coordinator.log").write_text("round 1 of 1\n")
    (state_dir / "model.pt").write_bytes(b"weights")
    (state_dir / "fedps.toml").write_text("[training]\n")
    history = [{"round": 1, "accuracy": 0.9, "max_epsilon": 1.5}]
    store.update(
        "1",
        status="finished",
        started_unix=100.0,
        ended_unix=160.0,
        state_dir=str(state_dir),
        run={"round": 1, "rounds": 1, "max_epsilon": 1.5, "history": history},
    )
    store.update("2", status="failed", started_unix=200.0, error="port in use")
    return store


@pytest.fixture
def app(collector: StatusCollector, launcher: RunLauncher, runs: RunStore) -> TestClient:
    return TestClient(
        create_app(collector, token=TOKEN, viewer_token=VIEWER, launcher=launcher, store=runs)
    )


def _as(client: TestClient, token: str) -> TestClient:
    client.headers["Authorization"] = f"Bearer {token}"
    return client


def test_readers_list_the_runs_latest_first(app: TestClient) -> None:
    # Execute
    anonymous = app.get("/api/runs")
    listed = _as(app, VIEWER).get("/api/runs")

    # Assert
    assert anonymous.status_code == 401
    assert listed.status_code == 200
    runs = listed.json()["runs"]
    assert [r["id"] for r in runs] == ["2", "1"]
    assert runs[0]["error"] == "port in use"
    assert runs[1]["accuracy"] == 0.9
    assert runs[1]["files"] == {"model": True, "logs": ["coordinator.log"]}


def test_a_reader_opens_an_earlier_run(app: TestClient) -> None:
    # Execute
    response = _as(app, VIEWER).get("/api/runs/1")

    # Assert: the whole record, as the page draws it
    assert response.status_code == 200
    record = response.json()
    assert record["status"] == "finished"
    assert record["run"]["history"][0]["accuracy"] == 0.9
    assert record["files"]["model"] is True


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/api/runs/3", 404, "no run 3"),
        ("/api/runs/a.b", 400, "not a run id"),
        ("/api/runs/run%201", 400, "not a run id"),
        ("/api/runs/3/stop", 404, "no run 3"),
        ("/api/runs/1/logs/fedps.toml", 404, "no log"),
        ("/api/runs/1/logs/..fedps.toml", 404, "no log"),
        ("/api/runs/2/model", 404, "exported no model"),
        ("/api/runs/1/stop", 409, "not in progress"),
    ],
)
def test_a_bad_request_says_what_is_wrong(
    app: TestClient, path: str, status: int, message: str
) -> None:
    # Execute
    method = "POST" if path.endswith("/stop") else "GET"
    response = _as(app, TOKEN).request(method, path)

    # Assert
    assert response.status_code == status
    assert message in response.json()["error"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/api/runs/1/stop"), ("GET", "/api/runs/1/model"), ("GET", "/api/runs/1/logs/x")],
)
def test_a_viewer_neither_stops_nor_downloads(app: TestClient, method: str, path: str) -> None:
    # Execute
    viewer = _as(app, VIEWER).request(method, path)
    app.headers.pop("Authorization")
    app.cookies.set(COOKIE, TOKEN)
    foreign = app.request(method, path, headers={"Origin": "http://evil.example"})

    # Assert: the viewer's token, or the operator's cookie sent by a page of another site
    for response in (viewer, foreign):
        assert response.status_code == 403
        assert "only the operator" in response.json()["error"]


def test_a_log_name_does_not_leave_the_logs_folder(app: TestClient) -> None:
    # Execute
    response = _as(app, TOKEN).get("/api/runs/1/logs/..%2Ffedps.toml")

    # Assert
    assert response.status_code == 404
    assert "[training]" not in response.text


def test_the_operator_downloads_the_model_and_a_log(app: TestClient) -> None:
    # Execute
    model = _as(app, TOKEN).get("/api/runs/1/model")
    log = app.get("/api/runs/1/logs/coordinator.log")

    # Assert
    assert model.status_code == 200
    assert model.content == b"weights"
    assert "fedps-run-1-model.pt" in model.headers["content-disposition"]
    assert log.status_code == 200
    assert log.text == "round 1 of 1\n"
    assert log.headers["content-type"].startswith("text/plain")


def test_a_dashboard_that_starts_no_runs_stops_none(
    collector: StatusCollector, runs: RunStore
) -> None:
    # Prepare: beside fedps demo or up
    client = _as(TestClient(create_app(collector, token=TOKEN, store=runs)), TOKEN)

    # Execute
    response = client.post("/api/runs/1/stop")

    # Assert
    assert response.status_code == 403
    assert "stops no runs" in response.json()["error"]


def test_a_run_of_another_process_is_not_stopped_from_here(app: TestClient, runs: RunStore) -> None:
    # Prepare: the run of a coordinator this dashboard follows, named after its run id
    runs.update("0123abcd", status="training")

    # Execute
    response = _as(app, TOKEN).post("/api/runs/0123abcd/stop")

    # Assert
    assert response.status_code == 409
    assert "not started from this dashboard" in response.json()["error"]


def test_a_dashboard_without_a_store_lists_no_runs(collector: StatusCollector) -> None:
    # Prepare
    client = TestClient(create_app(collector, viewer_token=VIEWER))
    client.cookies.set(VIEWER_COOKIE, VIEWER)

    # Execute
    listed = client.get("/api/runs")
    one = client.get("/api/runs/1")

    # Assert
    assert listed.json() == {"runs": []}
    assert one.status_code == 404
