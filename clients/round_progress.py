"""What an edge client tells its caller.

A line per round it took part in (:class:`RoundProgress`, the CLI prints it) and what it did over
the run (:class:`ClientSummary`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clients.peer_failures import failures_text
from fedps.units import size_text

__all__ = ["ClientSummary", "RoundProgress"]


@dataclass(frozen=True)
class RoundProgress:
    """What a client did in one round it took part in.

    See :class:`~clients.edge_client.EdgeClient`'s ``on_round``.

    Attributes
    ----------
    client_id, round, rounds
        Who, which round, of how many (``training.rounds``).
    samples
        The client's training examples.
    loss
        The mean loss of its local batches (NaN: not known, such as a wrapped trainer's).
    epsilon, delta
        Its privacy spend so far.
    bytes_pushed, push_seconds
        What its push took (0 bytes: the round ended before the push, or the shards refused
        it).
    refused
        The calls peers refused or failed since the previous line (the last 32), as
        ``peer (reason)`` (``shard-1 (invalid_argument)``): this round's push, commitment or
        report, and the task requests before them.
    failures
        The client's calls that peers refused or failed so far
        (:attr:`~clients.edge_client.EdgeClient.failures`).
    """

    client_id: str
    round: int
    rounds: int
    samples: int
    loss: float
    epsilon: float
    delta: float
    bytes_pushed: int
    push_seconds: float
    refused: tuple[str, ...] = ()
    failures: int = 0

    def line(self) -> str:
        """One readable line of the round.

        Such as ``client-0 round 3/20: 412 samples, loss 0.41, epsilon 1.84 (delta 1e-05), pushed
        1.2 MB in 0.8 s``, ending ``; refused by shard-1 (invalid_argument), 1 peer failure so far``
        when a peer refused a call.
        """
        parts = [f"{self.samples} samples"]
        if not math.isnan(self.loss):
            parts.append(f"loss {self.loss:.3g}")
        parts.append(f"epsilon {self.epsilon:.2f} (delta {self.delta:g})")
        if self.bytes_pushed:
            parts.append(f"pushed {size_text(self.bytes_pushed)} in {self.push_seconds:.1f} s")
        elif self.refused:
            parts.append("nothing pushed")
        else:
            parts.append("nothing pushed (the round ended first)")
        line = f"{self.client_id} round {self.round}/{self.rounds}: " + ", ".join(parts)
        if self.refused:
            line += f"; refused by {', '.join(self.refused)}"
        if self.failures:
            line += f"{';' if not self.refused else ','} {failures_text(self.failures)} so far"
        return line


@dataclass(frozen=True)
class ClientSummary:
    """What one client did over the run."""

    client_id: str
    rounds_trained: int
    epsilon: float
    delta: float
    bytes_pushed: int
    failures: int = 0  # calls its peers refused or failed (EdgeClient.failures)
