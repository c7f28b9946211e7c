"""docs/deploy.md, run as written: its hosts are Linux network namespaces on a bridge.

The page's blocks marked ``<!-- checked: KIND HOST -->`` are the test's script: the
configuration (``config``), ``fedps certs`` on host A (``setup``), the ``scp`` lines that say
which files go to which host (``copy``), every role's command (``start``, in the page's order)
and ``fedps status`` (``check``). Each host gets its own namespace with its own address on a
bridge the test creates (a free 10.77.N.0/24, veth pairs) and its own ``/etc/fedps`` and
``/var/lib/fedps`` (folders under the test's temporary directory); the hosts' names become
their addresses, roles listen on ``0.0.0.0`` and are dialed at those addresses under mutual
TLS. During a round the test cuts host B's link (both shards) for a few seconds, then
restores it: clients and the coordinator wait it out, and training finishes with every round
applied. Needs root and ``ip netns``; skipped with the reason otherwise.

The page's "Losing host B" (blocks ``lost``, ``rejoin``, ``join``) is the second test: host B is
lost for good (its shards SIGKILLed, its link down) once round 1 is applied; both its shards are
declared gone, their blocks move to shard-2 on host A, ``fedps status`` shows it, and training
goes on; host B then comes back with its shards started empty, the operator adds them, and
training finishes on the three shards.

Nothing here depends on how fast the machine is: the test waits for the events it needs
(round 1 applied, training finished) with hang guards far above the minute or two a run
takes, and the round deadline is long enough that a loaded machine's slow client still
commits in time (rounds end as soon as all three have committed, so it costs nothing).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

from crypto.tls import OPERATOR_NAME, TlsIdentity, configure_tls
from fedps.config import FedPSConfig, load_config
from fedps.provisioning import reset_tls
from fedps.rpc.shard_stub import ShardStub
from fedps.rpc.transport import channel_credentials
from fedps.runtime.deployment import write_config
from tests.conftest import coordinator_status, reached
from tests.network_namespace import namespaces_unavailable
from tests.role_processes import wait_serving
from tests.waiting import HANG_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PREFIX = f"fps{os.getpid() % 10000}"
BRIDGE = f"{PREFIX}br"
HOSTS = {"host-a": 2, "host-b": 3, "host-c": 4}
DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
ROUNDS = 3
#: The round deadline: every client must make every round (the test asserts 3 contributors),
#: so it is a hang guard, not a pace; rounds end early once all three have committed.
DEADLINE_S = HANG_S
#: How long host B's link stays cut.
CUT_S = 4.0
#: The kinds of the blocks of "Losing host B", run by the second test only.
LOSS_KINDS = ("lost", "rejoin", "join")
#: Rounds of the second test: rounds are left to train on the grown ring after the joins.
LOSS_ROUNDS = 6
#: Its round deadline: a round whose clients had not pulled the model when host B was lost is
#: abandoned at it (docs/deploy.md), and it bounds the clients' pause while host B rejoins.
LOSS_DEADLINE_S = 60.0


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


@pytest.fixture
def subnet() -> str:
    """The test hosts' /24 (its first three octets)."""
    return _free_subnet()


@pytest.fixture
def hosts(subnet: str) -> Iterator[dict[str, str]]:
    """One namespace per host on a bridge; yields {host: its namespace}."""
    reason = namespaces_unavailable()
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


def _checked_blocks() -> list[tuple[str, str, str]]:
    """The page's checked blocks in order: (kind, host, text)."""
    pattern = r"<!-- checked: (\w+)(?: ([\w-]+))? -->\n```\w*\n(.*?)```"
    return [(m[1], m[2] or "", m[3]) for m in re.finditer(pattern, DOC.read_text(), re.DOTALL)]


class Hosts:
    """Each host's folders and address: the page's names and paths, made this test's."""

    def __init__(self, root: Path, subnet: str) -> None:
        self.root = root
        self.subnet = subnet

    def ip(self, host: str) -> str:
        return f"{self.subnet}.{HOSTS[host]}"

    def local(self, host: str, text: str) -> str:
        """``text`` as seen on ``host``: host names become addresses, and ``/etc/fedps`` and
        ``/var/lib/fedps`` that host's folders."""
        for name in HOSTS:
            text = text.replace(f"{name}.example.net", self.ip(name))
        base = self.root / host
        return text.replace("/etc/fedps", f"{base}/etc").replace("/var/lib/fedps", f"{base}/var")

    def copy(self, line: str, host: str) -> list[str]:
        """Do one ``scp SOURCE... HOST:DIR`` line run on ``host``; the file names copied."""
        match = re.fullmatch(r"scp (\S+) ([\w-]+)\.example\.net:(\S+)", line.strip())
        assert match is not None, f"not an scp line: {line}"
        source, target, folder = match.groups()
        braces = re.fullmatch(r"(.*)\{(.*)\}", source)
        sources = [braces[1] + n for n in braces[2].split(",")] if braces else [source]
        destination = Path(self.local(target, folder))
        destination.mkdir(parents=True, exist_ok=True)
        for path in map(Path, (self.local(host, s) for s in sources)):
            if path.suffix == ".toml":  # the same file; its paths are the target's here
                text = path.read_text().replace(str(self.root / host), str(self.root / target))
                (destination / path.name).write_text(text)
            else:
                shutil.copy2(path, destination / path.name)  # keys keep mode 600
        return [Path(s).name for s in sources]


def _tails(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(logs.iterdir())
    )


def _name(args: list[str]) -> str:
    """A role's name from its command line: keyholder, shard-0, client-2..."""
    index = args[args.index("--index") + 1] if "--index" in args else ""
    return f"{args[0]}-{index}" if index else args[0]


class Guide:
    """The page run on its hosts: its commands, and the roles it started, by name.

    Parameters
    ----------
    world
        The hosts' folders and addresses.
    hosts
        Each host's network namespace.
    logs
        Where each role's output goes.
    """

    def __init__(self, world: Hosts, hosts: dict[str, str], logs: Path) -> None:
        self.world, self.hosts, self.logs = world, hosts, logs
        self.roles: dict[str, subprocess.Popen[bytes]] = {}
        self.paused: set[str] = set()

    def command(self, host: str, line: str) -> list[str]:
        """``line`` of the page as run on ``host`` (in its namespace)."""
        args = shlex.split(self.world.local(host, line))
        assert args[0] == "fedps", line
        return [
            "ip",
            "netns",
            "exec",
            self.hosts[host],
            sys.executable,
            "-m",
            "fedps.cli",
            *args[1:],
        ]

    def run(self, host: str, line: str) -> subprocess.CompletedProcess[str]:
        """Run a command of the page that ends (certs, status, join) on ``host``."""
        return subprocess.run(self.command(host, line), capture_output=True, text=True, check=False)

    def start(self, host: str, line: str) -> None:
        """Start a role of the page on ``host`` (it runs until stopped)."""
        name = _name(shlex.split(line)[1:])
        with open(self.logs / f"{name}.log", "ab") as log:
            self.roles[name] = subprocess.Popen(self.command(host, line), stdout=log, stderr=log)

    def check_alive(self) -> None:
        """Raise if a role exited (none of the page's roles ends before training does)."""
        exited = [n for n, p in self.roles.items() if p.poll() is not None]
        assert not exited, f"roles exited early: {exited}\n{_tails(self.logs)}"

    def kill(self, name: str) -> None:
        """SIGKILL role ``name`` (its host is lost)."""
        role = self.roles.pop(name)
        role.kill()
        role.wait(HANG_S)

    def pause(self, names: list[str], paused: bool) -> None:
        """SIGSTOP (``paused``) or SIGCONT roles ``names``."""
        for name in names:
            self.roles[name].send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
        self.paused = self.paused | set(names) if paused else self.paused - set(names)

    def wait(
        self, condition: Callable[[], bool], what: str, poll_s: float = 0.2, *, end: bool = False
    ) -> None:
        """Wait for ``condition`` (the suite's hang guard), failing at once if a role exited
        (``end``: waiting for the end of training, which the clients end with)."""

        def check() -> bool:
            if not end:
                self.check_alive()
            return condition()

        try:
            wait_for(check, what, poll_s=poll_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_tails(self.logs)}") from None

    def stop(self) -> None:
        """Stop every role still running."""
        self.pause(sorted(self.paused), False)
        for role in self.roles.values():
            role.terminate()
        for role in self.roles.values():
            try:
                role.wait(10)
            except subprocess.TimeoutExpired:
                role.kill()


@contextmanager
def _guide_running(
    tmp_path: Path,
    subnet: str,
    hosts: dict[str, str],
    blocks: list[tuple[str, str, str]],
    **sections: Mapping[str, object],
) -> Iterator[tuple[Guide, str]]:
    """The page's deployment up: host A's configuration from the page (``sections``: fields
    that replace the page's), its certificates, the files the page copies to hosts B and C,
    and every role started in the page's order; this process watches as the operator.
    Yields the guide and the coordinator's address; stops every role after."""
    world = Hosts(tmp_path, subnet)
    config_path = Path(world.local("host-a", "/etc/fedps/fedps.toml"))
    config_path.parent.mkdir(parents=True)
    config_path.write_text(world.local("host-a", blocks[0][2]))
    write_config(load_config(config_path, **sections), config_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    guide = Guide(world, hosts, logs)
    for _, host, text in blocks[1:2]:
        for line in text.splitlines():
            done = guide.run(host, line)
            assert done.returncode == 0, done.stdout + done.stderr
    copied = {name: "" for name in HOSTS}
    for _, host, text in blocks[2:3]:
        for line in text.splitlines():
            target = line.split()[-1].split(".")[0]
            copied[target] += " ".join(world.copy(line, host)) + " "
    assert "ca.key" not in copied["host-b"] + copied["host-c"]
    assert "enrolment.key" not in copied["host-b"] + copied["host-c"]
    try:
        for _, host, text in blocks[3:7]:
            for line in text.splitlines():
                guide.start(host, line)
        configure_tls(TlsIdentity.load(config_path.parent / "certs", OPERATOR_NAME))
        yield guide, load_config(config_path).cluster.coordinator
    finally:
        reset_tls()
        guide.stop()


def _guide_blocks() -> list[tuple[str, str, str]]:
    """The blocks of the deployment itself (not of "Losing host B")."""
    blocks = [b for b in _checked_blocks() if b[0] not in LOSS_KINDS]
    assert [k for k, _, _ in blocks] == ["config", "setup", "copy", *["start"] * 4, "check"]
    return blocks


def _cut(host: str, down: bool) -> None:
    """Take ``host``'s link down (or up again)."""
    _ip("link", "set", f"{PREFIX}v{HOSTS[host]}", "down" if down else "up")


def test_the_deployment_guide_runs_on_three_hosts(
    tmp_path: Path, subnet: str, hosts: dict[str, str]
) -> None:
    # Prepare: the page's deployment (3 rounds, a deadline that is a hang guard)
    blocks = _guide_blocks()
    training = {"rounds": ROUNDS, "deadline_s": DEADLINE_S}
    with _guide_running(tmp_path, subnet, hosts, blocks, training=training) as (guide, coordinator):
        # Execute: once round 1 is applied, cut host B's link for a few seconds (the
        # length of the cut, not a deadline: clients and coordinator wait out any length)
        guide.wait(lambda: reached(coordinator, 1), "round 1 applied")
        _cut("host-b", True)
        time.sleep(CUT_S)
        _cut("host-b", False)
        guide.wait(
            lambda: reached(coordinator, finished=True), "the end of training", 0.5, end=True
        )
        status = coordinator_status(coordinator)
        checks = [
            guide.run(host, line) for _, host, text in blocks[7:] for line in text.splitlines()
        ]
    # Assert: every round applied by all three clients despite the cut; roles bound
    # 0.0.0.0 and `fedps status` on host A finds every role up at its dialed address
    tail = _tails(guide.logs)
    assert status is not None and status.finished and status.round == ROUNDS, tail
    assert [r.abandoned for r in status.history] == [False] * ROUNDS
    assert all(r.contributors == 3 for r in status.history), tail
    assert "listening on 0.0.0.0:7100" in (guide.logs / "keyholder.log").read_text(), tail
    assert "listening on 0.0.0.0:7202" in (guide.logs / "shard-1.log").read_text(), tail
    for check in checks:
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.count(": up") == 5, check.stdout  # coordinator, key holder, shards
        assert f"shard-1 {guide.world.ip('host-b')}:7202: up" in check.stdout, check.stdout


def _shards_between_phases(config: FedPSConfig) -> bool:
    """Whether no round is closed on the shards and not yet applied, and every shard holds one
    version: a shard lost now is found by the round's push phase or the next round's check
    (a shard lost between a round's close and its application is waited for: docs/operations.md)."""
    statuses = []
    for sid, address in zip(config.cluster.shard_ids, config.cluster.shards, strict=True):
        stub = ShardStub(sid, address)
        try:
            statuses.append(stub.get_status(timeout_s=HANG_S))
        finally:
            stub.close()
    closed_unapplied = any(not s.round_open and s.open_round > s.version for s in statuses)
    return len({s.version for s in statuses}) == 1 and not closed_unapplied


def test_losing_host_b_for_good_moves_its_shards_to_host_a_and_it_comes_back_empty(
    tmp_path: Path, subnet: str, hosts: dict[str, str]
) -> None:
    # Prepare: the page's deployment; shards declared gone 3 s after their first unanswered
    # call, which fails at a 5 s deadline (the page's defaults would take minutes)
    blocks = _guide_blocks()
    loss = {k: (host, text.splitlines()) for k, host, text in _checked_blocks() if k in LOSS_KINDS}
    lost_shards = ["shard-0", "shard-1"]
    clients = [f"client-{i}" for i in range(3)]
    sections: dict[str, Mapping[str, object]] = {
        "training": {"rounds": LOSS_ROUNDS, "deadline_s": LOSS_DEADLINE_S},
        "cluster": {"shard_gone_after_s": 3.0},
        "security": {"shard_deadline_s": 5.0},
    }

    def ring_version(coordinator: str) -> int:
        status = coordinator_status(coordinator)
        return -1 if status is None else status.ring_version

    with _guide_running(tmp_path, subnet, hosts, blocks, **sections) as (guide, coordinator):
        config = load_config(Path(guide.world.local("host-a", "/etc/fedps/fedps.toml")))
        # Execute: once a round is applied, the deployment is frozen (SIGSTOP) at a moment no
        # round is closed and unapplied, host B is lost (its shards die, its link goes down)
        # and the rest goes on; once the shards are declared gone the clients are paused
        # until host B is back, so that rounds are left to train on the grown ring (a round
        # waits for its clients up to its deadline)
        frozen = ["keyholder", "coordinator", *clients]
        for round_ in range(1, LOSS_ROUNDS - 1):
            guide.wait(lambda: reached(coordinator, round_), f"round {round_} applied", 0.02)  # noqa: B023
            guide.pause(frozen, True)
            if _shards_between_phases(config):
                break
            guide.pause(frozen, False)
        else:
            raise AssertionError("no moment between a round's phases")
        lost_in = round_ + 1
        for name in lost_shards:
            guide.kill(name)
        _cut("host-b", True)
        guide.pause(frozen, False)
        guide.wait(lambda: ring_version(coordinator) == 2, "host B's shards declared gone", 0.02)
        guide.pause(clients, True)
        host, lines = loss["lost"]
        seen = [guide.run(host, line) for line in lines]
        # host B comes back, empty, and its shards join; then the clients go on
        _cut("host-b", False)
        host, lines = loss["rejoin"]
        for line in lines:
            guide.start(host, line)
        credentials = channel_credentials(
            TlsIdentity.load(Path(config.tls.directory), OPERATOR_NAME)
        )
        for address in config.cluster.shards[:2]:
            wait_serving(address, guide.check_alive, credentials)
        host, lines = loss["join"]
        joined = [guide.run(host, line) for line in lines]
        guide.pause(clients, False)
        guide.wait(
            lambda: reached(coordinator, finished=True), "the end of training", 0.5, end=True
        )
        status = coordinator_status(coordinator)
        checks = [
            guide.run(host, line) for _, host, text in blocks[7:] for line in text.splitlines()
        ]

    # Assert: `fedps status` showed both shards declared gone and shard-2 alone on the ring;
    # the joins were accepted; training finished, every round applied but, at most, the one
    # host B was lost in (abandoned at its deadline if its clients had not pulled the model
    # yet), and the last rounds on all three shards
    tail = _tails(guide.logs)
    for shown in seen:
        assert "shard ring version 2: shard-2" in shown.stdout, shown.stdout + shown.stderr
        assert shown.stdout.count("OFF THE RING (declared gone") == 2, shown.stdout
    for result in joined:
        assert result.returncode == 0, result.stdout + result.stderr
    assert status is not None and status.finished and status.round == LOSS_ROUNDS, tail
    abandoned = [r.round for r in status.history if r.abandoned]
    assert abandoned in ([], [lost_in]), (status.history, tail)
    assert (status.ring_version, tuple(status.ring_nodes)) == (4, ("shard-0", "shard-1", "shard-2"))
    moves = [m.split(" (")[0].split(": ")[1] for m in status.ring_moves]
    assert sorted(moves[:2]) == ["shard-0 removed", "shard-1 removed"], tail  # in either order
    assert moves[2:] == ["shard-0 added", "shard-1 added"], tail
    for check in checks:
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.count(": up") == 5, check.stdout
