"""A coordinator process that dies right after it moved the shard ring, for fault tests.

``python -m tests.dying_coordinator -- PYTHON -P -m fedps.cli coordinator ...`` runs the
coordinator command after it in this process, :meth:`RingKeeper.remove
<server.coordinator.ring_keeper.RingKeeper.remove>` changed: the first shard it removes is its
last act (the process is SIGKILLed once the new ring is saved, before anyone is told it and
before the round in progress is checkpointed on it). As the coordinator's command prefix
(:attr:`Deployment.prefixes <fedps.runtime.deployment.Deployment.prefixes>`), it loses the
coordinator at the worst moment of a move, which no test process could catch from outside.
"""

from __future__ import annotations

import os
import signal
import sys

from fedps.sharding.ring_view import RingView
from server.coordinator.ring_keeper import RingKeeper
from tests.role_processes import run_command_after_dashes

__all__ = ["PREFIX"]

#: The command prefix that makes the coordinator die once it removed a shard.
PREFIX = [sys.executable, "-m", "tests.dying_coordinator", "--"]


def _dying() -> None:
    remove = RingKeeper.remove

    def dying_remove(
        self: RingKeeper, shard: str, reason: str = "removed by the operator"
    ) -> RingView:
        remove(self, shard, reason)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    RingKeeper.remove = dying_remove  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    """Run the coordinator command after ``--`` in ``argv``, dying at its first ring move."""
    _dying()
    run_command_after_dashes(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
