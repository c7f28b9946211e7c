"""Nothing a fedps command starts outlives it, whichever signal ends it.

For each command (``demo``, ``experiment``, ``up`` (alone, and with key-holder parties: once
every party process runs), ``ui``, ``client``) a test starts four of
it at once on a tiny run, each with a marker in its environment (which everything it starts
inherits) and its own temporary directory (``TMPDIR``). Once a command has started its first
role (the client: once it is up, it starts nothing before training), it gets SIGTERM, SIGHUP,
SIGINT or SIGKILL. Every command must end by its signal (a shell sees 128+N, systemd a clean
stop after SIGTERM), after its clean-up for the signals it can handle; 5 s after it exited, no
marked process may run and its temporary directory must be empty. Every other wait is bounded
only to catch a hang.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fedps.runtime.deployment import local_cluster
from tests.processes_left import kill_left, marked_environment, processes_left
from tests.role_processes import HANG_S, start_fedps, write_local_config
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL)
#: How long after a command exited none of what it started may be left (issue 30).
LEFT_AFTER_S = 5.0
#: A tiny run: one round of two clients.
TRAINING = {"rounds": 1, "clients": 2, "min_quorum": 2}
#: The command line of a role or client that fedps started (python -P, see crypto.python_child).
ROLE = " -P -m fedps.cli "
#: Key-holder parties of the ``up-parties`` case.
PARTIES = 3


@dataclass
class Run:
    """One command under test, the signal it gets and where it keeps its things."""

    sig: signal.Signals
    root: Path
    mark: str
    proc: subprocess.Popen[bytes]
    exited_at: float = 0.0

    @property
    def tmp(self) -> Path:
        """The command's temporary directory."""
        return self.root / "tmp"

    @property
    def output(self) -> str:
        return (self.root / "out.log").read_text(errors="replace")

    def has_started_a_role(self) -> bool:
        return any(ROLE in p.command for p in processes_left(self.mark) if p.pid != self.proc.pid)


#: What a command is given, from its folder: its arguments.
Arguments = Callable[[Path], list[str]]
#: What makes a command start its children (it returns once they are asked for), and what says
#: that it reached the point where it gets its signal.
Prepare = Callable[[Run], None]
Ready = Callable[[Run], bool]


def _config(root: Path) -> str:
    return str(write_local_config(root, training=TRAINING)[0])


def _config_with_parties(root: Path) -> str:
    """A tiny run's configuration with three key-holder parties, any two of which decrypt."""
    cluster = local_cluster(root / "state", parties=PARTIES)
    keyholder = {"parties": PARTIES, "threshold": 2}
    return str(write_local_config(root, training=TRAINING, cluster=cluster, keyholder=keyholder)[0])


def _grid(root: Path) -> str:
    grid = root / "grid.toml"
    grid.write_text(
        "[training]\nrounds = 1\nclients = 2\n\n[tls]\ninsecure = true\nenabled = false\n\n"
        "[grid]\nseed = [0]\n"
    )
    return str(grid)


def _nothing(run: Run) -> None:
    """Most commands start their children by themselves."""


def _start_a_run_from_the_page(run: Run) -> None:
    """``fedps ui``: the operator starts a run (its link printed, with the operator's token)."""
    pattern = re.compile(r"operator: (http://\S+)/\?token=(\S+)\)")
    wait_for(
        lambda: pattern.search(run.output) is not None or run.proc.poll() is not None,
        "the dashboard's links",
        hang_s=HANG_S,
    )
    found = pattern.search(run.output)
    assert found is not None, run.output
    base, token = found.groups()
    reply = httpx.post(
        f"{base}/api/runs", json={}, headers={"Authorization": f"Bearer {token}"}, timeout=HANG_S
    )
    assert reply.status_code == 202, reply.text


def _parties_started(run: Run) -> bool:
    """``fedps up`` with key-holder parties: every party process runs."""
    started = [p for p in processes_left(run.mark) if f"{ROLE}keyholder --party" in p.command]
    return len(started) == PARTIES


def _client_is_up(run: Run) -> bool:
    """The client's signal handlers are set: it said that its traffic is not encrypted.

    (No cluster answers it: it would start its encryption workers only after a round.)
    """
    return "traffic of client-0 is unencrypted" in run.output


COMMANDS: dict[str, tuple[Arguments, Prepare, Ready]] = {
    "demo": (
        lambda root: ["demo", "--rounds", "1", "--clients", "2", "--insecure"],
        _nothing,
        Run.has_started_a_role,
    ),
    "experiment": (
        lambda root: ["experiment", _grid(root), "--results", str(root / "results.jsonl")],
        _nothing,
        Run.has_started_a_role,
    ),
    "up": (lambda root: ["up", _config(root), "--insecure"], _nothing, Run.has_started_a_role),
    "up-parties": (
        lambda root: ["up", _config_with_parties(root), "--insecure"],
        _nothing,
        _parties_started,
    ),
    "ui": (
        lambda root: ["ui", "--config", _config(root), "--insecure", "--bind", "127.0.0.1:0"],
        _start_a_run_from_the_page,
        Run.has_started_a_role,
    ),
    "client": (
        lambda root: [
            *("client", "--config", _config(root), "--index", "0", "--insecure"),
        ],
        _nothing,
        _client_is_up,
    ),
}


@pytest.fixture(params=list(COMMANDS))
def command(request: pytest.FixtureRequest) -> str:
    """The command under test."""
    name: str = request.param
    return name


def _start(sig: signal.Signals, root: Path, arguments: Arguments) -> Run:
    """The command of ``arguments``, marked, with its own temporary directory in ``root``."""
    (root / "tmp").mkdir(parents=True)
    env, mark = marked_environment({"TMPDIR": str(root / "tmp")})
    proc = start_fedps(*arguments(root), log=root / "out.log", env=env, cwd=root)
    return Run(sig, root, mark, proc)


def _kill(runs: list[Run]) -> None:
    """Kill what is left of ``runs`` (at a test's end)."""
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        kill_left(run.mark)


@pytest.fixture
def runs(command: str, tmp_path: Path) -> Iterator[list[Run]]:
    """The command, once per signal, started (killed at the end, with what it left)."""
    started = [_start(sig, tmp_path / sig.name, COMMANDS[command][0]) for sig in SIGNALS]
    yield started
    _kill(started)


def _signal_once_ready(runs: list[Run], ready: Ready) -> None:
    """Send each run its signal once it is ready."""
    waiting = list(runs)
    until = time.monotonic() + HANG_S
    while waiting:
        for run in list(waiting):
            assert run.proc.poll() is None, f"{run.sig.name}: exited early:\n{run.output}"
            if ready(run):
                run.proc.send_signal(run.sig)
                waiting.remove(run)
        assert time.monotonic() < until, f"hang guard: never ready:\n{waiting[0].output}"
        time.sleep(0.05)


def _wait_exits(runs: list[Run]) -> None:
    """Wait until every run exited, noting when."""
    until = time.monotonic() + HANG_S
    while running := [run for run in runs if not run.exited_at]:
        for run in running:
            if run.proc.poll() is not None:
                run.exited_at = time.monotonic()
        assert time.monotonic() < until, f"hang guard: {running[0].sig.name} did not exit"
        time.sleep(0.05)


def _is_torch_cache(path: Path) -> bool:
    """Torch's compile cache (``torchinductor_USER``), which a client that trained makes in its
    temporary directory: shared by the user's processes and kept by design, not fedps's."""
    return path.name.startswith("torchinductor_")


def _left_after_exit(runs: list[Run], *, files: bool = True) -> dict[str, list[str]]:
    """What each run left (processes, and temporary files unless not ``files``) once it was
    gone, or LEFT_AFTER_S after it exited; runs that left nothing are not named."""
    left: dict[str, list[str]] = {}
    pending = list(runs)
    while pending:
        for run in list(pending):
            what = [str(p) for p in processes_left(run.mark)]
            what += [str(f) for f in run.tmp.iterdir() if not _is_torch_cache(f)] if files else []
            if not what:
                pending.remove(run)
            elif time.monotonic() >= run.exited_at + LEFT_AFTER_S:
                left[run.sig.name] = what
                pending.remove(run)
        time.sleep(0.05)
    return left


def _assert_ended_by_their_signals(runs: list[Run]) -> None:
    codes = {run.sig.name: run.proc.returncode for run in runs}
    assert codes == {run.sig.name: -run.sig for run in runs}, "\n\n".join(
        f"{run.sig.name}: exit {run.proc.returncode}:\n{run.output}" for run in runs
    )


def _assert_nothing_left(runs: list[Run], left: dict[str, list[str]]) -> None:
    assert not left, "\n\n".join(
        f"{run.sig.name} left {left[run.sig.name]}; its output:\n{run.output}"
        for run in runs
        if run.sig.name in left
    )


def test_nothing_a_command_started_outlives_it_whatever_signal_ends_it(
    command: str, runs: list[Run]
) -> None:
    # Prepare: the ui's operator starts a run
    _, prepare, ready = COMMANDS[command]
    for run in runs:
        prepare(run)

    # Execute: each its signal once it started its first role (the client: once it is up)
    _signal_once_ready(runs, ready)
    _wait_exits(runs)

    # Assert: each ended by its signal (after its clean-up, SIGKILL aside: a shell sees 128+N);
    # 5 s after it exited nothing it started runs and its temporary folders are gone
    _assert_ended_by_their_signals(runs)
    _assert_nothing_left(runs, _left_after_exit(runs))


#: Three clients, each needed in every round: after round 1 each waits for round 2 with its
#: encryption worker (crypto.zero_worker, a process of its own) drawing its next zeros.
WORKER_TRAINING = {"rounds": 3, "clients": 3, "min_quorum": 3}
#: The command line of a client's encryption worker.
ZERO_WORKER = "from crypto.zero_worker import main"


def _parent(pid: int) -> int:
    """The id of ``pid``'s parent (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command's name may hold spaces


def _has_an_encryption_worker(run: Run) -> bool:
    """The client's encryption worker runs, a child process of its own."""
    return any(
        ZERO_WORKER in p.command and _parent(p.pid) == run.proc.pid
        for p in processes_left(run.mark)
    )


def _client(config: str, index: int) -> Arguments:
    return lambda root: ["client", "--config", config, "--index", str(index), "--insecure"]


@pytest.fixture
def clients_at_work(tmp_path: Path) -> Iterator[list[Run]]:
    """A cluster (``fedps up``) and its three clients, of which the first two get SIGTERM and
    SIGKILL (killed at the end, with what they left)."""
    config = str(write_local_config(tmp_path, training=WORKER_TRAINING)[0])
    up = _start(signal.SIGTERM, tmp_path / "up", lambda root: ["up", config, "--insecure"])
    clients = [
        _start(sig, tmp_path / f"client-{index}", _client(config, index))
        for index, sig in enumerate((signal.SIGTERM, signal.SIGKILL, signal.SIGTERM))
    ]
    yield clients[:2]
    _kill([*clients, up])


def test_a_client_leaves_no_encryption_worker_whatever_signal_ends_it(
    clients_at_work: list[Run],
) -> None:
    # Execute: each client its signal once its encryption worker runs
    _signal_once_ready(clients_at_work, _has_an_encryption_worker)
    _wait_exits(clients_at_work)

    # Assert: each ended by its signal; 5 s after it exited its worker is gone, and so are the
    # temporary files of the client that got SIGTERM (a SIGKILLed process's private SEAL folder
    # goes with the next fedps process's start: crypto._seal_io)
    _assert_ended_by_their_signals(clients_at_work)
    terminated, killed = clients_at_work
    left = {**_left_after_exit([terminated]), **_left_after_exit([killed], files=False)}
    _assert_nothing_left(clients_at_work, left)
