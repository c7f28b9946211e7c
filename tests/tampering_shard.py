"""A shard process that tampers, for fault tests with real processes.

``python -m tests.tampering_shard ROUND -- PYTHON -P -m fedps.cli shard ...`` runs the shard
command after it in this process, its :meth:`Shard.aggregates
<server.shard.shard.Shard.aggregates>` changed: in round ``ROUND`` it flips one bit of one
coefficient of its first block's sum (an aggregate that is not the sum of what was pushed).
As a role's command prefix (:attr:`Deployment.prefixes
<fedps.runtime.deployment.Deployment.prefixes>`), it makes one shard of a cluster of real
processes malicious.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from dataclasses import replace

from crypto.signed_update import SignedUpdate
from fedps.rpc.messages import Aggregate
from server.shard.shard import Shard
from tests.role_processes import run_command_after_dashes

__all__ = ["prefix"]


def prefix(round_: int) -> list[str]:
    """The command prefix that makes a shard tamper in ``round_``."""
    return [sys.executable, "-m", "tests.tampering_shard", str(round_), "--"]


def _tampering(round_: int) -> None:
    honest = Shard.aggregates

    def tampered(
        self: Shard, r: int, contributors: Collection[str]
    ) -> tuple[list[Aggregate], list[SignedUpdate]]:
        aggregates, updates = honest(self, r, contributors)
        if r == round_:  # one bit of one coefficient of its first block
            first = aggregates[0]
            changed = bytearray(first.ciphertext)
            changed[len(changed) // 2] ^= 1
            aggregates[0] = replace(first, ciphertext=bytes(changed))
        return aggregates, updates

    Shard.aggregates = tampered  # type: ignore[method-assign, assignment]


def main(argv: list[str]) -> None:
    """Run the shard command after ``--`` in ``argv``, tampering in round ``argv[0]``."""
    _tampering(int(argv[0]))
    run_command_after_dashes(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
