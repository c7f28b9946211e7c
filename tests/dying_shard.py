"""A shard process that dies at a chosen moment of a round, for fault tests with real processes.

``python -m tests.dying_shard ROUND AT -- PYTHON -P -m fedps.cli shard ...`` runs the shard
command after it in this process, one of its methods changed so that the process is SIGKILLed
there, before it answers:

- ``push``: the first push of round ``ROUND`` it takes (:meth:`Shard.push
  <server.shard.shard.Shard.push>`), while the round's pushes are under way;
- ``fetch``: the key holder's fetch of round ``ROUND``'s sums (:meth:`Shard.aggregates
  <server.shard.shard.Shard.aggregates>`), after the round closed and before it is applied;
- ``publish``: the first publication after it handed over round ``ROUND``'s sums
  (:meth:`PublishedModel.publish <server.shard.published_model.PublishedModel.publish>`),
  after the round was applied and before its version is on every shard.

As a role's command prefix (:attr:`Deployment.prefixes
<fedps.runtime.deployment.Deployment.prefixes>`), it loses one shard of a cluster of real
processes at that moment, which no test process could catch from outside.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Collection
from typing import Any, Literal

from crypto.signed_update import SignedUpdate
from fedps.rpc.messages import Aggregate
from fedps.rpc.shard_messages import PushBatch
from server.shard.published_model import PublishedModel
from server.shard.shard import Shard
from tests.role_processes import run_command_after_dashes

__all__ = ["prefix"]

At = Literal["push", "fetch", "publish"]


def prefix(round_: int, at: At = "push") -> list[str]:
    """The command prefix that makes a shard die in ``round_``, ``at`` that moment."""
    return [sys.executable, "-m", "tests.dying_shard", str(round_), at, "--"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _dying(dying: int, at: str) -> None:
    push, aggregates, publish = Shard.push, Shard.aggregates, PublishedModel.publish
    fetched = [False]  # the sums of round ``dying`` were handed over

    def dying_push(self: Shard, batch: PushBatch) -> tuple[int, int]:
        answer = push(self, batch)
        if at == "push" and batch.round == dying:  # taken, never acknowledged
            _die()
        return answer

    def dying_aggregates(
        self: Shard, round_: int, contributors: Collection[str]
    ) -> tuple[list[Aggregate], list[SignedUpdate]]:
        if at == "fetch" and round_ == dying:
            _die()
        answer = aggregates(self, round_, contributors)
        fetched[0] = fetched[0] or round_ == dying
        return answer

    def dying_publish(self: PublishedModel, *args: Any, **kwargs: Any) -> int:
        if at == "publish" and fetched[0]:
            _die()
        return publish(self, *args, **kwargs)

    Shard.push = dying_push  # type: ignore[method-assign]
    Shard.aggregates = dying_aggregates  # type: ignore[method-assign]
    PublishedModel.publish = dying_publish  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    """Run the shard command after ``--`` in ``argv``, dying in round ``argv[0]`` at ``argv[1]``."""
    _dying(int(argv[0]), argv[1])
    run_command_after_dashes(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
