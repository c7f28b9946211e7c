"""The README's demo, as a user runs it: separate processes on loopback, under mutual TLS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_reaches_target_accuracy_within_budget(tmp_path: Path) -> None:
    # Prepare
    out = tmp_path / "summary.json"
    # Execute
    result = subprocess.run(
        [sys.executable, "-m", "fedps.cli", "demo", "--json", str(out)],
        capture_output=True,
        text=True,
        # a hang guard above the demo's own (its watcher gives up after 1800 s): a loaded
        # machine may take several times the few minutes a demo takes
        timeout=1900,
    )
    # Assert
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["rounds"] == 30
    assert summary["final_accuracy"] >= 0.90
    assert 0 < summary["max_epsilon"] <= 8.0
    assert summary["delta"] == 1e-5
    assert summary["bytes_pushed"] > 0
    assert summary["abandoned_rounds"] == 0
    assert summary["tls"] is True  # mutual TLS by default, with certificates made for the run
    # The start-up is said (servers, then each client joining) and the result is in plain
    # units: no repr, the accuracy as a percentage.
    lines = result.stdout.splitlines()
    assert any(line.startswith("servers up after") for line in lines), result.stdout
    assert any(line.startswith("clients joined ") for line in lines), result.stdout
    assert "CKKS N 2048, q " in result.stdout and "CkksParams" not in result.stdout
    done = next(line for line in lines if line.startswith("done in"))
    assert f"accuracy {summary['final_accuracy']:.2%}" in done
