"""What a demo run reports: :class:`DemoSummary`, the record ``fedps demo --json`` writes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

__all__ = ["DemoSummary"]


@dataclass(frozen=True)
class DemoSummary:
    """The summary of one demo run, as the coordinator reported it at the end.

    The per-client lists are ordered by client id; per-round tuples follow the rounds.
    :meth:`to_json` writes every field under its own name (the ``--json`` file).
    """

    #: Rounds the coordinator finished.
    rounds: int
    #: Test accuracy of the last evaluated round (``None``: no round was evaluated).
    final_accuracy: float | None
    #: The largest epsilon any client reported (``inf``: no DP noise).
    max_epsilon: float
    #: The largest epsilon each client reported.
    client_epsilons: tuple[float, ...]
    #: The DP noise multiplier each client reported with its updates (clients that reported).
    client_noise_multipliers: tuple[float, ...]
    delta: float
    #: Where the DP noise came from: ``"secure"`` or ``"insecure-reproducible"``.
    noise: str
    bytes_pushed: int
    #: Wall-clock seconds of the whole run.
    seconds: float
    clients: int
    shards: int
    #: Whether the run used mutual TLS.
    tls: bool
    abandoned_rounds: int
    #: Seconds of each round.
    round_seconds: tuple[float, ...]
    #: Seconds of each round's push phase (from the freeze of the commitments to the close).
    push_seconds: tuple[float, ...]
    #: ``(seconds, accuracy)`` of each round; accuracy ``None`` where it was not evaluated.
    round_accuracy: tuple[tuple[float, float | None], ...]
    #: Clients whose update each round applied.
    round_contributors: tuple[int, ...] = ()
    #: Where each round's seconds went (:mod:`fedps.round_timer`): its critical path, the
    #: servers' own phases, and each client's phases (client id -> seconds by phase).
    round_phases: tuple[dict[str, float], ...] = ()
    round_server_phases: tuple[dict[str, float], ...] = ()
    round_client_phases: tuple[dict[str, dict[str, float]], ...] = ()
    #: Key-holder parties (``keyholder.parties``; 1: one key holder with the whole key).
    keyholder_parties: int = 1

    def to_json(self) -> str:
        """The summary as a JSON object (tuples as arrays), indented, with a final newline."""
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"
