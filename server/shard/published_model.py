"""A shard's published model: the key holder's signed plaintext blocks that the shard serves.

The key holder publishes every new version of the model to the shards, each block to its owner
on the consistent-hash ring (:meth:`PublishedModel.publish`). A publish is checked whole before
anything changes (the model's bounds, exactly this shard's blocks, finite values, the key
holder's signature of every block, a version that is the current one or the next) and, with a
:class:`~server.shard.shard_log.ShardLog`, saved before it is installed, so a restarted shard
serves it again (:meth:`PublishedModel.recover`). The shard ring moves forward when the coordinator
removes or adds a shard (:meth:`PublishedModel.adopt`, from a round's opening or a publish): the
shard then owns the blocks the ring gives it, and serves the moved ones once the key holder
publishes them; a shard that joins starts empty and takes any version first. Clients pull the blocks
(:meth:`PublishedModel.pull`) with their signatures (:meth:`PublishedModel.signature_of`), so
a shard that changed a block is caught. The rounds (:class:`~server.shard.shard.Shard`) read
which blocks the shard owns from here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from fedps.errors import InvalidArgumentError, NotReadyError, PeerUnavailableError, RoundClosedError
from fedps.rpc.messages import ParameterBlock
from fedps.rpc.shard_messages import Publication
from fedps.sharding.hash_ring import HashRing
from fedps.sharding.ring_view import RingView
from server.shard.shard_log import ShardLog

__all__ = ["MAX_BLOCKS", "MAX_BLOCK_VALUES", "PublishedModel"]

_log = logging.getLogger("fedps")

#: Bounds on a published model (about 34 G parameters at N = 2048).
MAX_BLOCKS = 1 << 24
MAX_BLOCK_VALUES = 1 << 16


class PublishedModel:
    """The published version of the blocks one shard owns, with their signatures.

    Parameters
    ----------
    shard_id
        The shard's name on the ring.
    ring
        The cluster's hash ring.
    verify_model
        The key holder's signature check of a published block, ``(version, block, values,
        signature)``; None: publishes are not checked.
    log
        The shard's durable log (None: nothing survives a restart).
    """

    def __init__(
        self,
        shard_id: str,
        ring: HashRing,
        *,
        verify_model: Callable[[int, int, bytes, bytes], bool] | None = None,
        log: ShardLog | None = None,
    ) -> None:
        self.shard_id = shard_id
        self._ring = ring
        #: the version of the ring this shard follows (0: the configured one)
        self.ring_view = RingView.configured(ring.nodes)
        self._verify_model = verify_model  # the key holder's signature check on publishes
        self._log = log
        self._lock = threading.Lock()
        self._values: dict[int, np.ndarray] = {}
        self._signatures: dict[int, bytes] = {}
        self._owned: list[int] = []
        self._num_blocks = 0
        self._values_per_block = 0
        self.version = 0
        self._published = False

    @property
    def published(self) -> bool:
        """Whether a model was published (or recovered)."""
        return self._published

    @property
    def ring(self) -> HashRing:
        """The hash ring this shard follows now."""
        return self._ring

    def adopt(self, view: RingView) -> bool:
        """Follow ``view`` if it is a newer ring; True if it was.

        The blocks this shard owns follow it; a moved block is served once the key holder
        publishes it here.

        A shard off the ring (a standby) follows a newer ring without it too, owning nothing.

        Raises
        ------
        InvalidArgumentError
            The newer ring leaves this shard out while it is on its ring: it was removed.
        """
        if not view.newer_than(self.ring_view):
            return False
        if self.shard_id not in view.nodes and self.shard_id in self.ring_view.nodes:
            raise InvalidArgumentError(
                f"{self.shard_id} is not on ring version {view.version}: it was removed"
            )
        ring = view.ring(self._ring.virtual_nodes)
        with self._lock:
            self._ring, self.ring_view = ring, view
            if self._published:
                self._owned = self._ring_owned(self._num_blocks)
        _log.info(
            "%s follows ring version %d (%s)", self.shard_id, view.version, ", ".join(view.nodes)
        )
        return True

    @property
    def num_blocks(self) -> int:
        """The whole model's number of blocks (0 until a model is published)."""
        return self._num_blocks

    @property
    def owned(self) -> Sequence[int]:
        """The blocks this shard owns in the published model (none until one is published)."""
        return self._owned

    def recover(self) -> bool:
        """Install the model saved in the log, if there is one; True if there was."""
        saved = self._log.load_model() if self._log is not None else None
        if saved is None:
            return False
        self.adopt(RingView.of(saved))
        self._install(
            saved.version,
            saved.num_blocks,
            saved.values_per_block,
            {b.block: np.frombuffer(b.values, dtype="<f4") for b in saved.blocks},
            {b.block: b.signature for b in saved.blocks},
        )
        return True

    def publish(
        self,
        version: int,
        num_blocks: int,
        values_per_block: int,
        blocks: dict[int, np.ndarray],
        signatures: dict[int, bytes] | None = None,
        ring: RingView | None = None,
    ) -> int:
        """Install version ``version`` of every block this shard owns.

        ``ring``: the shard ring the key holder publishes for, followed first if it is newer.
        """
        if ring is not None:
            self.adopt(ring)
        if not 1 <= num_blocks <= MAX_BLOCKS or not 1 <= values_per_block <= MAX_BLOCK_VALUES:
            raise InvalidArgumentError(
                f"a model has 1..{MAX_BLOCKS} blocks of 1..{MAX_BLOCK_VALUES} values"
            )
        if self._published and num_blocks != self._num_blocks:
            raise InvalidArgumentError(
                f"the model has {self._num_blocks} blocks; a publish cannot change that"
            )
        if self._published and not self.version <= version <= self.version + 1:
            raise InvalidArgumentError(
                f"version {version} does not follow {self.version} (expected it or the next)"
            )
        owned = self._ring_owned(num_blocks)
        if set(blocks) != set(owned):
            raise InvalidArgumentError(
                f"publish must carry exactly this shard's {len(owned)} blocks (ring version "
                f"{self.ring_view.version}), got {len(blocks)}"
            )
        for b, values in blocks.items():
            if values.shape != (values_per_block,) or not np.all(np.isfinite(values)):
                raise InvalidArgumentError(f"published block {b} is malformed")
            signature = (signatures or {}).get(b, b"")
            if self._verify_model is not None and not self._verify_model(
                version, b, values.astype("<f4").tobytes(), signature
            ):
                raise InvalidArgumentError(f"published block {b} is not signed by the key holder")
        if self._log is not None:
            self._save_model(
                Publication(
                    version,
                    num_blocks,
                    values_per_block,
                    tuple(
                        ParameterBlock(
                            b, version, v.astype("<f4").tobytes(), (signatures or {}).get(b, b"")
                        )
                        for b, v in sorted(blocks.items())
                    ),
                    **self.ring_view.fields(),
                )
            )
        self._install(version, num_blocks, values_per_block, blocks, signatures or {})
        _log.info("%s published version %d (%d blocks)", self.shard_id, version, len(owned))
        return len(owned)

    def _save_model(self, model: Publication) -> None:
        """Save the published model before installing it.

        A failed write installs nothing and is answered as unavailable (the key holder publishes
        again).
        """
        assert self._log is not None
        try:
            self._log.save_model(model)
        except OSError as exc:
            message = (
                f"{self.shard_id} cannot save version {model.version} of the model "
                f"({exc.strerror or exc}); it keeps version {self.version}"
            )
            _log.error("%s", message)
            raise PeerUnavailableError(message) from exc

    def _install(
        self,
        version: int,
        num_blocks: int,
        values_per_block: int,
        blocks: dict[int, np.ndarray],
        signatures: dict[int, bytes],
    ) -> None:
        with self._lock:
            self._num_blocks, self._values_per_block = num_blocks, values_per_block
            self._owned = self._ring_owned(num_blocks)
            self._values = {b: v.astype("<f4") for b, v in blocks.items()}
            self._signatures = dict(signatures)
            self.version = version
            self._published = True

    def pull(self, min_version: int) -> tuple[int, dict[int, bytes]]:
        """The current version and this shard's blocks as float32 bytes."""
        with self._lock:
            if not self._published:
                raise NotReadyError(f"{self.shard_id} has no model yet")
            if self.version < min_version:
                raise RoundClosedError(
                    f"{self.shard_id} is at version {self.version}, not {min_version} yet"
                )
            return self.version, {b: v.tobytes() for b, v in self._values.items()}

    def signature_of(self, block: int) -> bytes:
        """The key holder's signature of the published block (empty if none)."""
        return self._signatures.get(block, b"")

    def _ring_owned(self, num_blocks: int) -> list[int]:
        return [b for b in range(num_blocks) if self._ring.owner(b) == self.shard_id]
