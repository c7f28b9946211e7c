"""An update from the trainer to signed push messages (clients/update_pipeline.py): weighted,
clipped, encrypted, committed with its sketches, cut per owning shard; the key holder, the
shards and the round's steps are real servers on loopback."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from clients.update_pipeline import aggregation_weight
from crypto import BlockEncryptor
from fedps.config import load_config
from tests.clients.client_parts import client_parts
from tests.conftest import start_cluster
from tests.round_driver import HandClient, RoundDriver

RUN = "pipeline-run"


def test_weights_are_uniform_unless_examples_weighting_bounded_below() -> None:
    # Prepare
    uniform = load_config(None)
    examples = load_config(None, security={"weighting": "examples", "min_weight": 0.1})
    client_level = load_config(
        None,
        training={"cohort_size": 2},
        privacy={"level": "client", "noise_multiplier": 1.0},
        security={"weighting": "examples"},
    )

    # Execute
    weights = [
        aggregation_weight(uniform, 50, 1000.0),
        aggregation_weight(examples, 50, 100.0),
        aggregation_weight(examples, 50, 1e12),  # a cohort member that declared a huge count
        aggregation_weight(examples, 500, 100.0),
        aggregation_weight(client_level, 50, 1000.0),
    ]

    # Assert: 1 by default and at client level; the share, floored and capped, by examples
    assert weights == [1.0, 0.5, 0.1, 1.0, 1.0]


@pytest.mark.integration
def test_an_update_is_weighted_clipped_encrypted_committed_and_cut_per_owning_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a key holder and two shards; the client joined run RUN; round 1's commit phase
    # open for it, weights by examples. Its update has one value far outside the CKKS range
    # (he.max_abs_value 1).
    training = {"clients": 1, "min_quorum": 1, "rounds": 1}
    security = {"weighting": "examples"}
    cluster = start_cluster(tmp_path, coordinator=False, training=training, security=security)
    parts = client_parts(cluster.config)
    session, kh = parts.session, cluster.keyholder
    try:
        kh.initialize(np.zeros(session.num_params))
        spec = cluster.config.cluster
        shards = dict(zip(spec.shard_ids, spec.shards, strict=True))
        session.connect(spec.keyholder, shards, virtual_nodes=spec.virtual_nodes)
        session.join(run_id=RUN, client_id="client-0")
        encryptor = session.encryptor
        assert isinstance(encryptor, BlockEncryptor)
        driver = RoundDriver(cluster.config, encryptor.public, run_id=RUN)
        hand = HandClient(session.client_id, np.zeros(1), signer=session.signer)
        driver.open_commits(1, 0, [hand])
        delta = np.random.default_rng(3).uniform(-0.2, 0.2, session.num_params)
        delta[7] = 30.0

        # Execute: weight 0.5; then a commitment to round 2, whose commit phase never opened
        with caplog.at_level(logging.WARNING, logger="fedps"):
            prepared = parts.pipeline.prepare(1, 0, delta, weight=0.5)
        late = parts.pipeline.prepare(2, 0, delta, weight=0.5)

        # Assert: the round and version; each block once, in the messages of its owner
        assert prepared is not None and (prepared.round, prepared.version) == (1, 0)
        ring, layout = session.ring, session.layout
        for sid, messages in prepared.messages.items():
            blocks = [b for message in messages for b, _ in message.blocks]
            assert all(ring.owner(b) == sid for b in blocks)
        pushed = sorted(b for ms in prepared.messages.values() for m in ms for b, _ in m.blocks)
        assert pushed == list(range(layout.num_blocks))
        assert "update clipped to +-1" in caplog.text
        # ... the late commitment costs its round only, counted as a slow client's
        assert late is None
        assert parts.failures.counts == {"key holder: round_closed": 1}

        # Execute: the round goes on with what the key holder froze
        commits = driver.freeze(1)
        driver.open_shards(1, 0, [hand], commits)
        parts.pusher.send(prepared)
        driver.close(1)
        driver.apply(1, 0, [hand])

        # Assert: committed before any push; the applied model is the weighted, clipped update
        # over its weight, decrypted from what the pipeline encrypted
        assert list(commits.client_ids) == [session.client_id]
        expected = np.clip(delta * 0.5, -1.0, 1.0) / 0.5
        assert kh.params is not None and kh.version == 1
        assert np.abs(kh.params - expected).max() < 1e-3
    finally:
        parts.close()
        cluster.stop()
