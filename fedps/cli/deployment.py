"""Start a whole fedps cluster as separate processes, and stop it cleanly.

``fedps up CONFIG`` starts the key holder, every shard and the coordinator; ``fedps demo``
adds the edge clients and watches training through the coordinator's status RPC. Each role is
its own process (``python -m fedps.cli ROLE``) with its log in ``STATE_DIR/logs``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from crypto.tls import OPERATOR_NAME, TlsIdentity
from fedps.config import FedPSConfig
from fedps.errors import PeerUnavailableError
from fedps.transport import channel_credentials

__all__ = ["Deployment", "free_port", "local_cluster", "write_config"]

_log = logging.getLogger("fedps")


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def local_cluster(state_dir: Path, shards: int = 2) -> dict[str, object]:
    """A ``[cluster]`` section for one machine: every role on a free loopback port."""
    return {
        "keyholder": f"127.0.0.1:{free_port()}",
        "coordinator": f"127.0.0.1:{free_port()}",
        "shards": [f"127.0.0.1:{free_port()}" for _ in range(shards)],
        "state_dir": str(state_dir),
    }


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(config: FedPSConfig, path: Path) -> None:
    """Write ``config`` as TOML (every field, ``None`` fields left out)."""
    lines: list[str] = []
    for section, values in config.model_dump(mode="json").items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    path.write_text("\n".join(lines))


class Deployment:
    """A set of role processes sharing one config file.

    Parameters
    ----------
    config_path
        The TOML file every process reads.
    config
        The same configuration, parsed.
    """

    def __init__(self, config_path: Path, config: FedPSConfig) -> None:
        self.config_path = config_path
        self.config = config
        self.log_dir = config.cluster.state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        """Start ``fedps ARGS --config CONFIG`` as process ``name`` (with ``--insecure`` when
        the configuration turned TLS off, whatever the file says)."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        cmd = [sys.executable, "-m", "fedps.cli", *args, "--config", str(self.config_path)]
        if self.config.tls.insecure:
            cmd.append("--insecure")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.processes[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def start_servers(self) -> None:
        """Key holder, shards, then the coordinator; waits until each accepts connections."""
        cluster = self.config.cluster
        self.start("keyholder", "keyholder")
        for i in range(len(cluster.shards)):
            self.start(f"shard-{i}", "shard", "--index", str(i))
        self.wait_ready([cluster.keyholder, *cluster.shards])
        self.start("coordinator", "coordinator")
        self.wait_ready([cluster.coordinator])

    def wait_ready(self, addresses: list[str], timeout_s: float = 120.0) -> None:
        """Block until every address accepts a gRPC connection (under mutual TLS, one that
        presents the operator's certificate from ``tls.directory``)."""
        until = time.time() + timeout_s
        for address in addresses:
            with self._probe_channel(address) as channel:
                while True:
                    self.check_alive()
                    try:
                        grpc.channel_ready_future(channel).result(timeout=1.0)
                        break
                    except grpc.FutureTimeoutError:
                        if time.time() > until:
                            raise PeerUnavailableError(f"{address} did not come up") from None

    def _probe_channel(self, address: str) -> grpc.Channel:
        tls = self.config.tls
        if not tls.enabled:
            return grpc.insecure_channel(address)
        operator = TlsIdentity.load(tls.directory, OPERATOR_NAME)
        return grpc.secure_channel(address, channel_credentials(operator))

    def check_alive(self, names: list[str] | None = None) -> None:
        """Raise if a server process (or one of ``names``) exited with an error."""
        for name, proc in self.processes.items():
            if names is not None and name not in names:
                continue
            code = proc.poll()
            if code not in (None, 0):
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise PeerUnavailableError(f"{name} exited with code {code}; its log ends:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process (clients first, coordinator, shards, key holder last)."""
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        until = time.time() + grace_s
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, until - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
