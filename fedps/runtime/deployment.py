"""Start a whole fedps cluster as separate processes, supervise it, and stop it cleanly.

``fedps up CONFIG`` starts the key holder, every shard and the coordinator, then
:meth:`Deployment.supervise` restarts a role that dies (within a :class:`RestartPolicy`) and
prints one line per round until the coordinator reports training finished; ``fedps demo``
adds the edge clients and watches training through the coordinator's status RPC. Each role is
its own process (``python -m fedps.cli ROLE``) with its log in ``STATE_DIR/logs``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from crypto.files import private_directory, private_opener, write_atomic
from crypto.python_child import child_environment, python_command
from crypto.tls import OPERATOR_NAME, TlsIdentity
from fedps.config import FedPSConfig
from fedps.errors import FedPSError, PeerUnavailableError
from fedps.rpc.coordinator_messages import ClusterStatus, RoundSummary
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.transport import channel_credentials
from fedps.runtime.sweeper import sweep_after_exit
from fedps.stop_signal import stopped_cleanly

__all__ = [
    "CONFIG_ERROR_EXIT",
    "PROBE_OPTIONS",
    "Deployment",
    "RestartPolicy",
    "free_port",
    "local_cluster",
    "round_line",
    "write_config",
]

#: Exit status of a ``fedps`` command stopped by an expected error (a port in use, a locked
#: state directory, a corrupt state file, a bad configuration): restarting does not help.
CONFIG_ERROR_EXIT = 2

#: The prefix of the one line such a command writes on stderr.
_ERROR_PREFIX = "fedps: error: "

_log = logging.getLogger("fedps")

#: The options of a channel that waits for a role to serve: it tries to connect again every
#: 0.1 s. gRPC's default waits 1 s after the first refused attempt and 1.6 times longer after
#: each next one, so a role that starts in 6 s on a loaded machine would be seen serving at 9 s.
PROBE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def local_cluster(state_dir: Path, shards: int = 2, parties: int = 1) -> dict[str, object]:
    """A ``[cluster]`` section for one machine: every role on a free loopback port.

    With ``parties`` above 1, one address per key-holder party too.
    """
    return {
        "keyholder": f"127.0.0.1:{free_port()}",
        "coordinator": f"127.0.0.1:{free_port()}",
        "shards": [f"127.0.0.1:{free_port()}" for _ in range(shards)],
        "parties": [f"127.0.0.1:{free_port()}" for _ in range(parties if parties > 1 else 0)],
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
    """Write ``config`` as TOML (every field, ``None`` fields left out), mode 0600."""
    lines: list[str] = []
    for section, values in config.model_dump(mode="json").items():
        lines += _toml_table(section, values)
    write_atomic(path, "\n".join(lines).encode())


def _toml_table(name: str, values: dict[str, object]) -> list[str]:
    """Table ``name`` as TOML lines, its sub-tables (``[cluster.listen]``) after it."""
    tables = {k: v for k, v in values.items() if isinstance(v, dict)}
    lines = [f"[{name}]"]
    lines += [
        f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None and k not in tables
    ]
    lines.append("")
    for key, table in tables.items():
        lines += _toml_table(f"{name}.{key}", table)
    return lines


@dataclass(frozen=True)
class RestartPolicy:
    """How :meth:`Deployment.supervise` restarts a role that died.

    The n-th restart within ``window_s`` waits ``first_delay_s * 2**(n - 1)`` seconds (at most
    ``max_delay_s``); once a role has been restarted ``max_restarts`` times within
    ``window_s``, the next death stops the cluster instead.
    """

    max_restarts: int = 5
    window_s: float = 300.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, restarts: Sequence[float], now: float) -> float | None:
        """Seconds to wait before the next restart, given the (monotonic) times of the earlier ones.

        ``None`` when the limit is reached.
        """
        recent = sum(1 for t in restarts if now - t < self.window_s)
        if recent >= self.max_restarts:
            return None
        return float(min(self.max_delay_s, self.first_delay_s * 2**recent))


def round_line(record: RoundSummary, rounds: int) -> str:
    """One progress line for a finished round (:meth:`RoundSummary.line`).

    Such as ``round 3/10: 5 clients, accuracy 0.912, epsilon 1.84 (max), 4.2 s``.
    """
    return record.line(rounds)


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
        self.log_dir = private_directory(config.cluster.state_dir / "logs")
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        #: the server roles (key holder, shards, coordinator), in start order
        self.servers: list[str] = []
        #: words that start a role's command, by role (``["ip", "netns", "exec", NS]`` starts it
        #: in network namespace NS); kept for its restarts
        self.prefixes: dict[str, list[str]] = {}
        self._args: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()  # a stop from another thread sees every process started
        self._stopped = False

    def start(self, name: str, *args: str) -> None:
        """Start ``fedps ARGS --config CONFIG`` as process ``name`` (after its :attr:`prefixes`).

        With ``--insecure`` when the configuration turned TLS off, whatever the file says. Once
        this process has ended, however it ended, a sweeper stops whatever it left running
        (:func:`~fedps.runtime.sweeper.sweep_after_exit`).

        Raises
        ------
        FedPSError
            The deployment is stopped (:meth:`stop`, from another thread).
        """
        # python -P, this fedps first on the path: nothing of the working directory (a user's
        # ``server.py``) shadows fedps's packages in a role; the task loader puts the task's
        # folder on the path.
        cmd = python_command("-m", "fedps.cli", *args, "--config", str(self.config_path))
        cmd[:0] = self.prefixes.get(name, [])
        if self.config.tls.insecure:
            cmd.append("--insecure")
        env = child_environment({**os.environ, "PYTHONUNBUFFERED": "1"})
        sweep_after_exit()
        # 0600, as everything in the state folder; the child writes to it
        with self._lock, open(self.log_dir / f"{name}.log", "ab", opener=private_opener) as log:
            if self._stopped:
                raise FedPSError(f"{name} not started: the cluster is stopped")
            self.processes[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._args[name] = args

    def start_servers(self) -> None:
        """Key-holder parties, key holder, shards, then the coordinator; each waited for.

        Waits until each accepts connections.
        """
        cluster = self.config.cluster
        parties = cluster.parties if self.config.keyholder.parties > 1 else []
        for i in range(1, len(parties) + 1):
            self._start_server(f"party-{i}", "keyholder", "--party", str(i))
        self.wait_ready(parties)
        self._start_server("keyholder", "keyholder")
        for i in range(len(cluster.shards)):
            self._start_server(f"shard-{i}", "shard", "--index", str(i))
        self.wait_ready([cluster.keyholder, *cluster.shards])
        self._start_server("coordinator", "coordinator")
        self.wait_ready([cluster.coordinator])

    def finished_before(self) -> str:
        """Why nothing will be trained, or ``""``.

        Asked once the servers are up and before any client joins: nothing is trained when the state
        folder holds a run that finished, which the cluster resumes.
        """
        coordinator = CoordinatorStub(self.config.cluster.coordinator)
        try:
            status = coordinator.get_status(timeout_s=10.0)
        except FedPSError:  # no answer yet: the supervision's round lines will tell
            return ""
        finally:
            coordinator.close()
        if not status.finished:
            return ""
        return (
            f"the run in {self.config.cluster.state_dir} finished already ({status.round} "
            "rounds): nothing is trained; give another cluster.state_dir, or delete this one, "
            "to train again"
        )

    def _start_server(self, name: str, *args: str) -> None:
        self.start(name, *args)
        self.servers.append(name)

    def wait_ready(self, addresses: list[str], timeout_s: float = 120.0) -> None:
        """Block until every address accepts a gRPC connection.

        Under mutual TLS, one that presents the operator's certificate from ``tls.directory``.
        """
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
            return grpc.insecure_channel(address, options=PROBE_OPTIONS)
        operator = TlsIdentity.load(tls.directory, OPERATOR_NAME)
        return grpc.secure_channel(address, channel_credentials(operator), options=PROBE_OPTIONS)

    def check_alive(self, names: list[str] | None = None) -> None:
        """Raise if a server process (or one of ``names``) exited with an error, or on a stop.

        The error carries the process's one-line error if it stopped on one
        (:data:`CONFIG_ERROR_EXIT`), else the end of its log; after :meth:`stop` (from another
        thread: a wait for the cluster ends with it), that the cluster is stopped.
        """
        if self._stopped:
            raise FedPSError("the cluster is stopped")
        for name, proc in list(self.processes.items()):
            if names is not None and name not in names:
                continue
            code = proc.poll()
            if code == CONFIG_ERROR_EXIT:
                raise FedPSError(f"{name} stopped: {self.last_log_line(name)}")
            if code is not None and not stopped_cleanly(code):  # stopped on a signal: clean
                tail = self._log_tail(name)
                raise PeerUnavailableError(f"{name} exited with code {code}; its log ends:\n{tail}")

    def last_log_line(self, name: str) -> str:
        """The last line of process ``name``'s log.

        Its one-line error (without the ``fedps: error:`` prefix) if it wrote one, else its last
        non-empty line.
        """
        lines = [line.strip() for line in self._log_tail(name).splitlines() if line.strip()]
        for line in reversed(lines):
            if line.startswith(_ERROR_PREFIX):
                return line.removeprefix(_ERROR_PREFIX)
        return lines[-1] if lines else "(empty log)"

    def _log_tail(self, name: str) -> str:
        try:
            with open(self.log_dir / f"{name}.log", "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 2000))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def supervise(
        self,
        *,
        echo: Callable[[str], None],
        policy: RestartPolicy | None = None,
        poll_s: float = 1.0,
        linger_s: float = 10.0,
    ) -> ClusterStatus:
        """Keep the server roles up until the coordinator reports training finished.

        And until every registered client was told so (at most ``linger_s`` seconds more: a
        client that is gone never asks), so that polling clients hear it and exit cleanly.

        Every ``poll_s`` seconds: restart a role that exited (after the policy's backoff,
        logged with its exit code and last log line), ask the coordinator for its status (as
        this process's TLS identity: the operator's) and ``echo`` one :func:`round_line` per
        round finished since. Returns the final status; stops nothing (see :meth:`stop`).

        Raises
        ------
        FedPSError
            A role stopped on an expected error (exit :data:`CONFIG_ERROR_EXIT`: a port in
            use, a locked state directory, a corrupt file; restarting would not help), or
            died more often than the policy allows. The message is one line.
        """
        policy = policy or RestartPolicy()
        restarts: dict[str, list[float]] = {name: [] for name in self.servers}
        due: dict[str, float] = {}  # role -> when to restart it
        shown = 0
        finished_at: float | None = None
        rounds = self.config.training.rounds
        coordinator = CoordinatorStub(self.config.cluster.coordinator)
        try:
            while True:
                now = time.monotonic()
                for name in self.servers:
                    if name in due:
                        if now >= due[name]:
                            del due[name]
                            restarts[name].append(now)
                            self.start(name, *self._args[name])
                    elif (code := self.processes[name].poll()) is not None:
                        due[name] = now + self._restart_delay(name, code, restarts[name], policy)
                try:
                    status = coordinator.get_status(timeout_s=max(2.0, poll_s))
                except FedPSError:  # down or restarting: ask again next time
                    status = None
                if status is not None:
                    for record in status.history[shown:]:
                        echo(round_line(record, rounds))
                    shown = len(status.history)
                    if status.finished and finished_at is None:
                        finished_at = now
                        echo(
                            f"training finished after {status.round} rounds; stopping the "
                            f"cluster once every client has heard (at most {linger_s:.0f} s)"
                        )
                    heard = status.told_done >= status.registered
                    if finished_at is not None and (heard or now - finished_at >= linger_s):
                        return status
                time.sleep(poll_s)
        finally:
            coordinator.close()

    def _restart_delay(
        self, name: str, code: int, restarts: list[float], policy: RestartPolicy
    ) -> float:
        """How long to wait before restarting role ``name``, which exited with ``code``.

        Raises when it must not be restarted.
        """
        line = self.last_log_line(name)
        if code == CONFIG_ERROR_EXIT:
            raise FedPSError(f"{name} stopped: {line}")
        delay = policy.delay(restarts, time.monotonic())
        if delay is None:
            raise FedPSError(
                f"{name} died again after {policy.max_restarts} restarts within "
                f"{policy.window_s:.0f} s (exit code {code}: {line}); stopped the cluster, "
                f"see {self.log_dir}"
            )
        _log.warning(
            "%s exited with code %d (its log ends: %s); restarting it in %.0f s",
            name,
            code,
            line,
            delay,
        )
        return delay

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process: clients, coordinator, shards, key holder, and its parties last.

        Each group gets SIGTERM and ``grace_s`` seconds to exit, then SIGKILL. A SIGINT or SIGTERM
        to this process meanwhile is ignored, so no role outlives it.
        """
        with _signals_ignored():
            with self._lock:
                self._stopped = True
                processes = dict(self.processes)
            groups: dict[str, dict[str, subprocess.Popen[bytes]]] = {}
            for name in reversed(list(processes)):
                kind = "client" if name not in self.servers else name.split("-")[0]
                groups.setdefault(kind, {})[name] = processes[name]
            for procs in groups.values():
                _terminate(procs, grace_s)


def _terminate(procs: dict[str, subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM ``procs`` (by name), wait up to ``grace_s`` for them to exit, SIGKILL the rest."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    until = time.monotonic() + grace_s
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            _log.warning(
                "%s (pid %d) did not stop within %.0f s; killing it", name, proc.pid, grace_s
            )
            proc.kill()
            proc.wait()


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM inside the block.

    Only the main thread can; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: set outside Python, cannot be restored
                signal.signal(sig, handler)
