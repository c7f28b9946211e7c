"""Roles as real processes (``python -m fedps.cli ...``) on loopback, for the tests of one
instance per role and of ``fedps up``'s supervision.

Every configuration here runs without TLS (``tls.insecure``), so the test process can call the
roles and run :class:`clients.edge_client.EdgeClient` threads with enrolment tokens.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

from crypto.python_child import child_environment
from fedps.config import FedPSConfig, load_config
from fedps.provisioning import provision_cluster
from fedps.runtime.deployment import PROBE_OPTIONS, local_cluster, write_config
from fedps.storage.state_lock import LOCK_FILE

#: Upper bound of any wait here: it only catches a hang, nothing should take this long.
HANG_S = 300.0

#: This fedps first on the path, whatever the working directory (a test's folder); the process
#: stops once the test's is gone (crypto.python_child.watch_parent).
_ENV = child_environment({**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "NO_COLOR": "1"})


def write_local_config(
    root: Path, name: str = "fedps.toml", **sections: Mapping[str, object]
) -> tuple[Path, FedPSConfig]:
    """A configuration of a whole cluster on free loopback ports, state in ``root/state``
    (``cluster`` in ``sections`` overrides fields), certificates and tokens in
    ``root/certs``; written to ``root/NAME``."""
    cluster = {**local_cluster(root / "state"), **sections.pop("cluster", {})}
    tls = {"insecure": True, "directory": str(root / "certs")}
    config = load_config(None, cluster=cluster, tls=tls, **sections)
    provision_cluster(config)
    path = root / name
    write_config(config, path)
    return path, config


def start_fedps(
    *args: str, log: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """``python -m fedps.cli ARGS``, stdout and stderr into ``log`` (its own session, so a
    signal meant for the test never reaches it), with ``env`` over the test's environment."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fedps.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**_ENV, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )


def run_fedps(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m fedps.cli ARGS`` to the end (a hang fails with what it printed)."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "fedps.cli", *args],
            capture_output=True,
            text=True,
            env=_ENV,
            timeout=HANG_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        printed = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise AssertionError(f"fedps {' '.join(args)} hung; its stderr:\n{printed}") from exc


def wait_serving(
    address: str, alive: Callable[[], None], credentials: grpc.ChannelCredentials | None = None
) -> None:
    """Block until ``address`` accepts a gRPC connection (under TLS with ``credentials``, if
    given), calling ``alive`` (which raises if the server's process died) between attempts."""
    with (
        grpc.insecure_channel(address, options=PROBE_OPTIONS)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=PROBE_OPTIONS)
    ) as channel:
        until = time.monotonic() + HANG_S
        while True:
            alive()
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                assert time.monotonic() < until, f"{address} never came up"


def wait_listening(address: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until ``address`` accepts a gRPC connection (and ``proc``, if given, lives)."""

    def alive() -> None:
        assert proc is None or proc.poll() is None, f"the server of {address} exited"

    wait_serving(address, alive)


def lock_holder(role_dir: Path) -> int | None:
    """The pid written in ``role_dir``'s state lock (None before any role took it)."""
    try:
        text = (role_dir / LOCK_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def last_line(text: str) -> str:
    """The last non-empty line of ``text``."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_command_after_dashes(argv: list[str]) -> None:
    """Run the ``PYTHON -P -m fedps.cli ...`` command after ``--`` in ``argv`` in this process.

    For a role's command prefix (:attr:`Deployment.prefixes
    <fedps.runtime.deployment.Deployment.prefixes>`) that changed one of the role's methods
    first: ``tests.dying_shard``, ``tests.dying_coordinator``, ``tests.tampering_shard``.
    """
    command = argv[argv.index("--") + 1 :]
    sys.argv = ["fedps", *command[command.index("fedps.cli") + 1 :]]
    runpy.run_module("fedps.cli", run_name="__main__", alter_sys=True)
