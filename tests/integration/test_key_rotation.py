"""Key rotation on by default (docs/security.md, claim 21): real servers on loopback.

The key holder makes a new CKKS key pair every ``security.rotate_every_rounds`` rounds (10 by
default) once a round is applied. Rounds after it name the new context; an update under the
old key is refused, counted, and its client goes on under the new one; nothing accepted is
lost or counted twice; a key holder restarted right after a rotation loads the new pair, and
the old secret key is nowhere on disk. In async mode a client whose update missed its buffer
encrypts it again under the new key for the next one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.edge_client import PreparedPush
from clients.train_step import TrainFn, TrainStep
from fedps.config import FedPSConfig
from fedps.errors import InvalidArgumentError, RoundClosedError
from fedps.rpc.transport import bind, create_server
from server.keyholder.keyholder import KeyHolder
from server.serve import add_keyholder
from tests.conftest import Cluster, RecordingClient, run_clients, start_cluster
from tests.round_driver import HandClient, RoundDriver, driven_cluster
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "rotation-run"
PARAMS = 3000


def _round(
    cluster: Cluster, driver: RoundDriver, round_: int, updates: list[np.ndarray]
) -> np.ndarray:
    """Round ``round_`` of three clients under the key holder's current key (the context
    the coordinator names when it opens a round), applied; returns its average update."""
    kh = cluster.keyholder
    driver.public = kh.keys.public
    clients = [HandClient(f"client-{i}", u, version=kh.version) for i, u in enumerate(updates)]
    driver.committed_round(round_, kh.version, clients)
    driver.apply(round_, kh.version, clients)
    average: np.ndarray = np.mean(updates, axis=0)
    return average


def _relative_error(actual: np.ndarray | None, expected: np.ndarray) -> float:
    assert actual is not None
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def test_by_default_a_new_key_every_ten_rounds_and_the_old_key_is_refused(
    tmp_path: Path,
) -> None:
    # Prepare: the default configuration (no security section)
    with driven_cluster(tmp_path, num_shards=2, num_params=PARAMS, run_id=RUN) as ready:
        cluster, driver = ready
        kh, rng = cluster.keyholder, np.random.default_rng(7)
        period = cluster.config.security.rotate_every_rounds
        first = kh.keys.public
        expected, contexts = np.zeros(PARAMS), []

        # Execute: `period` rounds
        for round_ in range(1, period + 1):
            updates = [rng.uniform(-0.1, 0.1, PARAMS) for _ in range(3)]
            expected += _round(cluster, driver, round_, updates)
            contexts.append(kh.context_id)

        # Assert: one key for the period's rounds, a new one once its last round is applied
        assert period == 10
        assert contexts[:-1] == [first.context_id] * (period - 1)
        assert contexts[-1] != first.context_id

        # Execute: the next round; one client still encrypts under the old key
        round_, version = period + 1, kh.version
        driver.public, old = kh.keys.public, RoundDriver(cluster.config, first, run_id=RUN)
        updates = [rng.uniform(-0.1, 0.1, PARAMS) for _ in range(3)]
        a, b, stale = (HandClient(f"client-{i}", u, version=version) for i, u in enumerate(updates))
        driver.open_commits(round_, version, [a, b, stale])
        for client in (a, b):
            driver.commit(round_, client)
        with pytest.raises(InvalidArgumentError, match="key generation"):
            old.commit(round_, stale)  # signed and encrypted under the old key
        # ... it fetches the new context and commits again, under the new key
        again = HandClient(stale.client_id, updates[2], version=version, signer=stale.signer)
        driver.commit(round_, again)
        commits = driver.freeze(round_)
        driver.open_shards(round_, version, [a, b, again], commits)
        refused = sum(s.stats["refused"] for s in cluster.shards)
        with pytest.raises(InvalidArgumentError, match="key generation"):
            old.push(round_, again)  # blocks labelled with the old context
        for client in (a, b, again):
            driver.push(round_, client)
        driver.close(round_)
        reply = driver.apply(round_, version, [a, b, again])
        expected += np.mean(updates, axis=0)

        # Assert: refused and counted; all three applied once; the model is exactly the sum
        assert sum(s.stats["refused"] for s in cluster.shards) == refused + 1
        assert reply.version == version + 1 and reply.fewest_contributors == 3
        assert kh.context_id == contexts[-1]  # the next rotation is due after round 20
        assert _relative_error(kh.params, expected) < 1e-3


def _restart_keyholder(cluster: Cluster) -> KeyHolder:
    """Stop the key holder's server and start a new key holder on its state and address."""
    cluster.servers["keyholder"].stop(grace=None)
    server = create_server()
    bind(server, cluster.config.cluster.keyholder)
    cluster.keyholder = add_keyholder(server, cluster.config, cluster.state_dir / "keyholder")
    server.start()
    cluster.servers["keyholder"] = server
    return cluster.keyholder


def _holding(root: Path, secret: bytes) -> list[Path]:
    """The files under ``root`` whose bytes contain ``secret``."""
    return [p for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


@pytest.fixture
def every_two(tmp_path: Path) -> Iterator[Cluster]:
    """A key holder with a zero model that rotates every two rounds, two shards."""
    cluster = start_cluster(
        tmp_path,
        coordinator=False,
        training={"clients": 3, "min_quorum": 2},
        security={"rotate_every_rounds": 2},
    )
    cluster.keyholder.initialize(np.zeros(PARAMS))
    yield cluster
    cluster.stop()


def test_a_key_holder_restarted_after_a_rotation_loads_the_new_keys(every_two: Cluster) -> None:
    # Prepare: two rounds, then a restart right after the rotation
    cluster = every_two
    keys = cluster.state_dir / "keyholder" / "keys"
    driver = RoundDriver(cluster.config, cluster.keyholder.keys.public, run_id=RUN)
    rng = np.random.default_rng(11)
    old_secret = (keys / "secret.key").read_bytes()
    expected = np.zeros(PARAMS)
    for round_ in (1, 2):
        expected += _round(
            cluster, driver, round_, [rng.uniform(-0.1, 0.1, PARAMS) for _ in range(3)]
        )
    rotated = cluster.keyholder.context_id

    # Execute
    kh = _restart_keyholder(cluster)

    # Assert: the new pair, the old secret key gone from every file the run keeps
    assert kh.context_id == rotated
    assert sorted(p.name for p in keys.iterdir()) == [
        "challenge.key",
        "challenge.key.sha256",
        "public.ctx",
        "secret.key",
        "signing.key",
        "signing.key.sha256",
        "signing.pub",
    ]
    assert (keys / "secret.key").stat().st_mode & 0o777 == 0o600
    assert _holding(cluster.state_dir, old_secret) == []

    # Execute: rounds 3 and 4 under the new key
    contexts = []
    for round_ in (3, 4):
        updates = [rng.uniform(-0.1, 0.1, PARAMS) for _ in range(3)]
        expected += _round(cluster, driver, round_, updates)
        contexts.append(kh.context_id)

    # Assert: the restart kept the period (no rotation after round 3, one after round 4)
    assert contexts[0] == rotated != contexts[1]
    assert _relative_error(kh.params, expected) < 1e-3


class _CommitRecorder(RecordingClient):
    """A real client that also keeps each update by the round it was committed to (async:
    a later buffer than the one it trained for, when it missed that one's freeze)."""

    def __init__(self, config: FedPSConfig, **parts: Any) -> None:
        super().__init__(config, **parts)
        self.committed: dict[int, np.ndarray] = {}

    def prepare(self, round_: int, version: int, delta: np.ndarray) -> PreparedPush | None:
        prepared = super().prepare(round_, version, delta)
        if prepared is not None:
            self.committed[prepared.round] = delta.copy()
        return prepared


def test_async_an_update_that_misses_its_buffer_is_encrypted_again_under_the_new_key(
    tmp_path: Path,
) -> None:
    # Prepare: FedBuff with K = 2 of 3 clients, a new key after every flush. client-2 finishes
    # training for buffer 1 only once buffer 1 is applied (and the keys rotated); in buffer 2
    # the others commit after it.
    training = {"mode": "async", "buffer_size": 2, "clients": 3, "min_quorum": 2}
    cluster = start_cluster(
        tmp_path,
        training={**training, "rounds": 2, "max_staleness": 2, "lr": 0.3},
        security={"rotate_every_rounds": 1},
    )
    kh = cluster.keyholder
    first = kh.context_id

    def committed(round_: int) -> list[str]:
        try:
            return kh.commits.close(round_, freeze=False)[0]
        except RoundClosedError:  # not open yet
            return []

    def late(step: TrainStep, params: np.ndarray, call_next: TrainFn) -> np.ndarray | None:
        if step.round == 1:
            wait_for(lambda: kh.version >= 1, "buffer 1 applied")
        return call_next(step, params)

    def after_late(step: TrainStep, params: np.ndarray, call_next: TrainFn) -> np.ndarray | None:
        if step.round == 2:
            wait_for(lambda: "client-2" in committed(2), "client-2's commitment to buffer 2")
        return call_next(step, params)

    clients = [
        _CommitRecorder.open(cluster.config, index=i, mods=[late if i == 2 else after_late])
        for i in range(3)
    ]
    initial = cluster.coordinator.evaluator.initial_vector()
    try:
        # Execute
        run_clients(clients)

        # Assert: client-2's update (trained on version 0) counted once, in buffer 2, under
        # the second key, staleness-weighted; the model is exactly the two flushes' averages
        results = [kh.apply_round(r, 0) for r in (1, 2)]  # the released results, cached
        assert sorted(results[0].contributors) == ["client-0", "client-1"]
        assert "client-2" in results[1].contributors and list(clients[2].committed) == [2]
        expected = initial.copy()
        for round_, result in enumerate(results, start=1):
            weights = result.contributors
            by_id = {c.client_id: c.committed[round_] for c in clients if round_ in c.committed}
            expected += sum(w * by_id[c] for c, w in weights.items()) / sum(weights.values())
        assert _relative_error(kh.params, expected) < 1e-3  # the flooding noise: about 1e-4
        assert kh.commits.phase(2).context_id not in (first, kh.context_id)  # the second key
        # ... and no update was refused for its key: client-2 trained (and spent) once
        assert not [k for c in clients for k in c.peer_failures if "invalid_argument" in k]
        assert clients[2].rounds_trained == 1
    finally:
        cluster.stop()
