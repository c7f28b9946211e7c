"""``fedps bench --parties P``, end to end: secure rounds with P key-holder parties against one.

The same job (the 1M-parameter ``mlp1m`` by default) runs secure as ``fedps demo`` runs it
(:func:`fedps.bench.flower_comparison.run_fedps`: every role its own process on loopback,
mutual TLS), once with one key holder and once with ``P`` party processes of which ``T``
decrypt, alternating within each repeat (the first setting of a repeat is the second of the
next, so that a load that rises or falls affects both alike). The parties' work runs in their
own processes, in parallel, as deployed; on one machine they share its cores with every other
role, which a deployment does not.

Each run reports its rounds' seconds and phases (:func:`fedps.bench.round_profile.
phase_profile`); a setting's round time is the median of rounds 2..R over its repeats (the
first pays for starting up), and so is the key holder's ``decrypt`` phase (with parties: the
combiner's requests to the parties, their checks and partials, the combination); each run
keeps its whole critical path (``critical``), to see where a difference goes. The ratio
is the parties' median round over one key holder's; ``paired`` is the median of each repeat's
own ratio. The machine's load is sampled during each run: a ratio taken under load says less.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from rich.console import Console

from fedps.bench.flower_comparison import Job, run_fedps, timed_with_load
from fedps.bench.round_profile import phase_profile
from fedps.errors import FedPSError, InvalidArgumentError

__all__ = ["compare_party_rounds", "render_party_rounds", "summarize_party_rounds"]

#: The key holder's phases each run reports (medians over rounds 2..R).
_PHASES = ("fetch", "verify", "decrypt")


def _settings(parties: int, threshold: int) -> dict[str, Mapping[str, object]]:
    """The ``[keyholder]`` section of each setting, by its name (its P)."""
    return {"1": {"parties": 1}, str(parties): {"parties": parties, "threshold": threshold}}


def compare_party_rounds(
    job: Job, *, parties: int, threshold: int, repeats: int, console: Console
) -> dict[str, Any]:
    """Run ``job`` secure with one key holder and with ``parties`` parties, alternating.

    Parameters
    ----------
    job
        The job (:data:`fedps.bench.flower_comparison.JOBS`).
    parties
        P (above 1).
    threshold
        T (``1..P``).
    repeats
        Runs of each setting.
    console
        Where progress is printed.

    Returns
    -------
    dict
        :func:`summarize_party_rounds` of the runs, with ``"job"`` and ``"failed"`` (a run
        that did not finish every round: its error).

    Raises
    ------
    InvalidArgumentError
        ``parties`` not above 1, ``threshold`` not in ``1..parties``, or no repeat.
    """
    if parties < 2 or not 1 <= threshold <= parties or repeats < 1:
        raise InvalidArgumentError("--parties P above 1, 1 <= T <= P, 1+ repeats")
    settings = _settings(parties, threshold)
    names = list(settings)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    failed: list[dict[str, Any]] = []
    for repeat in range(1, repeats + 1):
        for name in names if repeat % 2 else names[::-1]:
            console.print(f"{job.name}: P = {name}, repeat {repeat} of {repeats} ...")
            run = partial(run_fedps, job, encrypted=True, keyholder=settings[name])
            try:
                (result, summary), load, wall = timed_with_load(run)
            except FedPSError as exc:  # one failed run: the others still compare
                console.print(f"  FAILED: {exc}", markup=False)
                failed.append({"parties": name, "repeat": repeat, "error": str(exc)[-2000:]})
                continue
            profile = phase_profile([summary])
            server = profile["server"]
            result.update(
                repeat=repeat,
                load=load,
                wall_s=wall,
                keyholder_parties=summary.keyholder_parties,
                phases={p: server[p] for p in _PHASES if p in server},
                critical=profile["critical"],
            )
            runs[name].append(result)
            console.print(
                f"  median round {result['median_round_s']:.3f} s, decrypt "
                f"{result['phases'].get('decrypt', float('nan')):.3f} s, accuracy "
                f"{result['final_accuracy']}, load {load['mean']:.1f}"
            )
    out = summarize_party_rounds(runs, parties=parties)
    return {"job": job.__dict__, "threshold": threshold, "failed": failed, **out}


def summarize_party_rounds(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], *, parties: int
) -> dict[str, Any]:
    """Each setting's medians, and the parties' round against one key holder's.

    Parameters
    ----------
    runs
        By setting (``"1"`` and ``str(parties)``), each run's ``round_seconds``, ``phases``,
        ``final_accuracy``, ``repeat`` and ``load`` (:func:`compare_party_rounds`).
    parties
        P.

    Returns
    -------
    dict
        ``{"parties", "settings": {name: {"median_round_s", "phases", "final_accuracy",
        "load_mean", "runs"}}, "ratio", "paired_ratio", "decrypt_added_s"}``; the ratios are
        nan when a setting has no run.
    """
    settings: dict[str, Any] = {}
    for name, results in runs.items():
        if not results:
            continue
        steady = [s for r in results for s in r["round_seconds"][1:] or r["round_seconds"]]
        settings[name] = {
            "median_round_s": statistics.median(steady),
            "phases": {
                p: statistics.median(r["phases"][p] for r in results)
                for p in _PHASES
                if all(p in r["phases"] for r in results)
            },
            "final_accuracy": [r["final_accuracy"] for r in results],
            "load_mean": statistics.fmean(r["load"]["mean"] for r in results),
            "runs": list(results),
        }
    one, many = settings.get("1"), settings.get(str(parties))
    nan = float("nan")
    pairs = [
        _median_round(b) / _median_round(a)
        for a in runs.get("1", ())
        for b in runs.get(str(parties), ())
        if a["repeat"] == b["repeat"]
    ]
    return {
        "parties": parties,
        "settings": settings,
        "ratio": many["median_round_s"] / one["median_round_s"] if one and many else nan,
        "paired_ratio": statistics.median(pairs) if pairs else nan,
        "decrypt_added_s": (
            many["phases"]["decrypt"] - one["phases"]["decrypt"]
            if one and many and "decrypt" in one["phases"] and "decrypt" in many["phases"]
            else nan
        ),
    }


def _median_round(result: Mapping[str, Any]) -> float:
    """One run's median of rounds 2..R."""
    times = result["round_seconds"]
    return float(statistics.median(times[1:] or times))


def render_party_rounds(result: Mapping[str, Any]) -> str:
    """The lines of :func:`compare_party_rounds`: each setting, then the ratio."""
    job = result["job"]
    lines = [
        f"secure rounds of {job['name']} ({job['rounds']} rounds, {job['clients']} clients), "
        f"P parties (any {result['threshold']}) against one key holder, medians of rounds "
        "2..R over the repeats:"
    ]
    for name, s in result["settings"].items():
        phases = ", ".join(f"{p} {v:.3f} s" for p, v in s["phases"].items())
        accuracy = ", ".join(f"{a:.1%}" for a in s["final_accuracy"] if a is not None)
        lines.append(
            f"  P = {name}: round {s['median_round_s']:.3f} s ({phases}); accuracy {accuracy}; "
            f"{len(s['runs'])} runs, mean load {s['load_mean']:.1f}"
        )
    lines.append(
        f"  round with parties / one key holder: {result['ratio']:.3f} (paired by repeat: "
        f"{result['paired_ratio']:.3f}); decrypt phase added {result['decrypt_added_s']:+.3f} s"
    )
    lines += [f"  FAILED: P = {f['parties']}, repeat {f['repeat']}" for f in result["failed"]]
    return "\n".join(lines)
