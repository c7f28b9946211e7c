"""A client's progress: one readable line per round it takes part in, printed by
``fedps client`` (clients/edge_client.py's ``on_round``, the CLI's ``client`` command)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clients.edge_client import ClientSummary, RoundProgress
from fedps.runtime.deployment import write_config
from tests.conftest import start_cluster
from tests.waiting import HANG_S


def _progress(**fields: object) -> RoundProgress:
    values: dict[str, object] = {
        "client_id": "client-0",
        "round": 3,
        "rounds": 20,
        "samples": 412,
        "loss": 0.4123,
        "epsilon": 1.8412,
        "delta": 1e-5,
        "bytes_pushed": 1_234_567,
        "push_seconds": 0.81,
    }
    return RoundProgress(**{**values, **fields})  # type: ignore[arg-type]


def test_the_line_of_a_round() -> None:
    assert _progress().line() == (
        "client-0 round 3/20: 412 samples, loss 0.412, epsilon 1.84 (delta 1e-05), "
        "pushed 1.235 MB in 0.8 s"
    )


def test_the_line_without_a_loss_or_a_push() -> None:
    line = _progress(loss=math.nan, bytes_pushed=0).line()

    assert line == (
        "client-0 round 3/20: 412 samples, epsilon 1.84 (delta 1e-05), "
        "nothing pushed (the round ended first)"
    )


@pytest.mark.integration
def test_fedps_client_prints_one_line_per_round(tmp_path: Path) -> None:
    # Prepare: a one-client cluster in this process, its configuration in a file
    training = {"rounds": 2, "clients": 1, "min_quorum": 1, "deadline_s": 60.0, "lr": 0.3}
    cluster = start_cluster(tmp_path, num_shards=1, training=training)
    config = tmp_path / "fedps.toml"
    write_config(cluster.config, config)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        # Execute
        result = subprocess.run(
            [sys.executable, "-m", "fedps.cli", "client", "--config", str(config), "--insecure"],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            env=env,
            check=False,
        )
    finally:
        cluster.stop()
    # Assert: one line per round on stdout, the logs on stderr
    assert result.returncode == 0, result.stderr
    pattern = (
        r"client-0 round (\d)/2: \d+ samples, loss [0-9.e+-]+, epsilon [0-9.]+ "
        r"\(delta 1e-05\), pushed [0-9.]+ [kMG]?B in [0-9.]+ s"
    )
    matches = [re.fullmatch(pattern, line) for line in result.stdout.splitlines()]
    assert [int(m.group(1)) for m in matches if m] == [1, 2], result.stdout


# A round line names the peers that refused the client's calls and counts them (the client
# that survives them: tests/integration/test_client_survives.py).


def test_a_refused_push_is_named_and_counted() -> None:
    # Execute
    line = _progress(refused=("shard-1 (invalid_argument)",), failures=1).line()

    # Assert
    assert line == (
        "client-0 round 3/20: 412 samples, loss 0.412, epsilon 1.84 (delta 1e-05), "
        "pushed 1.235 MB in 0.8 s; refused by shard-1 (invalid_argument), 1 peer failure so far"
    )


def test_a_round_every_peer_refused_says_nothing_was_pushed() -> None:
    # Execute
    refused = ("shard-0 (quarantined)", "shard-1 (config)", "coordinator (config)")
    line = _progress(bytes_pushed=0, refused=refused, failures=7).line()

    # Assert: not "the round ended first": the peers refused
    assert line.endswith(
        "nothing pushed; refused by shard-0 (quarantined), shard-1 (config), "
        "coordinator (config), 7 peer failures so far"
    )


def test_earlier_failures_are_counted_in_a_clean_round() -> None:
    # Execute
    line = _progress(failures=2).line()

    # Assert
    assert line.endswith("pushed 1.235 MB in 0.8 s; 2 peer failures so far")


def test_a_summary_without_failures_counts_none() -> None:
    assert ClientSummary("client-0", 3, 1.0, 1e-5, 100).failures == 0
