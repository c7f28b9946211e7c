"""Roles that listen on one address and are dialed at another, under mutual TLS.

The key holder, a shard and the coordinator run as ``fedps ROLE`` processes that bind
``0.0.0.0:PORT`` (``[cluster.listen]``) and are dialed as ``localhost:PORT`` (``[cluster]``),
with the certificates ``fedps certs`` writes: the coordinator reaches its peers by name, and
``fedps status`` (the operator) finds every role up.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedps.cli import app
from fedps.config import load_config
from fedps.runtime.deployment import Deployment, free_port, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_roles_bind_the_listen_address_and_are_dialed_by_name(tmp_path: Path) -> None:
    # Prepare: one configuration, dialed by name, bound on every interface
    ports = {role: free_port() for role in ("keyholder", "coordinator", "shard")}
    config = load_config(
        None,
        cluster={
            "keyholder": f"localhost:{ports['keyholder']}",
            "coordinator": f"localhost:{ports['coordinator']}",
            "shards": [f"localhost:{ports['shard']}"],
            "listen": {
                "keyholder": f"0.0.0.0:{ports['keyholder']}",
                "coordinator": f"0.0.0.0:{ports['coordinator']}",
                "shards": [f"0.0.0.0:{ports['shard']}"],
            },
            "state_dir": str(tmp_path / "state"),
        },
        training={"clients": 2, "min_quorum": 2},
        tls={"directory": str(tmp_path / "certs")},
    )
    path = tmp_path / "fedps.toml"
    write_config(config, path)
    certs = CliRunner().invoke(app, ["certs", "--config", str(path)])
    assert certs.exit_code == 0, certs.output
    deployment = Deployment(path, config)

    # Execute: start them (each waits until its dial address answers under TLS), then ask
    try:
        deployment.start_servers()
        status = subprocess.run(
            [sys.executable, "-m", "fedps.cli", "status", "--config", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        deployment.stop()

    # Assert: each role bound the wildcard address and answered at its name
    logs = {p.stem: p.read_text() for p in deployment.log_dir.iterdir()}
    for name, role in [("keyholder", "keyholder"), ("coordinator", "coordinator")]:
        assert f"{role} listening on 0.0.0.0:{ports[role]}" in logs[name], logs[name]
    assert f"shard listening on 0.0.0.0:{ports['shard']}" in logs["shard-0"], logs["shard-0"]
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"coordinator localhost:{ports['coordinator']}: up" in status.stdout
    assert f"key holder localhost:{ports['keyholder']}: up" in status.stdout
    assert f"shard-0 localhost:{ports['shard']}: up" in status.stdout
