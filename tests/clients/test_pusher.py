"""A committed update on its way to the shards (clients/pusher.py): pushed once the push phase
opens, each block to its owner, a failing shard costing only its own blocks, resent unchanged
when asked, and counted once. Real servers on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest

from clients.client_session import ClientSession
from clients.peer_failures import PeerFailures
from clients.pusher import Pusher
from clients.update_pipeline import PreparedPush
from crypto import BlockEncryptor
from fedps.errors import FedPSError, InvalidArgumentError
from fedps.rpc.coordinator_messages import Assignment
from fedps.rpc.shard_messages import PushBatch, PushReceipt
from tests.clients.client_parts import ClientParts, client_parts
from tests.conftest import Cluster, start_cluster
from tests.round_driver import HandClient, RoundDriver, TaskPoller
from tests.waiting import HANG_S, wait_for

pytestmark = pytest.mark.integration

RUN = "pusher-run"
ONE_CLIENT = {"clients": 1, "min_quorum": 1, "rounds": 1, "deadline_s": 60.0}


@contextmanager
def _committed(tmp_path: Path) -> Iterator[tuple[Cluster, ClientParts, RoundDriver, PreparedPush]]:
    """A key holder and two shards driven by hand; the client joined run RUN and committed
    its update to round 1, whose commitments are frozen and whose round is open on the
    shards."""
    cluster = start_cluster(tmp_path, coordinator=False, training=ONE_CLIENT)
    parts = client_parts(cluster.config, peer_wait_s=0.5)
    session = parts.session
    try:
        cluster.keyholder.initialize(np.zeros(session.num_params))
        spec = cluster.config.cluster
        shards = dict(zip(spec.shard_ids, spec.shards, strict=True))
        session.connect(spec.keyholder, shards, virtual_nodes=spec.virtual_nodes)
        session.join(run_id=RUN, client_id="client-0")
        assert isinstance(session.encryptor, BlockEncryptor)
        driver = RoundDriver(cluster.config, session.encryptor.public, run_id=RUN)
        hand = HandClient(session.client_id, np.zeros(1), signer=session.signer)
        driver.open_commits(1, 0, [hand])
        delta = np.random.default_rng(5).uniform(-0.1, 0.1, session.num_params)
        prepared = parts.pipeline.prepare(1, 0, delta, weight=1.0)
        assert prepared is not None
        driver.open_shards(1, 0, [hand], driver.freeze(1))
        yield cluster, parts, driver, prepared
    finally:
        parts.close()
        cluster.stop()


def test_an_update_reaches_each_owning_shard_and_a_resend_counts_once(tmp_path: Path) -> None:
    with _committed(tmp_path) as (_, parts, driver, prepared):
        # Prepare
        pusher = parts.pusher
        acknowledged: list[tuple[int, str]] = []
        pusher.on_acknowledged = lambda round_, sid: acknowledged.append((round_, sid))
        hand = HandClient(parts.session.client_id, np.zeros(1), signer=parts.session.signer)

        # Execute: push; asked again for round 1 (a coordinator that missed the report), and
        # for round 2, in which nothing was committed
        sent = pusher.send(prepared)
        again = pusher.resend(Assignment("push", 1, 0))
        other = pusher.resend(Assignment("push", 2, 0, retry_after=0.0))
        complete = driver.close(1)
        reply = driver.apply(1, 0, [hand])

        # Assert: every owner acknowledged, twice; the repeat was counted once
        owners = sorted(prepared.messages)
        assert sent == pusher.bytes_pushed > 0 and pusher.push_seconds > 0
        assert sorted(acknowledged) == sorted([(1, sid) for sid in owners] * 2)
        assert pusher.committed == prepared
        assert again and not other
        assert complete == {parts.session.client_id}
        assert reply.version == 1 and reply.fewest_contributors == 1
        assert parts.failures.total == 0


def test_a_shard_that_fails_costs_its_own_blocks_only(tmp_path: Path) -> None:
    with _committed(tmp_path) as (cluster, parts, _, prepared):
        # Prepare: the shards that own blocks, and one of them gone
        owners = sorted(prepared.messages)
        assert len(owners) == 2, "both shards should own a block of this model"
        cluster.servers[owners[1]].stop(grace=None)
        kept = cluster.shards[cluster.config.cluster.shard_ids.index(owners[0])]

        # Execute
        sent = parts.pusher.send(prepared)

        # Assert: the other shard took its blocks; the gone one is counted against it, and the
        # update is kept for a push again
        assert sent > 0 and kept.stats["accepted"] > 0
        assert list(parts.failures.counts) == [f"{owners[1]}: peer_unavailable"]
        assert parts.pusher.committed == prepared

        # Execute: the coordinator now runs another run (it lost its state)
        parts.session.run_id = "another-run"

        # Assert: the update of the old run is not pushed in the new one
        assert parts.pusher.committed is None


def test_the_push_waits_for_the_push_phase_and_the_round_applies(tmp_path: Path) -> None:
    # Prepare: a coordinator with one client; the client registered and asked to train
    cluster = start_cluster(tmp_path, training=ONE_CLIENT)
    parts = client_parts(cluster.config)
    session = parts.session
    try:
        assert session.start(time.time() + HANG_S)
        task = session.poll_task(retry_s=HANG_S)
        while task.kind != "train":
            time.sleep(task.retry_after)
            task = session.poll_task(retry_s=HANG_S)
        vector, _ = session.pull(task.version)
        parts.ledger.record_next_round()
        delta = np.full_like(vector, 0.01)
        prepared = parts.pipeline.prepare(task.round, task.version, delta, weight=1.0)
        assert prepared is not None

        # Execute: wait for the commitments to freeze, push, report
        pushed = parts.pusher.push_when_open(prepared)
        session.report(task.round, pushed=pushed, weight=1.0)
        wait_for(lambda: cluster.coordinator.finished, "the round applied")

        # Assert
        assert pushed == parts.pusher.bytes_pushed > 0
        record = cluster.coordinator.history[-1]
        assert (record.round, record.abandoned, record.contributors) == (1, False, 1)
    finally:
        parts.close()
        cluster.stop()


def test_a_round_that_ends_before_its_push_phase_pushes_nothing(tmp_path: Path) -> None:
    # Prepare: a round needs both clients' updates; the other client sends none
    training = {**ONE_CLIENT, "clients": 2, "min_quorum": 2}
    cluster = start_cluster(tmp_path, training=training)
    parts = client_parts(cluster.config)
    session, stop = parts.session, threading.Event()
    polling: threading.Thread | None = None
    try:
        assert session.start(time.time() + HANG_S)
        other = TaskPoller(cluster.config, "client-1", num_params=session.num_params)
        polling = threading.Thread(target=other.run, args=(stop,))
        polling.start()
        task = session.poll_task(retry_s=HANG_S)
        while task.kind != "train":
            time.sleep(task.retry_after)
            task = session.poll_task(retry_s=HANG_S)
        session.pull(task.version)
        parts.ledger.record_next_round()
        delta = np.full(session.num_params, 0.01)
        prepared = parts.pipeline.prepare(task.round, task.version, delta, weight=1.0)
        assert prepared is not None

        # Execute
        pushed = parts.pusher.push_when_open(prepared)

        # Assert: the round was abandoned at its freeze; nothing reached a shard
        assert pushed == 0 and parts.pusher.bytes_pushed == 0
        assert parts.pusher.committed is None  # never sent, so never kept
        assert cluster.coordinator.history[-1].abandoned
    finally:
        stop.set()
        if polling is not None:
            polling.join(HANG_S)  # before its coordinator goes
        parts.close()
        cluster.stop()


class _MeetingShard:
    """A shard that takes a push only once every shard is being pushed to (``meeting``), then
    acknowledges it or answers ``refusal``."""

    def __init__(self, meeting: threading.Barrier, refusal: FedPSError | None = None) -> None:
        self.meeting = meeting
        self.refusal = refusal

    def push_blocks(
        self, batches: Sequence[PushBatch], *, retry_s: float | None = None
    ) -> PushReceipt:
        self.meeting.wait()
        if self.refusal is not None:
            raise self.refusal
        return PushReceipt(len(batches), 0, sent_bytes=100 * len(batches))


def test_every_shard_is_pushed_to_at_once_and_a_refusal_costs_only_its_own(
    tmp_path: Path,
) -> None:
    # Prepare: two shards that wait for each other (pushed one after the other, neither answers)
    meeting = threading.Barrier(2, timeout=HANG_S)
    shards = {
        "shard-0": _MeetingShard(meeting),
        "shard-1": _MeetingShard(meeting, InvalidArgumentError("refused")),
    }
    session = SimpleNamespace(shards=SimpleNamespace(shards=shards), peer_wait_s=0.0)
    failures = PeerFailures("edge-0", identity="client-0", tls_directory=tmp_path)
    pusher = Pusher(cast(ClientSession, session), failures)
    acknowledged: list[tuple[int, str, threading.Thread]] = []
    pusher.on_acknowledged = lambda round_, sid: acknowledged.append(
        (round_, sid, threading.current_thread())
    )
    batch = PushBatch("client-0", 1, 0, 1.0, "ctx", [(0, b"x")])
    # Execute
    pushed = pusher.push_all(PreparedPush(1, 0, {"shard-0": [batch], "shard-1": [batch]}))
    # Assert
    assert pushed == 100
    assert acknowledged == [(1, "shard-0", threading.current_thread())]  # heard in this thread
    assert failures.total == 1 and all(k.startswith("shard-1: ") for k in failures.counts)
