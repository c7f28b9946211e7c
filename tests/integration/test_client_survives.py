"""Clients survive every peer (issue 27): no answer of a shard, the coordinator or the key
holder ends an honest client.

A malicious shard that answered one push with ``INVALID_ARGUMENT``, or with ``ABORTED`` naming
:class:`~fedps.errors.QuarantinedError`, ended every honest client it answered so: with one
colluding client it could shrink each round to the victims it spared. Here real servers run on
loopback with their servicers wrapped so that the victim's calls get the answers of a hostile
peer, every status gRPC has and every class of ours a peer can only reach by naming it (a peer
that says the client is misconfigured, out of budget or quarantined), and the victim must count
each refusal, keep going, and take part in a round that succeeds afterwards.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import grpc
import pytest

from clients.edge_client import ClientSummary, EdgeClient, RoundProgress
from fedps.errors import (
    ConfigError,
    CorruptStateError,
    FedPSError,
    NotReadyError,
    PrivacyBudgetExceededError,
    QuarantinedError,
    RateLimitedError,
    StaleUpdateError,
    UnauthenticatedError,
)
from fedps.proto import coordinator_pb2, keyholder_pb2, shard_pb2
from fedps.rpc.transport import ERROR_CLASS_KEY, ERROR_STATUS
from server.coordinator.coordinator_servicer import CoordinatorServicer
from server.keyholder.keyholder_servicer import KeyHolderServicer
from server.shard.shard_servicer import ShardServicer
from tests.conftest import run_clients, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VICTIM, VICTIM_NAME = "client-0", "edge-0"
#: A hang guard, far above the half minute the test takes on a loaded machine (and short
#: enough that a victim that stops fails the test soon: each round then waits its deadline
#: for it).
_HANG_S = 240.0
_Key = TypeVar("_Key", bound=Hashable)
_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")


@dataclass(frozen=True)
class Answer:
    """A hostile answer: a status, the class of ours the peer names with it (none: a bare
    status, as gRPC itself raises), and whether the call was carried out before the refusal
    (a report the coordinator counted, a commitment the key holder kept)."""

    code: grpc.StatusCode
    named: type[FedPSError] | None = None
    after_handling: bool = False

    def give(self, context: grpc.ServicerContext) -> NoReturn:
        if self.named is not None:
            context.set_trailing_metadata(((ERROR_CLASS_KEY, self.named.__name__),))
        named = f" ({self.named.__name__})" if self.named else ""
        context.abort(self.code, f"a hostile peer answers {self.code.name}{named}")
        raise AssertionError("unreachable")  # context.abort always raises


def _named(cls: type[FedPSError]) -> Answer:
    return Answer(ERROR_STATUS[cls], cls)


#: What a shard answers the victim's pushes with: every status (gRPC's own failures and a
#: handler's refusals), then the classes a peer reaches only by naming them, which are the
#: traps: a peer that says the client's configuration is wrong or its budget spent, a
#: quarantine (a final answer, not a transient one), a rate limit, a stale update, not ready.
PUSH_ANSWERS = [
    Answer(grpc.StatusCode.INVALID_ARGUMENT),
    _named(QuarantinedError),
    *(
        Answer(c)
        for c in grpc.StatusCode
        if c not in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
    ),
    _named(ConfigError),
    _named(PrivacyBudgetExceededError),
    _named(RateLimitedError),
    _named(StaleUpdateError),
    _named(NotReadyError),
]


class Hostility(Generic[_Key]):
    """The answers one peer gives the victim's calls of one RPC, in order: a new call takes
    the next one; a retry of a refused call (the same key: a push's round and shard) gets the
    same answer again; once they are spent the peer answers honestly."""

    def __init__(self, peer: str, answers: Sequence[Answer]) -> None:
        self.peer = peer
        self.pending = deque(answers)
        self.given: dict[_Key, Answer] = {}
        self._lock = threading.Lock()

    def answer(self, key: _Key) -> Answer | None:
        with self._lock:
            if key not in self.given:
                if not self.pending:
                    return None
                self.given[key] = self.pending.popleft()
            return self.given[key]


def _unary(
    original: Callable[[Any, _Request, grpc.ServicerContext], _Reply],
    hostility: Hostility[object],
    victim: Callable[[_Request], bool],
) -> Callable[[Any, _Request, grpc.ServicerContext], _Reply]:
    """``original`` (a servicer's method), answering the victim's calls as ``hostility``
    says; each call is a new one."""

    def method(self: Any, request: _Request, context: grpc.ServicerContext) -> _Reply:
        answer = hostility.answer(object()) if victim(request) else None
        if answer is None:
            return original(self, request, context)
        if answer.after_handling:
            original(self, request, context)
        answer.give(context)

    return method


def _hostile_pushes(
    monkeypatch: pytest.MonkeyPatch, answers: Sequence[Answer]
) -> Hostility[tuple[int, str]]:
    """The shards answer the victim's pushes with the next of ``answers``, both shards from
    one list (two answers a round); a push is known by its round and shard."""
    original = ShardServicer.PushBlocks
    hostility: Hostility[tuple[int, str]] = Hostility("shards", answers)

    def push_blocks(
        self: ShardServicer,
        request_iterator: Iterator[shard_pb2.PushRequest],
        context: grpc.ServicerContext,
    ) -> shard_pb2.PushReply:
        first = next(request_iterator, None)
        if first is not None and first.client_id == VICTIM:
            answer = hostility.answer((first.round, self.shard.shard_id))
            if answer is not None:
                answer.give(context)
        return original(self, itertools.chain([first] if first else [], request_iterator), context)

    monkeypatch.setattr(ShardServicer, "PushBlocks", push_blocks)
    return hostility


def _hostile_coordinator_and_keyholder(
    monkeypatch: pytest.MonkeyPatch,
) -> list[Hostility[object]]:
    """The coordinator refuses the victim's registration, two of its task requests and a
    report it counted; the key holder refuses a challenge and a commitment it kept. The
    classes named are claims about the client itself: a bad identity, a spent budget, a
    configuration error, a corrupt state, a quarantine."""
    register: Hostility[object] = Hostility(
        "coordinator", [Answer(grpc.StatusCode.UNAUTHENTICATED)]
    )
    tasks: Hostility[object] = Hostility(
        "coordinator", [_named(PrivacyBudgetExceededError), _named(UnauthenticatedError)]
    )
    report: Hostility[object] = Hostility(
        "coordinator", [Answer(ERROR_STATUS[ConfigError], ConfigError, True)]
    )
    challenge: Hostility[object] = Hostility("key holder", [_named(CorruptStateError)])
    commit: Hostility[object] = Hostility(
        "key holder", [Answer(ERROR_STATUS[QuarantinedError], QuarantinedError, True)]
    )
    c, k = CoordinatorServicer, KeyHolderServicer

    def by_name(r: coordinator_pb2.RegisterRequest) -> bool:
        return r.name == VICTIM_NAME

    def asking(r: coordinator_pb2.TaskRequest | coordinator_pb2.UpdateReport) -> bool:
        return r.client_id == VICTIM

    def challenged(r: keyholder_pb2.ChallengeRequest) -> bool:
        return r.client_id == VICTIM

    def committing(r: keyholder_pb2.CommitRequest) -> bool:
        return r.update.client_id == VICTIM

    monkeypatch.setattr(c, "Register", _unary(c.Register, register, by_name))
    monkeypatch.setattr(c, "GetTask", _unary(c.GetTask, tasks, asking))
    monkeypatch.setattr(c, "ReportUpdate", _unary(c.ReportUpdate, report, asking))
    monkeypatch.setattr(k, "GetChallenge", _unary(k.GetChallenge, challenge, challenged))
    monkeypatch.setattr(k, "Commit", _unary(k.Commit, commit, committing))
    return [register, tasks, report, challenge, commit]


def test_a_client_outlives_every_answer_of_its_peers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the victim (client-0) and a client the shards spare (client-1, a colluder);
    # one round needs one update. Rounds: one refused challenge (and report), one refused
    # commitment, eleven with both shards refusing a push, then an honest one. The victim
    # retries a transient failure briefly (0.2 s, not 90 s: the hostile peers never recover).
    pushes = _hostile_pushes(monkeypatch, PUSH_ANSWERS)
    others = _hostile_coordinator_and_keyholder(monkeypatch)
    rounds = 2 + -(-len(PUSH_ANSWERS) // 2) + 1
    training = {
        "rounds": rounds,
        "clients": 2,
        "min_quorum": 1,
        "deadline_s": 60.0,
        "eval_every": 1000,
        "checkpoint_every": 1000,
    }
    cluster = start_cluster(tmp_path, training=training)
    progress: list[RoundProgress] = []
    victim = EdgeClient.open(cluster.config, index=0, peer_wait_s=0.2, on_round=progress.append)
    colluder = EdgeClient.open(cluster.config, index=1)
    try:
        # Execute
        summaries = run_clients([victim, colluder], timeout_s=_HANG_S)
        history = cluster.coordinator.history
    finally:
        cluster.stop()

    # Assert: nobody stopped; every hostile answer was given, and counted against its peer
    summary = summaries[0]
    assert isinstance(summary, ClientSummary) and isinstance(summaries[1], ClientSummary)
    assert not pushes.pending and not any(h.pending for h in others), "answers never given"
    given = Counter(sid for _, sid in pushes.given)
    for hostility in others:
        given[hostility.peer] += len(hostility.given)
    counted: Counter[str] = Counter()
    for key, count in victim.peer_failures.items():
        counted[key.split(":")[0]] += count
    assert all(counted[peer] >= n for peer, n in given.items()), (given, victim.peer_failures)
    assert summary.failures == victim.failures >= given.total()
    # the round lines say who refused what, and the count so far
    refused = [p for p in progress if p.refused]
    assert refused and all("(" in r for p in refused for r in p.refused)
    assert any("refused by shard-1" in p.line() for p in refused), [p.line() for p in refused]
    assert [p.failures for p in progress] == sorted(p.failures for p in progress)
    # the victim took part in the last round, which succeeded with both clients
    assert progress[-1].round == rounds and progress[-1].bytes_pushed > 0
    assert not progress[-1].refused
    assert (history[-1].round, history[-1].abandoned, history[-1].contributors) == (
        rounds,
        False,
        2,
    )
