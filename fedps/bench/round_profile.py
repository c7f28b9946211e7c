"""Where a job's rounds go: the median seconds of each phase over a run's rounds.

A fedps run's summary (:class:`~fedps.runtime.demo_summary.DemoSummary`) carries every round's
phases as the coordinator recorded them (:mod:`fedps.round_timer`): its critical path, the
servers' own phases, and each client's. :func:`phase_profile` takes the median of each phase
over rounds 2..R of one or more runs of the same job (the first round pays for imports and
warm-up); a phase a round did not have (the key rotation, say) counts 0 in that round.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fedps.round_timer import CLIENT_PHASES, COORDINATOR_PHASES, CRITICAL_PATH, KEYHOLDER_PHASES
from fedps.runtime.demo_summary import DemoSummary

__all__ = ["SERVER_PHASES", "phase_profile"]

#: The servers' phases in the order a profile lists them: the coordinator's, then the key
#: holder's (inside the coordinator's ``apply_call``).
SERVER_PHASES = (*COORDINATOR_PHASES, *KEYHOLDER_PHASES)


def _medians(rounds: Sequence[Mapping[str, float]], order: Sequence[str]) -> dict[str, float]:
    """Each phase of ``order`` that some round has, with its median over ``rounds``.

    A round that lacks the phase counts 0.
    """
    present = {name for r in rounds for name in r}
    return {
        name: statistics.median(r.get(name, 0.0) for r in rounds)
        for name in order
        if name in present
    }


def phase_profile(summaries: Iterable[DemoSummary], *, skip: int = 1) -> dict[str, Any]:
    """Each phase's median over rounds ``skip + 1``.. of ``summaries`` (runs of one job).

    Returns
    -------
    dict
        ``{"rounds": n, "round_s": median seconds, "critical": {phase: s}, "server":
        {phase: s}, "clients": {client id: {phase: s}}}``, phases in round order
        (:data:`fedps.round_timer.CRITICAL_PATH`, :data:`SERVER_PHASES`,
        :data:`fedps.round_timer.CLIENT_PHASES`); empty dicts when no round has phases.
    """
    seconds: list[float] = []
    critical: list[dict[str, float]] = []
    server: list[dict[str, float]] = []
    clients: dict[str, list[dict[str, float]]] = {}
    for summary in summaries:
        kept = range(skip, len(summary.round_phases))
        seconds += [summary.round_seconds[i] for i in kept]
        critical += [summary.round_phases[i] for i in kept]
        server += [summary.round_server_phases[i] for i in kept]
        for i in kept:
            for client, phases in summary.round_client_phases[i].items():
                clients.setdefault(client, []).append(phases)
    return {
        "rounds": len(seconds),
        "round_s": statistics.median(seconds) if seconds else float("nan"),
        "critical": _medians(critical, CRITICAL_PATH),
        "server": _medians(server, SERVER_PHASES),
        "clients": {c: _medians(clients[c], CLIENT_PHASES) for c in sorted(clients)},
    }
