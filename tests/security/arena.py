"""The attack arena: real key holder and shards on loopback, driven by hand, with a count
of decryptions (sync rounds and async buffers of three model versions)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from crypto import PublicContext, SecretContext
from crypto.signed_update import SignedUpdate
from fedps.errors import PolicyError
from fedps.rpc.messages import Aggregate
from server.keyholder.keyholder import KeyHolder
from server.shard.shard import Shard
from tests.conftest import Cluster, start_cluster
from tests.round_driver import HandClient, RoundDriver

__all__ = ["PARAMS", "RUN", "TAMPER", "TRAINED", "VERSION", "Arena", "arena", "open_arena"]

RUN = "attack-run"
PARAMS = 5000  # three blocks of 2016 values
VERSION = 2
#: sync: every update trained the round's version; async: versions 2, 1 and 0 (staleness).
TRAINED = {"sync": [2, 2, 2], "async": [2, 1, 0]}
TAMPER = Callable[[Aggregate], Aggregate]


@dataclass
class Arena:
    """A cluster, a driver and a count of decryptions."""

    cluster: Cluster
    driver: RoundDriver
    mode: str
    decryptions: list[int]
    rng: np.random.Generator

    @property
    def keyholder(self) -> KeyHolder:
        return self.cluster.keyholder

    @property
    def public(self) -> PublicContext:
        return self.cluster.keyholder.keys.public

    def clients(self, names: list[str] | None = None, *, at: int = VERSION) -> list[HandClient]:
        """Clients with fresh updates, trained on model version ``at`` (async: ``at`` and
        the two before it)."""
        names = names or ["client-0", "client-1", "client-2"]
        return [
            HandClient(name, self.rng.uniform(-0.3, 0.3, PARAMS), version=at - VERSION + trained)
            for name, trained in zip(names, TRAINED[self.mode], strict=False)
        ]

    def owner(self, block: int) -> Shard:
        sid = self.driver.ring.owner(block)
        return next(s for s in self.cluster.shards if s.shard_id == sid)

    def tamper(self, block: int, change: TAMPER) -> None:
        """The shard that owns ``block`` hands over ``change`` of its aggregate."""
        shard = self.owner(block)
        honest = type(shard).aggregates.__get__(shard)

        def tampered(
            round_: int, contributors: Collection[str]
        ) -> tuple[list[Aggregate], list[SignedUpdate]]:
            aggregates, updates = honest(round_, contributors)
            return [change(a) if a.block == block else a for a in aggregates], updates

        shard.aggregates = tampered  # type: ignore[method-assign]

    def heal(self) -> None:
        for shard in self.cluster.shards:
            shard.__dict__.pop("aggregates", None)

    def assert_refused(self, round_: int, clients: list[HandClient]) -> None:
        """The key holder refuses the round and decrypts nothing."""
        before, version = len(self.decryptions), self.keyholder.version
        with pytest.raises(PolicyError):
            self.driver.apply(round_, VERSION, clients)
        assert len(self.decryptions) == before, "the key holder decrypted a tampered round"
        assert self.keyholder.version == version
        self.heal()


@pytest.fixture(params=["sync", "async"])
def arena(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Arena]:
    arena = open_arena(tmp_path, request.param)
    yield arena
    arena.cluster.stop()


def open_arena(tmp_path: Path, mode: str, **sections: Mapping[str, object]) -> Arena:
    """An arena in ``mode`` (sync or async), with more configuration ``sections``; the caller
    stops its cluster."""
    training: dict[str, object] = {"clients": 3, "min_quorum": 2, "mode": mode}
    if mode == "async":
        training.update({"buffer_size": 2, "max_staleness": 2})
    cluster = start_cluster(
        tmp_path,
        num_shards=2,
        coordinator=False,
        training=training,
        security={"max_detections": 100_000},  # the attacker may retry as often as it likes
        **sections,
    )
    kh = cluster.keyholder
    kh.initialize(np.zeros(PARAMS), version=VERSION)
    decryptions: list[int] = []
    keys = kh.keys
    assert isinstance(keys, SecretContext)  # one key holder (parties: tests/integration)
    open_ = keys.open

    def counting(rows: np.ndarray, *, noise_weight: float) -> np.ndarray:
        opened = open_(rows, noise_weight=noise_weight)  # raises before decrypting anything
        decryptions.append(len(rows))
        return opened

    kh.keys.open = counting  # type: ignore[method-assign]
    driver = RoundDriver(cluster.config, kh.keys.public, run_id=RUN)
    return Arena(cluster, driver, mode, decryptions, np.random.default_rng(7))
