"""A shard process that dies mid-push, for fault tests with real processes.

``python -m tests.dying_shard ROUND -- PYTHON -P -m fedps.cli shard ...`` runs the shard
command after it in this process, its :meth:`Shard.push <server.shard.shard.Shard.push>`
changed: the first push of round ``ROUND`` it takes is its last (the process is SIGKILLed
before it answers). As a role's command prefix (:attr:`Deployment.prefixes
<fedps.runtime.deployment.Deployment.prefixes>`), it loses one shard of a cluster of real
processes while the round's pushes are under way, at no moment a test process must catch: the
round cannot close before the shard is gone.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from fedps.rpc.shard_messages import PushBatch
from server.shard.shard import Shard

__all__ = ["prefix"]


def prefix(round_: int) -> list[str]:
    """The command prefix that makes a shard die at its first push of ``round_``."""
    return [sys.executable, "-m", "tests.dying_shard", str(round_), "--"]


def _dying(round_: int) -> None:
    honest = Shard.push

    def push(self: Shard, batch: PushBatch) -> tuple[int, int]:
        answer = honest(self, batch)
        if batch.round == round_:  # taken, never acknowledged
            os.kill(os.getpid(), signal.SIGKILL)
        return answer

    Shard.push = push  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    """Run the shard command after ``--`` in ``argv``, dying in round ``argv[0]``."""
    command = argv[argv.index("--") + 1 :]
    _dying(int(argv[0]))
    sys.argv = ["fedps", *command[command.index("fedps.cli") + 1 :]]
    runpy.run_module("fedps.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
