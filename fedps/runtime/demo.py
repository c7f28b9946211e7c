"""``fedps demo``: the whole platform on loopback, watched round by round.

Starts a key holder, the shards, a coordinator and the edge clients as separate processes on
free loopback ports, prints each round's accuracy, max epsilon over clients and bytes pushed
as the coordinator reports them, and returns a :class:`~fedps.runtime.demo_summary.DemoSummary`.
The run has its own certificates (mutual TLS, the default) and enrolment tokens in
``WORKDIR/certs``; the summary's ``tls`` says whether it ran under TLS.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from crypto.tls import OPERATOR_NAME
from fedps.ckks_params import ckks_params
from fedps.config import FedPSConfig, load_config, read_toml
from fedps.errors import ConfigError, FedPSError, PeerUnavailableError
from fedps.provisioning import provision_cluster, setup_tls
from fedps.rpc.coordinator_messages import ClusterStatus, RoundSummary
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.runtime.demo_summary import DemoSummary
from fedps.runtime.deployment import Deployment, local_cluster, write_config
from fedps.runtime.preflight import check_names
from fedps.units import size_text

__all__ = ["DEMO_LOGS", "ClientStarter", "Watcher", "run_demo"]

_STATE = "state"
#: Where a run's logs are (each process's ``NAME.log``), relative to its workdir.
DEMO_LOGS = f"{_STATE}/logs"

#: What watches a demo run besides its console: given the run's configuration and a way to print
#: a line, a context entered before the servers start and left after they stop.
Watcher = Callable[[FedPSConfig, Callable[[str], None]], AbstractContextManager[object]]
#: What starts a demo run's clients once its servers are up, in its deployment (by default
#: one ``fedps client`` process each).
ClientStarter = Callable[[Deployment], None]

#: What the watcher shows while the coordinator does not answer: nothing yet.
_NO_STATUS = ClusterStatus(
    run_id="",
    round=0,
    version=0,
    registered=0,
    finished=False,
    history=(),
    max_epsilon=0.0,
    delta=0.0,
    bytes_pushed=0,
    last_checkpoint_unix=0.0,
)


def run_demo(
    config_path: Path | None,
    workdir: Path,
    overrides: Mapping[str, Mapping[str, object]],
    *,
    console: Console | None = None,
    timeout_s: float = 1800.0,
    quiet: bool = False,
    client_data: Sequence[Path | Sequence[Path]] = (),
    watch: Watcher | None = None,
    start_clients: ClientStarter | None = None,
    on_round: Callable[[RoundSummary], None] | None = None,
) -> DemoSummary:
    """Run the demo; returns its summary (rounds, final accuracy, max epsilon, ...).

    ``client_data``: each client's own data (``fedps client --data``), one path (or several,
    pooled) per client in order; empty: none (a built-in task's clients are partitions of one
    dataset).
    ``watch``: entered once the run is configured and left when it stops, with the run's
    configuration and a function that prints one line (``fedps demo --ui`` serves the web
    dashboard this way). ``start_clients``: starts the clients instead of one ``fedps client``
    process each (``fedps bench --scale`` starts a few processes of many clients).
    ``on_round``: called with each finished round as the watcher sees it.
    """
    console = console or Console(stderr=False, quiet=quiet)
    shards, parties = _cluster_size(config_path, overrides)
    cluster = local_cluster(workdir / _STATE, shards, parties)
    # A fresh CA, certificates and enrolment tokens for this run's parties.
    tls = {**overrides.get("tls", {}), "directory": str(workdir / "certs"), "name": ""}
    merged: dict[str, Mapping[str, object]] = {**overrides, "cluster": cluster, "tls": tls}
    config = load_config(config_path, **merged)
    check_names(config)  # before a process starts, not when a client builds its data
    provision_cluster(config)
    setup_tls(config.tls, OPERATOR_NAME)  # for the watcher in this process
    path = workdir / "fedps.toml"
    write_config(config, path)
    t = config.training
    console.print(
        f"fedps demo: {t.dataset}, {t.clients} clients, {shards} shards, {t.rounds} rounds, "
        f"{'DP-SGD' if config.privacy.level == 'example' else 'client-level DP (DP-FedAvg)'} "
        f"(target epsilon {config.privacy.target_epsilon}, delta {config.privacy.delta}, "
        f"{config.privacy.noise_mode} noise), "
        f"CKKS {_ckks_text(config) if config.he.enabled else 'OFF'}, "
        f"{'mutual TLS' if config.tls.enabled else 'TLS OFF (--insecure)'}"
    )
    started = time.time()
    deployment = Deployment(path, config)
    coordinator = CoordinatorStub(config.cluster.coordinator)
    watchers = ExitStack()
    try:
        if watch is not None:

            def echo(line: str) -> None:  # a link whole: never wrapped, nor read as markup
                console.print(line, soft_wrap=True, markup=False, highlight=False)

            watchers.enter_context(watch(config, echo))
        console.print(
            f"starting the key holder ({_keys_text(config)}), {shards} "
            f"shard{'s' if shards > 1 else ''} and the coordinator ..."
        )
        deployment.start_servers()
        console.print(
            f"servers up after {time.time() - started:.0f} s; starting {t.clients} clients"
        )
        if start_clients is None:
            _start_clients(deployment, client_data)
        else:
            start_clients(deployment)
        status = _watch(deployment, coordinator, t.rounds, t.clients, console, timeout_s, on_round)
    finally:
        coordinator.close()
        deployment.stop()
        watchers.close()
    seconds = time.time() - started
    evaluated = [r for r in status.history if r.accuracy >= 0]
    noise = status.client_noise_multipliers
    summary = DemoSummary(
        rounds=status.round,
        final_accuracy=evaluated[-1].accuracy if evaluated else None,
        max_epsilon=status.max_epsilon,
        client_epsilons=tuple(status.client_epsilons[c] for c in sorted(status.client_epsilons)),
        client_noise_multipliers=tuple(noise[c] for c in sorted(noise)),
        delta=status.delta or config.privacy.delta,
        noise=config.privacy.noise_mode,
        bytes_pushed=status.bytes_pushed,
        seconds=round(seconds, 2),
        clients=t.clients,
        shards=shards,
        keyholder_parties=config.keyholder.parties,
        tls=config.tls.enabled,
        abandoned_rounds=sum(1 for r in status.history if r.abandoned),
        round_seconds=tuple(round(r.seconds, 3) for r in status.history),
        push_seconds=tuple(round(r.push_seconds, 3) for r in status.history),
        round_accuracy=tuple(
            (round(r.seconds, 3), r.accuracy if r.accuracy >= 0 else None) for r in status.history
        ),
        round_contributors=tuple(r.contributors for r in status.history),
        round_phases=tuple(dict(r.phases) for r in status.history),
        round_server_phases=tuple(dict(r.server_phases) for r in status.history),
        round_client_phases=tuple(
            {c: dict(p) for c, p in r.client_phases.items()} for r in status.history
        ),
    )
    accuracy = "-" if summary.final_accuracy is None else f"{summary.final_accuracy:.2%}"
    console.print(
        f"done in {seconds:.1f}s: accuracy {accuracy}, max epsilon "
        f"{status.max_epsilon:.3f} (delta {summary.delta:g}, {summary.noise} noise), "
        f"{size_text(status.bytes_pushed)} pushed"
    )
    return summary


def _cluster_size(
    config_path: Path | None, overrides: Mapping[str, Mapping[str, object]]
) -> tuple[int, int]:
    """The shards and key-holder parties a run asks for, before its cluster has addresses.

    (Parties need their addresses to validate: the count is read as written, and checked
    with the whole configuration once the addresses are there.)
    """
    raw = read_toml(config_path, "config") if config_path is not None else {}
    written = raw.get("keyholder", {})
    keyholder = {**(written if isinstance(written, dict) else {}), **overrides.get("keyholder", {})}
    parties = keyholder.get("parties", 1)
    single = {**overrides, "keyholder": {**keyholder, "parties": 1, "threshold": 0}}
    shards = len(load_config(config_path, **single).cluster.shards)
    return shards, parties if isinstance(parties, int) else 1


def _keys_text(config: FedPSConfig) -> str:
    """Who holds the key: the key holder, or its parties' threshold."""
    k = config.keyholder
    if k.parties <= 1:
        return "keys"
    return f"{k.parties} parties, any {k.quorum} decrypt"


def _data_options(data: Path | Sequence[Path]) -> list[str]:
    """``fedps client``'s options for its own data: ``--data PATH`` for each file."""
    files = [data] if isinstance(data, Path) else list(data)
    return [option for path in files for option in ("--data", str(path))]


def _ckks_text(config: FedPSConfig) -> str:
    """The run's CKKS parameters in a few words (``N 2048, q 45 bits, scale 2^37``)."""
    p = ckks_params(config)
    return f"N {p.poly_modulus_degree}, q {p.coeff_modulus_bits} bits, scale 2^{p.scale_bits}"


def _start_clients(deployment: Deployment, client_data: Sequence[Path | Sequence[Path]]) -> None:
    """One ``fedps client`` process per client, each with its data in ``client_data``, if any."""
    t = deployment.config.training
    # The cores go to the clients: one alone (a centralised baseline) trains on all.
    threads = str(max(1, (os.cpu_count() or 1) // t.clients))
    if client_data and len(client_data) != t.clients:
        raise ConfigError(f"{len(client_data)} client data paths for {t.clients} clients")
    for i in range(t.clients):
        data = _data_options(client_data[i]) if client_data else []
        deployment.start(f"client-{i}", "client", "--index", str(i), "--threads", threads, *data)


def _watch(
    deployment: Deployment,
    coordinator: CoordinatorStub,
    rounds: int,
    clients: int,
    console: Console,
    timeout_s: float,
    on_round: Callable[[RoundSummary], None] | None,
) -> ClusterStatus:
    shown = 0
    joined = 0  # clients registered, said until round 1 is done
    until = time.time() + timeout_s
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("training", total=rounds)
        while True:
            servers = [n for n in deployment.processes if not n.startswith("client")]
            deployment.check_alive(servers)
            try:
                status = coordinator.get_status()
            except FedPSError:
                status = _NO_STATUS
            if not status.history and status.registered > joined:
                joined = status.registered
                progress.console.print(f"clients joined {joined}/{clients}")
            for record in status.history[shown:]:
                acc = f"{record.accuracy:.4f}" if record.accuracy >= 0 else "  -   "
                note = "  (abandoned: no quorum)" if record.abandoned else ""
                progress.console.print(
                    f"round {record.round:3d}  acc {acc}  eps {record.max_epsilon:5.2f}  "
                    f"clients {record.contributors}  {size_text(record.bytes_pushed):>9}  "
                    f"{record.seconds:4.1f}s{note}"
                )
                if on_round is not None:
                    on_round(record)
            shown = len(status.history)
            progress.update(task, completed=status.round)
            if status.finished:
                return status
            processes = [p for n, p in deployment.processes.items() if n.startswith("client")]
            if processes and all(p.poll() is not None for p in processes) and status.round < rounds:
                raise PeerUnavailableError(
                    f"every client exited before training finished; see {deployment.log_dir}"
                )
            if time.time() > until:
                raise PeerUnavailableError("the demo timed out")
            time.sleep(0.3)
