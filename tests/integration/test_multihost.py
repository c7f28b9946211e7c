"""Key holder, shards, coordinator and clients as separate hosts (Linux network namespaces).

Each role runs in its own network namespace with its own address on a bridge the test
creates (10.77.0.0/24, veth pairs); the test process reaches them through the bridge. During
a round the test cuts one shard's link for a few seconds, then restores it: clients and the
coordinator wait it out, and training finishes with every round applied. Needs root and
``ip netns``; skipped with the reason otherwise.

Nothing here depends on how fast the machine is: the test waits for the events it needs
(round 1 under way, training finished) with hang guards far above the minute or two a run
takes, and the round deadline is long enough that a loaded machine's slow client still
commits in time (rounds end as soon as all three have committed, so it costs nothing).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fedps.cli.deployment import write_config
from fedps.config import FedPSConfig, load_config
from fedps.provisioning import provision_cluster
from tests.conftest import coordinator_status, reached
from tests.waiting import HANG_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PREFIX = f"fps{os.getpid() % 10000}"
BRIDGE = f"{PREFIX}br"
HOSTS = {"keyholder": 2, "shard-0": 3, "shard-1": 4, "coordinator": 5, "clients": 6}
ROUNDS = 3
#: The round deadline: every client must make every round (the test asserts 3 contributors),
#: so it is a hang guard, not a pace; rounds end early once all three have committed.
DEADLINE_S = HANG_S
#: How long the shard's link stays cut.
CUT_S = 4.0


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _ip_output(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def _remove_stale_hosts() -> None:
    """Delete namespaces and bridges an earlier run of this test left behind when it was
    killed (named after a process that no longer runs): their routes would shadow ours."""
    names = _ip_output("netns", "list").split() + re.findall(
        r"\d+: (fps\d+br)[:@]", _ip_output("link")
    )
    for name in names:
        match = re.fullmatch(r"fps(\d+)(?:-\d+|br)", name)
        if match is None or name.startswith(PREFIX):
            continue
        if any(int(pid) % 10000 == int(match[1]) for pid in os.listdir("/proc") if pid.isdigit()):
            continue  # possibly a run beside this one: leave it
        kind = ["netns", "del"] if not name.endswith("br") else ["link", "del"]
        subprocess.run(["ip", *kind, name], capture_output=True)


def _free_subnet() -> str:
    """A 10.77.N.0/24 that no route or address on this host uses yet."""
    used = _ip_output("-4", "route") + _ip_output("-4", "addr")
    for n in range(256):
        if f"10.77.{n}." not in used:
            return f"10.77.{n}"
    raise RuntimeError("no free 10.77.N.0/24 subnet for the test hosts")


def _namespaces_unavailable() -> str | None:
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux with iproute2 (ip netns)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"{PREFIX}probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot create a network namespace: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture
def subnet() -> str:
    """The test hosts' /24 (its first three octets)."""
    return _free_subnet()


@pytest.fixture
def hosts(subnet: str) -> Iterator[dict[str, str]]:
    """One namespace per host on a bridge; yields {host: its namespace}."""
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    _remove_stale_hosts()
    made: list[str] = []
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for octet in HOSTS.values():
            ns = f"{PREFIX}-{octet}"
            _ip("netns", "add", ns)
            made.append(ns)
            outside, inside = f"{PREFIX}v{octet}", f"{PREFIX}p{octet}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", BRIDGE)
            _ip("link", "set", outside, "up")
            _ip("addr", "add", f"{subnet}.{octet}/24", "dev", inside, netns=ns)
            _ip("link", "set", inside, "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
        yield {host: f"{PREFIX}-{octet}" for host, octet in HOSTS.items()}
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def _config(tmp_path: Path, subnet: str) -> FedPSConfig:
    def at(host: str, port: int) -> str:
        return f"{subnet}.{HOSTS[host]}:{port}"

    return load_config(
        None,
        cluster={
            "keyholder": at("keyholder", 7001),
            "coordinator": at("coordinator", 7002),
            "shards": [at("shard-0", 7003), at("shard-1", 7004)],
            "state_dir": str(tmp_path / "state"),
        },
        training={"rounds": ROUNDS, "clients": 3, "min_quorum": 2, "deadline_s": DEADLINE_S},
        tls={"insecure": True, "directory": str(tmp_path / "certs")},
    )


def _tails(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(logs.iterdir())
    )


def test_training_survives_a_cut_link_between_hosts(
    tmp_path: Path, subnet: str, hosts: dict[str, str]
) -> None:
    # Prepare: every role on its own host; three clients on a fourth
    config = _config(tmp_path, subnet)
    provision_cluster(config)  # the enrolment key and the clients' tokens
    path = tmp_path / "fedps.toml"
    write_config(config, path)
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    names: list[str] = []

    def start(host: str, name: str, *args: str) -> None:
        names.append(name)
        with open(logs / f"{name}.log", "wb") as log:
            cmd = ["ip", "netns", "exec", hosts[host], sys.executable, "-m", "fedps.cli"]
            procs.append(
                subprocess.Popen([*cmd, *args, "--config", str(path)], stdout=log, stderr=log)
            )

    try:
        start("keyholder", "keyholder", "keyholder")
        start("shard-0", "shard-0", "shard", "--index", "0")
        start("shard-1", "shard-1", "shard", "--index", "1")
        start("coordinator", "coordinator", "coordinator")
        for i in range(3):
            start("clients", f"client-{i}", "client", "--index", str(i))
        # Execute: once round 2 is under way, cut shard-1's link for a few seconds (the
        # length of the cut, not a deadline: clients and coordinator wait out any length)
        coordinator = config.cluster.coordinator

        def alive_and(condition: Callable[[], bool]) -> Callable[[], bool]:
            def check() -> bool:
                exited = [n for n, p in zip(names, procs, strict=True) if p.poll() is not None]
                assert not exited, f"roles exited early: {exited}\n{_tails(logs)}"
                return condition()

            return check

        try:
            wait_for(alive_and(lambda: reached(coordinator, 1)), "round 1 applied", poll_s=0.2)
            _ip("link", "set", f"{PREFIX}v{HOSTS['shard-1']}", "down")
            time.sleep(CUT_S)
            _ip("link", "set", f"{PREFIX}v{HOSTS['shard-1']}", "up")
            wait_for(lambda: reached(coordinator, finished=True), "the end of training", poll_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_tails(logs)}") from None
        status = coordinator_status(coordinator)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    # Assert: every round applied by all three clients despite the cut
    tail = {p.name: p.read_text(errors="replace")[-800:] for p in logs.iterdir()}
    assert status is not None and status.finished and status.round == ROUNDS, tail
    assert [r.abandoned for r in status.history] == [False] * ROUNDS
    assert all(r.contributors == 3 for r in status.history), tail
