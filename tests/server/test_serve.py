"""Role wiring (server/serve.py): what a role says about its metrics endpoint when it starts,
and one instance per role (a second process on a locked state directory or a port in use
stops with one line)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from fedps.config import load_config
from fedps.rpc.shard_stub import ShardStub
from tests.conftest import start_cluster
from tests.role_processes import (
    HANG_S,
    last_line,
    lock_holder,
    run_fedps,
    start_fedps,
    wait_listening,
    write_local_config,
)


def test_public_metrics_warn_when_a_role_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a shard whose metrics listen on every interface, opted in explicitly
    metrics = {"shards": ["0.0.0.0:0"], "public": True}

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedps"):
        cluster = start_cluster(tmp_path, num_shards=1, coordinator=False, metrics=metrics)
    cluster.stop()

    # Assert
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("shard-0 metrics on 0.0.0.0:0 are public" in w for w in warnings), warnings


def test_loopback_metrics_start_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = {"keyholder": "127.0.0.1:0"}

    with caplog.at_level(logging.WARNING, logger="fedps"):
        cluster = start_cluster(tmp_path, num_shards=1, coordinator=False, metrics=metrics)
    cluster.stop()

    assert not [r for r in caplog.records if "metrics" in r.getMessage()]


def _second_shard_is_refused(tmp_path: Path, first_config: Path, second_config: Path) -> str:
    """Start shard-0 on ``first_config``, then another on ``second_config``; return the
    second's one error line once it exited 2, after checking the first still serves."""
    config = load_config(first_config)
    address, shard_id = config.cluster.shards[0], config.cluster.shard_ids[0]
    first = start_fedps(
        "shard", "--index", "0", "--config", str(first_config), log=tmp_path / "first.log"
    )
    try:
        wait_listening(address, first)
        # Execute
        second = run_fedps("shard", "--index", "0", "--config", str(second_config))
        # Assert: the second stopped with one line; the first still answers
        assert second.returncode == 2, second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None
        shard = ShardStub(shard_id, address)
        try:
            assert shard.get_status(timeout_s=30).version == 0
        finally:
            shard.close()
        assert lock_holder(config.cluster.state_dir / shard_id) == first.pid
        return last_line(second.stderr)
    finally:
        first.terminate()
        first.wait(HANG_S)


@pytest.mark.slow
@pytest.mark.integration
def test_a_second_shard_on_the_same_config_is_refused(tmp_path: Path) -> None:
    # Prepare: one configuration for both processes
    path, config = write_local_config(tmp_path)
    # Execute / Assert: the state directory is locked first, so the lock is what it names
    line = _second_shard_is_refused(tmp_path, path, path)
    assert line.startswith("fedps: error: state directory ")
    assert str(config.cluster.state_dir / "shard-0") in line and "is locked" in line


@pytest.mark.slow
@pytest.mark.integration
def test_a_second_shard_on_a_port_in_use_is_refused(tmp_path: Path) -> None:
    # Prepare: a second configuration with its own state directory but the same shard port
    first, config = write_local_config(tmp_path)
    second, _ = write_local_config(
        tmp_path / "other",
        cluster={"shards": list(config.cluster.shards)},
    )
    # Execute / Assert
    line = _second_shard_is_refused(tmp_path, first, second)
    assert line == (
        f"fedps: error: {config.cluster.shards[0]} is in use (another fedps shard-0 may be "
        "running); stop it or choose another port"
    )


@pytest.mark.slow
@pytest.mark.integration
def test_a_second_shard_on_the_same_state_dir_names_the_lock_and_its_pid(
    tmp_path: Path,
) -> None:
    # Prepare: a second configuration on other ports but the same state directory
    first, config = write_local_config(tmp_path)
    second, _ = write_local_config(
        tmp_path / "other", cluster={"state_dir": str(config.cluster.state_dir)}
    )
    # Execute
    line = _second_shard_is_refused(tmp_path, first, second)
    # Assert: the line names the directory and the pid holding it
    holder = lock_holder(config.cluster.state_dir / "shard-0")
    assert line == (
        f"fedps: error: state directory {config.cluster.state_dir / 'shard-0'} is locked by "
        f"another fedps process (pid {holder}); stop it, or give this one another "
        "cluster.state_dir"
    )


def test_a_server_role_starts_without_torch() -> None:
    # Prepare / Execute: what `fedps shard` and `fedps keyholder` import to serve
    code = "import sys, server.serve; print('torch' in sys.modules, 'opacus' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    )
    # Assert: neither (about 2 s of every role's start-up): Opacus loads where epsilon is
    # computed, torch where a model is built (the coordinator, a client)
    assert done.stdout.split() == ["False", "False"], done.stdout
