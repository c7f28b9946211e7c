"""``fedps bench --against flower`` and ``--profile``: one job on Flower and fedps, in one run.

And where fedps's rounds go.

A job (:class:`Job`) is a model trained on a dataset by a number of clients for a number of
rounds, with DP-SGD at a fixed noise multiplier. Each repeat runs it three times, one after
the other: Flower's plain FedAvg with Opacus (:mod:`fedps.bench.flower_baseline`, in a process
group of its own, ended afterwards with every process Ray started in it), fedps secure and
fedps plaintext (``he.enabled = false``), both the whole platform on loopback as ``fedps demo``
runs it (mutual TLS, a process per role). Every run reports its rounds' seconds; the
comparison takes the median of rounds 2..R (the first pays for starting up) over the repeats,
the ratios fedps / Flower, the final accuracy, the largest epsilon, the bytes per parameter
each client sends per round, and fedps's phase profile
(:func:`fedps.bench.round_profile.phase_profile`). The machine's load average is sampled
while each run lasts: the figures are only comparable on a quiet machine.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from crypto.python_child import child_environment, python_command
from fedps.bench.round_profile import phase_profile
from fedps.config import load_config
from fedps.errors import ConfigError, FedPSError
from fedps.learning.tasks import load_task
from fedps.runtime.demo import run_demo
from fedps.runtime.demo_summary import DemoSummary
from fedps.runtime.deployment import write_config

__all__ = [
    "JOBS",
    "SYSTEMS",
    "Job",
    "compare",
    "job_named",
    "run_fedps",
    "run_flower",
    "timed_with_load",
]

_log = logging.getLogger("fedps")

#: The systems a comparison runs, in the order each repeat runs them.
SYSTEMS = ("flower", "flower-ghost", "secure", "plaintext")
#: How each Flower system clips its per-sample gradients (Opacus's hooks, or ghost clipping).
_FLOWER_CLIPPING = {"flower": "per_sample", "flower-ghost": "ghost"}
#: How often the load average is sampled while a run lasts (seconds).
_LOAD_EVERY_S = 5.0
#: How long the Flower process may run (a hang guard), and its grace to stop on SIGTERM.
_FLOWER_TIMEOUT_S = 3600.0
_GRACE_S = 10.0


@dataclass(frozen=True)
class Job:
    """One training job, run the same way by each system.

    Attributes
    ----------
    name
        How the results name it.
    model, dataset
        The model (:mod:`fedps.learning.models`) and the built-in dataset it trains on.
    rounds, clients
        Rounds, and clients in each (every client every round).
    noise_multiplier
        DP-SGD's noise multiplier (the clipping norm, batch size, learning rate and local
        epochs are the configuration's defaults, the same for both systems).
    """

    name: str
    model: str
    rounds: int
    dataset: str = "digits"
    clients: int = 4
    noise_multiplier: float = 1.5

    def sections(self) -> dict[str, dict[str, object]]:
        """The configuration sections that make a fedps configuration this job."""
        return {
            "training": {
                "dataset": self.dataset,
                "model": self.model,
                "rounds": self.rounds,
                "clients": self.clients,
                "eval_every": 1,
            },
            "privacy": {"noise_multiplier": self.noise_multiplier},
        }


#: The built-in jobs: the digits MLP of the demo, an MLP of 1.07M parameters, and one of 10M.
JOBS = {
    "digits": Job("digits", model="mlp", rounds=40),
    "mlp1m": Job("mlp1m", model="mlp1m", rounds=10),
    # what a client uploads at 10M parameters (--compression): two clients, two rounds
    "mlp10m": Job("mlp10m", model="mlp10m", rounds=2, clients=2),
}


def job_named(name: str, rounds: int = 0) -> Job:
    """The built-in job ``name``, with ``rounds`` rounds instead of its own (0: its own).

    Raises
    ------
    ConfigError
        For an unknown job.
    """
    try:
        job = JOBS[name]
    except KeyError:
        raise ConfigError(f"unknown job {name!r}; choose one of {sorted(JOBS)}") from None
    if rounds:
        return Job(job.name, job.model, rounds, job.dataset, job.clients, job.noise_multiplier)
    return job


class _LoadSampler:
    """The 1-minute load average, sampled every :data:`_LOAD_EVERY_S` while it runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(_LOAD_EVERY_S):
                return

    @contextmanager
    def sampling(self) -> Iterator[_LoadSampler]:
        """Sample while the block runs."""
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict[str, float]:
        """The lowest, mean and highest load sampled."""
        return {
            "min": min(self.samples),
            "mean": statistics.fmean(self.samples),
            "max": max(self.samples),
        }


def _threads(clients: int) -> int:
    """Torch threads per client.

    The machine's cores shared by the clients, as ``fedps demo`` gives its clients.
    """
    return max(1, (os.cpu_count() or 1) // clients)


def _num_params(job: Job) -> int:
    """The job's model size (the bytes per parameter divide by it)."""
    config = load_config(None, **job.sections())
    model = load_task(config).create_model(config.training.seed)
    return sum(p.numel() for p in model.parameters())


def run_fedps(
    job: Job,
    *,
    encrypted: bool,
    compression: Mapping[str, object] | None = None,
    keyholder: Mapping[str, object] | None = None,
) -> tuple[dict[str, Any], DemoSummary]:
    """One fedps run of ``job`` (secure or plaintext): its rounds and its summary.

    Parameters
    ----------
    job
        The job.
    encrypted
        Secure (``he.enabled``) or the plaintext baseline.
    compression
        The ``[compression]`` section (None: the default, whole updates).
    keyholder
        The ``[keyholder]`` section (None: the default, one key holder).

    Returns
    -------
    tuple
        The run's figures (seconds of each round, final accuracy, largest epsilon, bytes per
        parameter each client pushed per round) and the demo's summary.

    Raises
    ------
    FedPSError
        The run did not finish every round with every client.
    """
    sections: dict[str, Mapping[str, object]] = {**job.sections(), "he": {"enabled": encrypted}}
    if compression is not None:
        sections["compression"] = compression
        if compression.get("masked_training"):  # it clips each example's masked gradient
            sections["privacy"] = {**sections["privacy"], "clipping": "per_sample"}
    if keyholder is not None:
        sections["keyholder"] = keyholder
    with tempfile.TemporaryDirectory(prefix="fedps-bench-") as tmp:
        summary = run_demo(None, Path(tmp), sections, quiet=True)
    # Every round waits for every client's commitment (or the deadline): a round with fewer
    # contributors lost a client (see the run's logs), and does not compare.
    if summary.rounds != job.rounds or any(n != job.clients for n in summary.round_contributors):
        raise FedPSError(
            f"fedps ran {summary.rounds} of {job.rounds} rounds, contributors "
            f"{list(summary.round_contributors)} of {job.clients}"
        )
    params = _num_params(job)
    times = list(summary.round_seconds)
    updates = sum(summary.round_contributors) or job.rounds * job.clients
    result = {
        "system": "secure" if encrypted else "plaintext",
        "num_params": params,
        "round_seconds": times,
        "median_round_s": statistics.median(times[1:] or times),
        "final_accuracy": summary.final_accuracy,
        "max_epsilon": summary.max_epsilon,
        "bytes_per_param": summary.bytes_pushed / updates / params,
    }
    return result, summary


def run_flower(job: Job, *, clipping: str = "per_sample") -> dict[str, Any]:
    """One Flower run of ``job``, in a process group of its own.

    Opacus clips per-sample gradients as ``clipping`` says (``"per_sample"``, ``"ghost"``).
    The group is ended afterwards (whatever Ray left in it too), also when the run fails.
    """
    with tempfile.TemporaryDirectory(prefix="fedps-bench-flower-") as tmp:
        work = Path(tmp)
        config = load_config(None, **job.sections())
        path, out = work / "job.toml", work / "result.json"
        write_config(config, path)
        command = python_command(
            "-m",
            "fedps.bench.flower_baseline",
            str(path),
            str(out),
            "--threads",
            str(_threads(job.clients)),
            "--workers",
            str(os.cpu_count() or 1),
            "--clipping",
            clipping,
        )
        env = child_environment(
            {
                **os.environ,
                "FLWR_TELEMETRY_ENABLED": "0",
                "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            }
        )
        with open(work / "flower.log", "wb") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                code = process.wait(timeout=_FLOWER_TIMEOUT_S)
            finally:
                _end_group(process)
        if code != 0 or not out.exists():
            tail = (work / "flower.log").read_text(errors="replace").splitlines()[-20:]
            raise FedPSError(f"the Flower run failed (exit {code}):\n" + "\n".join(tail))
        result: dict[str, Any] = json.loads(out.read_text())
    return result


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """End ``process``'s group: SIGTERM, then SIGKILL after :data:`_GRACE_S` to what is left.

    Ray's processes stay in the group of the process that started them.
    """
    for sig, wait_s in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # nothing left in the group
        until = time.monotonic() + wait_s
        while time.monotonic() < until and _group_alive(process.pid):
            time.sleep(0.2)
    if process.poll() is None:
        process.wait()


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is alive."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def timed_with_load(run: Callable[[], Any]) -> tuple[Any, dict[str, float], float]:
    """``run()``'s result, the load average while it ran, and its wall-clock seconds."""
    started = time.perf_counter()
    with _LoadSampler().sampling() as load:
        result = run()
    return result, load.summary(), time.perf_counter() - started


def _compare_job(
    job: Job, systems: Sequence[str], repeats: int, console: Console
) -> dict[str, Any]:
    """``repeats`` rounds of runs of ``job``, each system once per repeat, in turn."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    failed: list[dict[str, Any]] = []
    summaries: dict[str, list[DemoSummary]] = {"secure": [], "plaintext": []}
    for repeat in range(1, repeats + 1):
        for system in systems:
            console.print(f"{job.name}: {system}, repeat {repeat} of {repeats} ...")
            try:
                if system in _FLOWER_CLIPPING:
                    run_job = functools.partial(run_flower, job, clipping=_FLOWER_CLIPPING[system])
                    result, load, wall = timed_with_load(run_job)
                else:
                    run = functools.partial(run_fedps, job, encrypted=system == "secure")
                    (result, summary), load, wall = timed_with_load(run)
                    summaries[system].append(summary)
            except FedPSError as exc:  # one failed run: the others still compare
                console.print(f"  FAILED: {exc}", markup=False)
                failed.append({"system": system, "repeat": repeat, "error": str(exc)[-2000:]})
                continue
            result.update(load=load, wall_s=wall, repeat=repeat)
            runs[system].append(result)
            accuracy = result["final_accuracy"]
            console.print(
                f"  median round {result['median_round_s']:.3f} s, accuracy "
                f"{'-' if accuracy is None else f'{accuracy:.1%}'}, epsilon "
                f"{result['max_epsilon']:.2f}, load {load['min']:.1f}-{load['max']:.1f}",
                markup=False,
                soft_wrap=True,
            )
    out: dict[str, Any] = {
        "job": job.__dict__,
        "threads_per_client": _threads(job.clients),
        "failed": failed,
    }
    for system, results in runs.items():
        if results:
            out[system] = _system_summary(results)
    if "flower" in out:
        flower = out["flower"]["median_round_s"]
        for system in ("flower-ghost", "secure", "plaintext"):
            if system in out:
                out[system]["vs_flower"] = out[system]["median_round_s"] / flower
    out["profile"] = {s: phase_profile(summaries[s]) for s in summaries if summaries[s]}
    return out


def _system_summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One system's runs of a job, summed up.

    The median of rounds 2..R over them, the accuracy and epsilon of each, the mean bytes per
    parameter, the runs.
    """
    steady = [s for r in results for s in r["round_seconds"][1:]]
    return {
        "median_round_s": statistics.median(steady),
        "final_accuracy": [r["final_accuracy"] for r in results],
        "max_epsilon": [r["max_epsilon"] for r in results],
        "bytes_per_param": statistics.fmean(r["bytes_per_param"] for r in results),
        "num_params": results[0]["num_params"],
        "runs": list(results),
    }


def compare(
    jobs: Sequence[Job],
    *,
    flower: bool,
    repeats: int,
    console: Console,
    on_job: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run each job on each system, alternating, ``repeats`` times.

    Parameters
    ----------
    jobs
        The jobs (:data:`JOBS`, :func:`job_named`).
    flower
        Run Flower's plain FedAvg too (``--against flower``), with Opacus's per-sample
        gradients and with its ghost clipping; otherwise fedps secure and plaintext only
        (``--profile``).
    repeats
        How many times each system runs each job.
    console
        Where progress is printed.
    on_job
        Called with the results so far after each job (to save them as they come).

    Returns
    -------
    dict
        ``{"load_before", "load_after", "jobs": {name: {"job", "flower", "secure",
        "plaintext", "profile"}}}``: per system the median round (rounds 2..R over the
        repeats), the accuracy and epsilon of each repeat, the bytes per parameter and the
        runs; ``vs_flower``, fedps's median over Flower's; the phase profiles; ``failed``,
        the runs that failed (a system none of whose runs finished has no entry).

    Raises
    ------
    ConfigError
        ``repeats`` below 1.
    """
    if repeats < 1:
        raise ConfigError("repeats must be at least 1")
    systems = [s for s in SYSTEMS if flower or s not in _FLOWER_CLIPPING]
    results: dict[str, Any] = {"load_before": os.getloadavg(), "jobs": {}}
    for job in jobs:
        results["jobs"][job.name] = _compare_job(job, systems, repeats, console)
        results["load_after"] = os.getloadavg()
        if on_job is not None:
            on_job(results)
    return results
