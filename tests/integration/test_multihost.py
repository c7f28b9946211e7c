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
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crypto.tls import OPERATOR_NAME, TlsIdentity, configure_tls
from fedps.config import load_config
from fedps.provisioning import reset_tls
from fedps.runtime.deployment import write_config
from tests.conftest import coordinator_status, reached
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


def test_the_deployment_guide_runs_on_three_hosts(
    tmp_path: Path, subnet: str, hosts: dict[str, str]
) -> None:
    # Prepare: host A's configuration from the page (3 rounds, a deadline that is a hang
    # guard), its certificates, and the files the page copies to hosts B and C
    blocks = _checked_blocks()
    assert [k for k, _, _ in blocks] == ["config", "setup", "copy", *["start"] * 4, "check"]
    world = Hosts(tmp_path, subnet)
    config_path = Path(world.local("host-a", "/etc/fedps/fedps.toml"))
    config_path.parent.mkdir(parents=True)
    config_path.write_text(world.local("host-a", blocks[0][2]))
    training = {"rounds": ROUNDS, "deadline_s": DEADLINE_S}
    write_config(load_config(config_path, training=training), config_path)
    fedps = [sys.executable, "-m", "fedps.cli"]

    def command(host: str, line: str) -> list[str]:
        args = shlex.split(world.local(host, line))
        assert args[0] == "fedps", line
        return ["ip", "netns", "exec", hosts[host], *fedps, *args[1:]]

    def run(host: str, line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command(host, line), capture_output=True, text=True, check=False)

    for _, host, text in blocks[1:2]:
        for line in text.splitlines():
            done = run(host, line)
            assert done.returncode == 0, done.stdout + done.stderr
    copied = {name: "" for name in HOSTS}
    for _, host, text in blocks[2:3]:
        for line in text.splitlines():
            target = line.split()[-1].split(".")[0]
            copied[target] += " ".join(world.copy(line, host)) + " "
    assert "ca.key" not in copied["host-b"] + copied["host-c"]
    assert "enrolment.key" not in copied["host-b"] + copied["host-c"]
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    names: list[str] = []
    coordinator = load_config(config_path).cluster.coordinator

    try:
        for _, host, text in blocks[3:7]:
            for line in text.splitlines():
                names.append(_name(shlex.split(line)[1:]))
                with open(logs / f"{names[-1]}.log", "wb") as log:
                    procs.append(subprocess.Popen(command(host, line), stdout=log, stderr=log))
        # this process watches as the operator
        configure_tls(TlsIdentity.load(config_path.parent / "certs", OPERATOR_NAME))

        # Execute: once round 1 is applied, cut host B's link for a few seconds (the
        # length of the cut, not a deadline: clients and coordinator wait out any length)
        def alive_and(condition: Callable[[], bool]) -> Callable[[], bool]:
            def check() -> bool:
                exited = [n for n, p in zip(names, procs, strict=True) if p.poll() is not None]
                assert not exited, f"roles exited early: {exited}\n{_tails(logs)}"
                return condition()

            return check

        try:
            wait_for(alive_and(lambda: reached(coordinator, 1)), "round 1 applied", poll_s=0.2)
            _ip("link", "set", f"{PREFIX}v{HOSTS['host-b']}", "down")
            time.sleep(CUT_S)
            _ip("link", "set", f"{PREFIX}v{HOSTS['host-b']}", "up")
            wait_for(lambda: reached(coordinator, finished=True), "the end of training", poll_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_tails(logs)}") from None
        status = coordinator_status(coordinator)
        checks = [run(host, line) for _, host, text in blocks[7:] for line in text.splitlines()]
    finally:
        reset_tls()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    # Assert: every round applied by all three clients despite the cut; roles bound
    # 0.0.0.0 and `fedps status` on host A finds every role up at its dialed address
    tail = _tails(logs)
    assert status is not None and status.finished and status.round == ROUNDS, tail
    assert [r.abandoned for r in status.history] == [False] * ROUNDS
    assert all(r.contributors == 3 for r in status.history), tail
    assert "listening on 0.0.0.0:7100" in (logs / "keyholder.log").read_text(), tail
    assert "listening on 0.0.0.0:7202" in (logs / "shard-1.log").read_text(), tail
    for check in checks:
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.count(": up") == 4, check.stdout  # coordinator, key holder, shards
        assert f"shard-1 {world.ip('host-b')}:7202: up" in check.stdout, check.stdout
