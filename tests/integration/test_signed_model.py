"""The key holder signs its public context and every published block; clients check both."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest

from clients.edge_client import EdgeClient
from crypto.signing import model_verifier
from fedps.errors import InvalidArgumentError
from fedps.rpc.model_reader import ModelReader
from tests.conftest import Cluster
from tests.waiting import HANG_S, wait_for

pytestmark = pytest.mark.integration


def _wait_published(cluster: Cluster) -> None:
    """Wait until every shard has the first published model (they get it one after another)."""
    wait_for(
        lambda: all(s.version > 0 or s.model.published for s in cluster.shards),
        "the first published model on every shard",
    )


def test_pull_verifies_every_block_signature(cluster: Cluster) -> None:
    # Prepare: the coordinator has initialised and published version 0
    _wait_published(cluster)
    kh = cluster.keyholder
    layout = kh.layout
    shards = dict(zip(cluster.config.cluster.shard_ids, cluster.config.cluster.shards, strict=True))
    client = ModelReader(shards)
    # Execute: an honest pull verifies
    vector, _ = client.pull(layout, verify=model_verifier(kh.signer.public_key))
    np.testing.assert_allclose(vector, cast(np.ndarray, kh.params), atol=1e-6)
    # A shard that alters a block it serves is caught
    shard = next(s for s in cluster.shards if s.owned_blocks)
    block = shard.owned_blocks[0]
    shard.model._values[block] = shard.model._values[block] + np.float32(0.5)
    with pytest.raises(InvalidArgumentError, match="signature"):
        client.pull(layout, verify=model_verifier(kh.signer.public_key))
    client.close()


def test_client_refuses_a_key_holder_that_is_not_the_pinned_one(cluster: Cluster) -> None:
    # Prepare: pin some other key
    security = cluster.config.security.model_copy(update={"keyholder_key": "ab" * 32})
    config = cluster.config.model_copy(update={"security": security})
    client = EdgeClient.open(config, index=0)
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="pinned"):
        client.run(timeout_s=HANG_S)
