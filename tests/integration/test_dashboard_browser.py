"""The dashboard in headless Chromium during real runs (real gRPC servers on loopback,
real encryption): the operator starts a run from the form, the page follows its rounds and
curves, a bad field shows its error next to it, a viewer with the printed read-only link
follows the run but can neither start nor stop anything, and a page opened without a link
reads nothing. Once the run has finished and its servers have stopped, the page still shows
it with its final numbers; the operator starts a second run and stops it from the page, and
opens the first one again from the run list.

Set ``FEDPS_SCREENSHOTS=DIR`` to save screenshots of the page there: during the run
(``dashboard.png``), the finished run (``dashboard-finished.png``) and the run list with an
earlier run opened (``dashboard-runs.png``), as in docs/images.
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
# Enough rounds that the page, polling, sees the run at two moments before its end: the demo
# job's rounds take 0.2 s on an idle machine, and with 5 the page first saw round 4 once.
ROUNDS = 20


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


def _screenshot(page: Any, name: str) -> None:
    """Save the whole page as ``FEDPS_SCREENSHOTS/NAME`` when that is set."""
    folder = os.environ.get("FEDPS_SCREENSHOTS")
    if folder:
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def _last_row(page: Any) -> list[str]:
    """The cells of the last round's row of the rounds table (the table's first row)."""
    cells: list[str] = page.locator("#rounds tbody tr").first.locator("td").all_text_contents()
    return cells


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
    _screenshot(operator, "dashboard.png")
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
    assert viewer.is_hidden("#stop")
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

    # Execute: the run ends and its servers stop
    wait_for(lambda: not ui.launcher.running, "the run finished")
    wait_for(lambda: operator.locator("#roles .up").count() == 0, "the roles down", poll_s=0.2)
    operator.hover("#eps-chart")
    _screenshot(operator, "dashboard-finished.png")

    # Assert: the finished run stays with its final numbers, the tiles as its last row says
    assert ui.launcher.state()["launch"]["error"] == ""
    assert "finished" in ui.launcher.state()["launch"]["message"]
    assert operator.text_content("#round") == f"{ROUNDS} / {ROUNDS}"
    assert operator.text_content("#phase") == "finished"
    assert operator.text_content("#remaining") == "done"
    row = _last_row(operator)
    assert row[0] == str(ROUNDS)
    assert operator.text_content("#accuracy") == row[1]
    assert operator.text_content("#epsilon") == row[3]
    assert _points(operator, "acc-line") == ROUNDS
    assert _points(operator, "eps-line") == ROUNDS
    assert operator.locator("#clients tbody tr").count() == 3
    # the budget on the epsilon chart, ticks on its axes, the value under the pointer
    assert operator.get_attribute("#eps-budget", "data-value") == "7.5"
    assert operator.locator("#eps-chart .xtick").count() >= 2
    assert "round" in (operator.text_content("#eps-hover") or "")
    # the files to download: the exported model and the logs
    assert operator.locator("#download-model").count() == 1
    assert operator.locator("#downloads .download-log").count() >= 4

    # Execute: a second, long run, stopped by the operator from the page
    operator.fill("#f-training-rounds", "50")
    operator.click("#start")
    operator.wait_for_selector("#phase:text-is('training')", timeout=120_000)
    assert operator.is_visible("#stop")
    operator.on("dialog", lambda dialog: dialog.accept())
    operator.click("#stop")
    wait_for(lambda: not ui.launcher.running, "the second run stopped")
    operator.wait_for_selector("#phase:text-is('stopped')")
    wait_for(lambda: operator.locator("#roles .up").count() == 0, "its roles down", poll_s=0.2)

    # Assert: stopped, listed above the first run
    assert operator.is_hidden("#stop")
    assert ui.launcher.state()["launch"]["error"] == ""
    wait_for(lambda: operator.locator("#runs tbody tr").count() == 2, "two runs listed")
    statuses = operator.locator("#runs tbody tr td:nth-child(2)").all_text_contents()
    assert statuses == ["stopped", "finished"]

    # Execute: open the first run from the list
    operator.click("#runs tr[data-run='1'] button.open")
    operator.wait_for_selector("#shown:has-text('opened: run 1')")
    _screenshot(operator, "dashboard-runs.png")

    # Assert: its final numbers, while the live run stays a click away
    assert operator.text_content("#round") == f"{ROUNDS} / {ROUNDS}"
    assert operator.text_content("#phase") == "finished"
    assert _last_row(operator) == row
    assert operator.is_visible("#live")
    operator.click("#live")
    operator.wait_for_selector("#shown:has-text('live: run 2')")
