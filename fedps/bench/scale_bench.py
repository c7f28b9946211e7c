"""``fedps bench --scale N``: N clients through the real protocol, and what each role costs.

The cluster is the demo's (:func:`fedps.runtime.demo.run_demo`): a key holder, 2 shards and a
coordinator as processes on loopback, under mutual TLS with certificates made for the run,
the key holder's whole-aggregate verification and canaries as in production. The clients
train nothing: ``hosts`` processes (``fedps replay-clients``) each run a slice of the N
clients as real edge clients on threads, each under its own certificate, replaying one
synthetic DP-scaled update (:mod:`clients.replay`): they register, pull and verify the model,
encrypt, commit and push real CKKS ciphertexts and report, every round. Each client also
draws its next round's encryptions of zero in a worker process of its own, as a real client
does, so a host has up to N / hosts children.

Every second, and at the end of every round (as the coordinator's history shows it), the CPU
seconds and resident memory of every role's process tree are read from ``/proc``; a round's
CPU is the difference with the end of the round before (round 1's, with the start of the
clients: it includes their setup), and a role's memory is its tree's peak.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from fedps.bench.benchmark import machine_description, status_mib
from fedps.rpc.coordinator_messages import RoundSummary
from fedps.runtime.demo import run_demo
from fedps.runtime.deployment import Deployment

__all__ = ["render_scale", "run_scale_bench"]

_TICKS = os.sysconf("SC_CLK_TCK")
#: How long the coordinator waits for a round's commitments: long enough for every client of
#: a loaded machine, so that rounds close when the whole cohort committed.
_DEADLINE_S = 1800.0


def run_scale_bench(
    *, clients: int, model: str, rounds: int, hosts: int = 2, console: Console
) -> dict[str, Any]:
    """Run ``rounds`` rounds of ``clients`` replaying clients of ``model`` and measure each role.

    Parameters
    ----------
    clients
        How many clients (every one in every round).
    model
        A registered model (:mod:`fedps.learning.models`) on the digits data: its size is the
        update's.
    rounds
        Rounds to run; the medians leave the first out when there are at least three.
    hosts
        Processes the clients are spread over.
    console
        Where the rounds are shown.

    Returns
    -------
    dict
        ``{"machine", "clients", "hosts", "model", "num_params", "rounds": [...], "median":
        {...}, "peak_rss_mib": {role: MiB}, "children": {role: most children}}``; each round
        has its seconds, contributors, bytes pushed (and per client), the CPU seconds of each
        role, and the clients' median encryption seconds (offline and online, wall).
    """
    meter = _RoleMeter()

    def start_clients(deployment: Deployment) -> None:
        for h, (first, count) in enumerate(_slices(clients, hosts)):
            deployment.start(
                f"clients-{h}", "replay-clients", "--first", str(first), "--count", str(count)
            )
        meter.watch(deployment)

    records: list[dict[str, Any]] = []

    def on_round(record: RoundSummary) -> None:
        cpu = meter.cpu_since_last()
        records.append(_round_record(record, cpu))

    overrides: dict[str, dict[str, object]] = {
        "training": {
            "dataset": "digits",
            "model": model,
            "clients": clients,
            "min_quorum": min(2, clients),
            "rounds": rounds,
            "deadline_s": _DEADLINE_S,
            "eval_every": rounds,
        },
        # no target: nothing calibrated per client; nothing drawn ahead (the trainer never runs)
        "privacy": {"target_epsilon": None, "noise_multiplier": 1.0, "noise_ahead_mib": 0},
        "he": {"max_clients": max(100, clients)},
    }
    with tempfile.TemporaryDirectory(prefix="fedps-scale-") as tmp:
        try:
            run_demo(
                None,
                Path(tmp),
                overrides,
                console=console,
                timeout_s=_DEADLINE_S * (rounds + 1),
                start_clients=start_clients,
                on_round=on_round,
            )
        finally:
            meter.stop()
    steady = records[1:] if len(records) >= 3 else records
    return {
        "machine": machine_description(),
        "clients": clients,
        "hosts": hosts,
        "model": model,
        "num_params": _num_params(model),
        "rounds": records,
        "median": {
            key: statistics.median(r[key] for r in steady)
            for key in ("seconds", "bytes_per_client", *(f"cpu_s.{k}" for k in meter.roles))
        }
        if steady
        else {},
        "peak_rss_mib": meter.peak_rss_mib(),
        "children": meter.most_children,
        "load": _load_average(),
    }


def _num_params(model: str) -> int:
    from fedps.learning.models import create_model
    from fedps.sharding.blocks import flatten_model

    return int(flatten_model(create_model(model, num_features=64, num_classes=10)).size)


def _round_record(record: RoundSummary, cpu: dict[str, float]) -> dict[str, Any]:
    """One round's figures: the coordinator's record and the CPU each role spent on it."""
    out: dict[str, Any] = {
        "round": record.round,
        "seconds": record.seconds,
        "contributors": record.contributors,
        "bytes_pushed": record.bytes_pushed,
        "bytes_per_client": record.bytes_pushed / max(1, record.contributors),
        "abandoned": record.abandoned,
        "load": _load_average(),
    }
    out.update({f"cpu_s.{role}": seconds for role, seconds in cpu.items()})
    # the slowest clients to commit report their phases (wall seconds)
    for phase in ("encrypt_offline", "encrypt_online", "commit", "push"):
        times = [p.get(phase, 0.0) for p in record.client_phases.values()]
        out[f"client_{phase}_s"] = statistics.median(times) if times else 0.0
    return out


def _slices(clients: int, hosts: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each host's clients: ``clients`` spread evenly over ``hosts``."""
    hosts = max(1, min(hosts, clients))
    bounds = [clients * h // hosts for h in range(hosts + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


def _load_average() -> float:
    """The machine's 1-minute load average."""
    return os.getloadavg()[0]


class _RoleMeter:
    """CPU seconds and peak memory of each role of a deployment, sampled from ``/proc``.

    A role is a server (``keyholder``, ``shard-0``, ...) or all the client hosts together
    (``clients``), each with its process tree (the clients' encryption workers). Sampled every
    ``every_s`` seconds by a thread of its own, and at every :meth:`cpu_since_last`: a
    process's CPU (user and system) counts as last seen, so one that exited (a client host at
    the end of the run) keeps what it had spent; one that lived less than ``every_s`` is
    missed. A role's memory is the sum over its tree of the resident memory, at its peak over
    the samples (a server's own peak, VmHWM, between samples).
    """

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.roles: list[str] = []
        self.most_children: dict[str, int] = {}
        self._roots: dict[str, list[int]] = {}
        self._cpu_seen: dict[str, dict[int, float]] = {}
        self._peak: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, deployment: Deployment) -> None:
        """Measure from now on the processes ``deployment`` started, until :meth:`stop`."""
        for name, process in deployment.processes.items():
            role = "clients" if name.startswith("client") else name
            self._roots.setdefault(role, []).append(process.pid)
        self.roles = sorted(self._roots)
        self._last = self._sample()
        self._thread = threading.Thread(target=self._run, name="role-meter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def cpu_since_last(self) -> dict[str, float]:
        """CPU seconds of each role since the last call (or :meth:`watch`)."""
        now = self._sample()
        spent = {role: now[role] - self._last.get(role, 0.0) for role in self.roles}
        self._last = now
        return spent

    def peak_rss_mib(self) -> dict[str, float]:
        """Each role's peak resident memory (its process tree's) seen so far, in MiB."""
        with self._lock:
            return dict(self._peak)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self) -> dict[str, float]:
        """Sample every role now; returns each role's CPU seconds so far."""
        children = _children()
        with self._lock:
            out: dict[str, float] = {}
            for role, roots in self._roots.items():
                tree = _descendants(roots, children)
                seen = self._cpu_seen.setdefault(role, {})
                for pid in tree:
                    seen[pid] = max(seen.get(pid, 0.0), _cpu_seconds(pid))
                out[role] = sum(seen.values())
                workers = len(tree) - len([pid for pid in roots if pid in tree])
                self.most_children[role] = max(self.most_children.get(role, 0), workers)
                own_peak = max((status_mib(pid, "VmHWM") for pid in roots), default=0.0)
                rss = sum(status_mib(pid, "VmRSS") for pid in tree)
                self._peak[role] = max(self._peak.get(role, 0.0), rss, own_peak)
            return out


def _children() -> dict[int, list[int]]:
    """Every process's children, from each ``/proc/PID/stat``'s parent."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def _descendants(pids: Sequence[int], children: dict[int, list[int]]) -> list[int]:
    """``pids`` and all their descendants."""
    out: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name (state first); empty if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rindex(")") + 2 :].split()


def _cpu_seconds(pid: int) -> float:
    """User and system CPU of ``pid`` itself (0 if it is gone)."""
    fields = _stat_fields(pid)
    # utime, stime: fields 14 and 15 of stat, 11 and 12 after the command name
    return sum(int(f) for f in fields[11:13]) / _TICKS if fields else 0.0


def render_scale(results: Sequence[dict[str, Any]]) -> str:
    """Markdown tables of scale runs: one row per run, then each run's rounds."""
    roles = sorted({k for r in results for k in r["peak_rss_mib"]})
    head = ["clients x params", "rounds", "median round", "bytes per client"]
    head += [f"{role} CPU s/round" for role in roles] + [f"{role} peak MiB" for role in roles]
    lines = [_row(head), _row(["---"] + ["---:"] * (len(head) - 1))]
    for r in results:
        median = r["median"]
        row = [
            f"{r['clients']} x {r['num_params']:,}",
            str(len(r["rounds"])),
            f"{median.get('seconds', float('nan')):.1f} s",
            f"{median.get('bytes_per_client', 0) / 2**20:.1f} MiB",
        ]
        row += [f"{median.get(f'cpu_s.{role}', float('nan')):.1f}" for role in roles]
        row += [f"{r['peak_rss_mib'].get(role, float('nan')):,.0f}" for role in roles]
        lines.append(_row(row))
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"
