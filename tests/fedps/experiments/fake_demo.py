"""A stand-in for :func:`fedps.runtime.demo.run_demo` that returns a summary at once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from fedps.errors import PeerUnavailableError
from fedps.runtime.demo_summary import DemoSummary

#: A two-round summary of two clients (no per-client spends reported).
SUMMARY = DemoSummary(
    rounds=2,
    final_accuracy=0.8,
    max_epsilon=7.4,
    client_epsilons=(),
    client_noise_multipliers=(),
    delta=1e-5,
    noise="secure",
    bytes_pushed=1000,
    seconds=1.5,
    clients=2,
    shards=1,
    tls=False,
    abandoned_rounds=0,
    round_seconds=(0.5, 0.5),
    push_seconds=(0.1, 0.1),
    round_accuracy=((0.5, 0.7), (0.5, 0.9)),
)


class FakeDemo:
    """Stands in for run_demo: records each call, fails for keys in ``fail``."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[Mapping[str, Mapping[str, object]]] = []
        self.fail = fail

    def __call__(
        self,
        config_path: Path | None,
        workdir: Path,
        overrides: Mapping[str, Mapping[str, object]],
        **_: object,
    ) -> DemoSummary:
        self.calls.append(overrides)
        enabled = overrides.get("he", {}).get("enabled")
        if f"encryption={'true' if enabled else 'false'}" in self.fail:
            raise PeerUnavailableError("every client exited before training finished")
        return dataclasses.replace(SUMMARY, final_accuracy=0.9 if enabled else 0.8)
