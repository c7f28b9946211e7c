"""Flower at scale: round time, bytes pushed and shard memory for 100 to 1,000 nodes.

For each cohort size a fresh key holder and two shards start as processes on loopback (so
each shard's peak resident memory can be read from ``/proc``), and
:class:`~server.flower.flower_strategy.FlowerStrategy` runs ``rounds`` rounds through Flower's own
``Strategy.start`` loop over an :class:`~server.flower.in_process_grid.InProcessGrid`: every virtual
node runs the same ``ClientApp`` that Flower's simulation runtime would run (DP-SGD,
encryption, commitments, signed pushes to the shards), on a thread pool instead of Ray actors.

A shard keeps one running sum per block it owns whatever the number of clients, plus a
manifest entry (weight, 32-byte commitment) per client and block; its peak memory should
therefore stay nearly flat from 100 to 1,000 clients. The ``ClientApp`` is passed in (the
caller builds it from :mod:`clients.flower.flower_client`), so this module imports no client code.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from crypto.enrolment import issue_tokens
from fedps.bench.benchmark import machine_description, status_mib
from fedps.ckks_params import ckks_params
from fedps.config import FedPSConfig, load_config
from fedps.provisioning import client_identities
from fedps.runtime.deployment import Deployment, local_cluster, write_config
from server.flower.flower_strategy import FlowerStrategy
from server.flower.in_process_grid import InProcessGrid

__all__ = ["RUNTIMES", "bench_config", "run_flower_bench", "start_ray"]

_log = logging.getLogger("fedps")


def _run_pool(
    strategy: FlowerStrategy, client_app: ClientApp, *, nodes: int, rounds: int, workers: int
) -> None:
    """Flower's ``Strategy.start`` over fedps's in-process node pool."""
    grid = InProcessGrid(client_app, nodes, workers=workers)
    try:
        strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=rounds)
    finally:
        grid.close()


def start_ray(num_cpus: int) -> None:
    """Start Ray's local node the way Flower's Ray backend would, retrying a slow start.

    Ray waits a fixed 30 s for its raylet to register with its GCS; on a loaded 2-core machine
    that can run out. A start that timed out is retried from scratch; Flower's simulation
    runtime then finds Ray running and uses it.
    """
    import ray

    pythonpath = os.pathsep.join(sys.path)
    for attempt in range(3):
        try:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for this
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise


def simulate(server_app: ServerApp, client_app: ClientApp, *, nodes: int, workers: int) -> None:
    """Run Flower's own simulation runtime on a Ray node started by :func:`start_ray`.

    The runtime is a ServerApp thread and Ray actors for the nodes; Ray is shut down afterwards.
    """
    import ray
    from flwr.simulation import run_simulation

    start_ray(num_cpus=workers)
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=nodes,
            backend_config={
                "client_resources": {"num_cpus": 1},
                "init_args": {"num_cpus": workers, "include_dashboard": False},
            },
        )
    finally:
        ray.shutdown()


def _run_simulation(
    strategy: FlowerStrategy, client_app: ClientApp, *, nodes: int, rounds: int, workers: int
) -> None:
    """The benchmark's strategy as a ServerApp, through :func:`simulate`."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=rounds)

    simulate(server_app, client_app, nodes=nodes, workers=workers)


#: How the nodes run: ``"pool"`` (:class:`InProcessGrid`, threads) or ``"simulation"``
#: (``flwr.simulation.run_simulation``, one Ray actor per worker).
RUNTIMES = {"pool": _run_pool, "simulation": _run_simulation}


def bench_config(
    state_dir: Path, *, clients: int, max_clients: int, rounds: int, model: str, dataset: str
) -> FedPSConfig:
    """A one-machine cluster (key holder, 2 shards) for ``clients`` nodes.

    Its CKKS parameters are sized for ``max_clients`` (the same for every cohort size, for a fair
    comparison).

    Without TLS, explicitly: the nodes share this process, which can hold one certificate;
    each node proves its identity with its enrolment token (``state_dir/certs``, written by
    the benchmark run).
    """
    return load_config(
        None,
        cluster=local_cluster(state_dir),
        training={
            "dataset": dataset,
            "model": model,
            "clients": clients,
            "min_quorum": 2,
            "rounds": rounds,
            "deadline_s": 3600.0,
            "eval_every": rounds,
        },
        he={"max_clients": max_clients},
        tls={"insecure": True, "directory": str(state_dir / "certs")},
    )


def _memory_mib(pid: int) -> dict[str, float]:
    """Current (VmRSS) and peak (VmHWM) resident memory of a process, in MiB."""
    return {"rss_mib": status_mib(pid, "VmRSS"), "peak_rss_mib": status_mib(pid, "VmHWM")}


def _run_size(
    client_app: Callable[[FedPSConfig], ClientApp],
    *,
    clients: int,
    max_clients: int,
    rounds: int,
    model: str,
    dataset: str,
    workers: int,
    runtime: str,
) -> dict[str, Any]:
    drive = RUNTIMES[runtime]
    with tempfile.TemporaryDirectory(prefix="fedps-flower-bench-") as tmp:
        work = Path(tmp)
        config = bench_config(
            work / "state",
            clients=clients,
            max_clients=max_clients,
            rounds=rounds,
            model=model,
            dataset=dataset,
        )
        issue_tokens(config.tls.directory, client_identities(config))
        path = work / "fedps.toml"
        write_config(config, path)
        deployment = Deployment(path, config)
        try:
            deployment.start("keyholder", "keyholder")
            shards = [f"shard-{i}" for i in range(len(config.cluster.shards))]
            for i, name in enumerate(shards):
                deployment.start(name, "shard", "--index", str(i))
            deployment.wait_ready([config.cluster.keyholder, *config.cluster.shards])
            idle = {s: _memory_mib(deployment.processes[s].pid) for s in shards}
            # Clients pin the key holder's signing key, as a deployment would.
            pub = config.cluster.state_dir / "keyholder" / "keys" / "signing.pub"
            security = config.security.model_copy(update={"keyholder_key": pub.read_text().strip()})
            config = config.model_copy(update={"security": security})
            strategy = FlowerStrategy(config, state_dir=work / "flower")
            started = time.perf_counter()
            drive(strategy, client_app(config), nodes=clients, rounds=rounds, workers=workers)
            wall = time.perf_counter() - started
            deployment.check_alive()
            memory = {s: _memory_mib(deployment.processes[s].pid) for s in shards}
        finally:
            deployment.stop()
    history = strategy.coordinator.history
    seconds = [r.seconds for r in history]
    if len(history) != rounds:
        raise RuntimeError(f"{runtime}: {len(history)} of {rounds} rounds ran")
    return {
        "runtime": runtime,
        "clients": clients,
        "num_params": strategy.coordinator.layout.num_params,
        "blocks": strategy.coordinator.layout.num_blocks,
        "rounds": [
            {
                "round": r.round,
                "contributors": r.contributors,
                "seconds": r.seconds,
                "bytes_pushed": r.bytes_pushed,
                "max_epsilon": r.max_epsilon,
                "abandoned": r.abandoned,
            }
            for r in history
        ],
        "median_round_s": statistics.median(seconds) if seconds else None,
        # Everything outside the rounds: registration (each node builds its client), and
        # opening the first round.
        "setup_s": wall - sum(seconds),
        "bytes_per_client": history[-1].bytes_pushed / max(1, history[-1].contributors),
        "shards_idle": idle,
        "shards_after": memory,
        "shard_peak_rss_mib": max(m["peak_rss_mib"] for m in memory.values()),
    }


def run_flower_bench(
    client_app: Callable[[FedPSConfig], ClientApp],
    *,
    sizes: Sequence[int] = (100, 500, 1000),
    rounds: int = 2,
    model: str = "mlp",
    dataset: str = "mnist5k",
    workers: int = 2,
    runtime: str = "pool",
    max_clients: int | None = None,
) -> dict[str, Any]:
    """Round time, bytes pushed and shard memory for each cohort size in ``sizes``.

    Parameters
    ----------
    client_app
        Builds the ``ClientApp`` for a configuration (e.g.
        ``lambda c: create_client_app(c, cache_size=n)`` from :mod:`clients.flower.flower_client`).
    sizes
        Cohort sizes; every node trains in every round.
    rounds
        Rounds per size.
    model, dataset
        The model trained (registered in :mod:`fedps.learning.models`) and the data partitioned over
        the nodes.
    workers
        Threads (``"pool"``) or Ray actors (``"simulation"``) executing the nodes' messages.
    runtime
        A key of :data:`RUNTIMES`.
    max_clients
        The cohort the CKKS parameters are sized for (default: the largest size), the same
        for every size so that bytes and memory compare.

    Returns
    -------
    dict
        ``{"machine", "params", "sizes": [...], "shard_memory_ratio"}``; the ratio is the
        largest size's shard peak RSS over the smallest's.

    Raises
    ------
    ValueError
        For an unknown runtime.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {sorted(RUNTIMES)}")
    largest = max_clients or max(sizes)
    results: dict[str, Any] = {"machine": machine_description(), "sizes": []}
    for clients in sizes:
        _log.warning("flower bench: %d clients, %d rounds", clients, rounds)
        results["sizes"].append(
            _run_size(
                client_app,
                clients=clients,
                max_clients=largest,
                rounds=rounds,
                model=model,
                dataset=dataset,
                workers=workers,
                runtime=runtime,
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        sample = bench_config(
            Path(tmp), clients=largest, max_clients=largest, rounds=1, model=model, dataset=dataset
        )
    results["params"] = ckks_params(sample).__dict__
    peaks = [s["shard_peak_rss_mib"] for s in results["sizes"]]
    results["shard_memory_ratio"] = peaks[-1] / peaks[0]
    return results
