"""Prometheus metrics of one server role (prometheus-client), on its own HTTP port.

Shards count push messages by outcome and refusal reason
(``fedps_pushes_total{outcome="refused",reason="stale_update"}``), blocks added or
acknowledged as duplicates and bytes received, and time each push; the coordinator counts
rounds by outcome, times them and shows the open round's or buffer's fill; the key holder
times decryption and application; the key holder and the coordinator show the model version
and the age of their last checkpoint. Each role has its own registry, so several roles can share a
process (as in the tests). Labels never carry client ids, keys or update values.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["RoleMetrics"]


def _snake(name: str) -> str:
    """``StaleUpdateError`` -> ``stale_update``."""
    name = name.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class RoleMetrics:
    """The metrics of one role.

    Parameters
    ----------
    role
        ``keyholder``, ``coordinator`` or ``shard-N`` (the ``role`` label).
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "fedps_seconds",
            "Time of the role's main operations (push, apply, round)",
            ["operation"],
            registry=r,
        )
        self.pushes = Counter(
            "fedps_pushes",
            "Push messages by outcome (accepted, refused) and refusal reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.blocks = Counter(
            "fedps_blocks",
            "Encrypted blocks by outcome (added, duplicate)",
            ["outcome"],
            registry=r,
        )
        self.bytes_received = Counter(
            "fedps_received_bytes", "Bytes of encrypted blocks received", registry=r
        )
        self.rounds = Gauge(
            "fedps_rounds",
            "Rounds or buffers so far, by outcome (applied, abandoned)",
            ["outcome"],
            registry=r,
        )
        self.version = Gauge("fedps_model_version", "Current model version", registry=r)
        self.tampering = Counter(
            "fedps_tampering_detected",
            "Aggregates the key holder refused as tampered, by shard and reason",
            ["shard", "reason"],
            registry=r,
        )
        self.buffer_fill = Gauge(
            "fedps_buffer_fill", "Updates reported in the open round or buffer", registry=r
        )
        self.checkpoint_age = Gauge(
            "fedps_last_checkpoint_age_seconds", "Seconds since the last checkpoint", registry=r
        )
        self.port = 0

    def tampering_detected(self, shard: str, reason: str) -> None:
        """Count one tampered aggregate the key holder refused."""
        self.tampering.labels(shard, reason).inc()

    def push_refused(self, exc: Exception) -> None:
        """Count one refused push message, by the error's kind."""
        self.pushes.labels("refused", _snake(type(exc).__name__)).inc()

    def push_accepted(self, added: int, duplicates: int, nbytes: int) -> None:
        """Count one accepted push message."""
        self.pushes.labels("accepted", "").inc()
        self.blocks.labels("added").inc(added)
        self.blocks.labels("duplicate").inc(duplicates)
        self.bytes_received.inc(nbytes)

    def track_checkpoint(self, last_checkpoint: Callable[[], float]) -> None:
        """Report the age of the checkpoint whose unix time ``last_checkpoint`` returns."""
        self.checkpoint_age.set_function(
            lambda: time.time() - last_checkpoint() if last_checkpoint() else float("nan")
        )

    def serve(self, address: str) -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: any free port); returns the port."""
        host, _, port = address.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        self.port = int(server.server_port)
        return self.port
