"""The dashboard in headless Chromium during a real run (real gRPC servers on loopback,
real encryption): the operator starts a run from the form, the page follows its rounds and
curves, a bad field shows its error next to it, a viewer with the printed read-only link
follows the run but cannot start anything, and a page opened without a link reads nothing.

Set ``FEDPS_SCREENSHOT=PATH`` to save a screenshot of the page during the run (how
docs/images/dashboard.png is made).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fedps.dashboard import RunLauncher, serve_dashboard
from fedps.runtime.deployment import local_cluster
from tests.waiting import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.integration]

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "browser-test-operator-token-0123456789"
ROUNDS = 5


@dataclass
class Ui:
    """The dashboard of ``fedps ui``, its printed links, and the browser that looks at it."""

    url: str
    viewer_link: str
    operator_link: str
    launcher: RunLauncher
    browser: Any


@pytest.fixture
def ui(tmp_path: Path) -> Iterator[Ui]:
    if not CHROMIUM.exists():
        pytest.skip("no browser: install Debian's chromium (/usr/bin/chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    # Prepare: what `fedps ui --insecure` serves, for a 3-client digits run on free ports
    base: dict[str, dict[str, object]] = {
        "tls": {"insecure": True, "enabled": False, "directory": str(tmp_path / "certs")},
        "cluster": local_cluster(tmp_path / "unused", shards=2),
        "training": {"clients": 3, "min_quorum": 2, "checkpoint_every": 100},
    }
    launcher = RunLauncher(None, base_overrides=base, state_root=tmp_path / "ui")
    lines: list[str] = []
    with serve_dashboard(
        None, "127.0.0.1:0", echo=lines.append, token=TOKEN, launcher=launcher
    ) as _:
        # "dashboard: VIEWER_LINK (operator: OPERATOR_LINK)", each http://HOST:PORT/?token=...
        viewer_link, operator_link = re.findall(r"http://[^\s)]+", lines[0])
        url = viewer_link.split("?")[0]
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
            try:
                yield Ui(url, viewer_link, operator_link, launcher, browser)
            finally:
                browser.close()
                launcher.stop()


def _points(page: Any, line: str) -> int:
    return int(page.get_attribute(f"#{line}", "data-count") or 0)


def _round(page: Any) -> int:
    text = page.text_content("#round") or ""
    return int(text.split("/")[0]) if "/" in text else 0


def test_dashboard_follows_a_run_the_operator_starts(ui: Ui) -> None:
    # Prepare: the operator opens the token link (the cookie is set, the token leaves the URL)
    operator = ui.browser.new_page()
    assert ui.operator_link == f"{ui.url}?token={TOKEN}"
    operator.goto(ui.operator_link)
    operator.wait_for_selector("#f-training-rounds")
    assert operator.url == ui.url
    assert operator.text_content("#viewer") == "operator"

    # Execute: a bad field first, then a valid run
    operator.fill("#f-training-rounds", "0")
    operator.click("#start")
    operator.wait_for_selector("#error-training-rounds:not(:empty)")
    error = operator.text_content("#error-training-rounds") or ""
    marked = operator.get_attribute("#f-training-rounds", "class") or ""
    operator.fill("#f-training-rounds", str(ROUNDS))
    operator.click("#start")
    wait_for(lambda: ui.launcher.running, "the run started")

    # Assert: the bad field's error sits beside it, and nothing started for it
    assert "greater than or equal to 1" in error
    assert "invalid" in marked

    # Execute: watch two moments of the run
    wait_for(lambda: _round(operator) >= 2, "round 2 on the page", poll_s=0.2)
    first = (_round(operator), _points(operator, "acc-line"), _points(operator, "eps-line"))
    wait_for(lambda: _round(operator) >= first[0] + 2, "two more rounds on the page", poll_s=0.2)
    if os.environ.get("FEDPS_SCREENSHOT"):
        operator.screenshot(path=os.environ["FEDPS_SCREENSHOT"], full_page=True)
    second = (_round(operator), _points(operator, "acc-line"), _points(operator, "eps-line"))

    # Assert: the rounds advance and both curves grow with them
    assert first[1] >= 1
    assert first[2] >= 1
    assert second[1] > first[1]
    assert second[2] > first[2]
    assert operator.locator("#roles .up").count() == 4  # coordinator, key holder, 2 shards

    # Execute: a viewer with the read-only link, in a browser context of its own
    viewer = ui.browser.new_context().new_page()
    viewer.goto(ui.viewer_link)
    viewer.wait_for_selector("#f-training-rounds")
    wait_for(lambda: _round(viewer) >= 1, "the run on the viewer's page", poll_s=0.2)
    refused = httpx.post(f"{ui.url}api/runs", json={"training.rounds": "3"})

    # Assert: the token left the address bar; the run shows, but no button, the fields
    # disabled, the reason said, and the API refuses
    assert viewer.url == ui.url
    assert viewer.text_content("#viewer") == "read-only"
    assert viewer.locator("#start").count() == 0
    assert viewer.is_disabled("#f-training-rounds")
    assert "only the operator" in (viewer.text_content("#form-note") or "")
    assert refused.status_code == 403

    # Execute: a page opened without a link, in a browser context of its own
    stranger = ui.browser.new_context().new_page()
    stranger.goto(ui.url)
    stranger.wait_for_selector("#viewer:not(:empty)")

    # Assert: it reads nothing of the run and says which link to open
    assert stranger.text_content("#viewer") == "no access"
    assert _round(stranger) == 0
    assert "link" in (stranger.text_content("#form-note") or "")

    # Execute: the run ends
    wait_for(lambda: not ui.launcher.running, "the run finished")

    # Assert
    assert ui.launcher.state()["launch"]["error"] == ""
    assert "finished" in ui.launcher.state()["launch"]["message"]
