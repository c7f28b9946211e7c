"""``fedps export``: the trained global model as a PyTorch ``state_dict``, its signature checked.

The model is pulled the way a client pulls it: the key holder's public context gives its
Ed25519 key (checked against ``security.keyholder_key`` when that pins it, trusted on first
use otherwise, with a warning) and the context's signature is verified with it; the blocks of
the published version are then pulled from the shards on the ring the coordinator publishes
(:func:`published_ring`: shards declared gone or added while training are followed) and every
block's key-holder signature verified (:func:`crypto.signing.model_verifier`), so a shard cannot
hand out a model the key holder did not publish. The flat vector is loaded into the task's model
(:meth:`fedps.learning.tasks.Task.create_model`), whose ``state_dict`` is what :func:`export_model`
saves: ``model.load_state_dict(torch.load(path))`` loads it into the same task's model.

A stopped cluster (``fedps up`` ends when training does) is read from its state folder: each
shard on the ring the coordinator checkpointed saved the blocks it published, with their
signatures (``STATE_DIR/shard-i/model.pb``), and every block is verified against the pinned
key, or the key holder's ``keys/signing.pub`` in the same state folder (:func:`read_saved_model`).
A shard declared gone keeps the older version it saved; it is not read.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from crypto.signing import model_verifier
from fedps.ckks_params import ckks_params
from fedps.config import FedPSConfig
from fedps.errors import (
    ConfigError,
    FedPSError,
    InvalidArgumentError,
    PeerUnavailableError,
    RoundClosedError,
)
from fedps.learning.tasks import Task, load_task
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_stub import KeyHolderStub, verified_signing_key
from fedps.rpc.model_reader import ModelReader
from fedps.sharding.blocks import BlockLayout, flatten_model, load_flat
from fedps.sharding.ring_view import RingView
from server.coordinator.checkpoint_store import CheckpointStore
from server.keyholder.state_store import saved_version
from server.shard.shard_log import load_published_model

__all__ = ["checkpointed_ring", "export_model", "published_ring", "pull_model", "read_saved_model"]

_log = logging.getLogger("fedps")

#: Deadline of each call to the key holder.
_CALL_S = 10.0
#: How often a pull caught in a publish (shards at different versions) is tried again.
_PULL_ATTEMPTS = 20


def pull_model(config: FedPSConfig, *, task: Task | None = None) -> tuple[torch.nn.Module, int]:
    """The published global model in the task's model, and its version.

    Parameters
    ----------
    config
        The cluster's configuration (addresses, ``security.keyholder_key``, the task).
    task
        The task whose model to fill (default: the configured one).

    Raises
    ------
    FedPSError
        The key holder or a shard is unreachable, the key holder is not the pinned one, its
        public context or a block does not verify, or the published model does not fit the
        task's model. The message is one line.
    """
    task = task or load_task(config)
    model = task.create_model(config.training.seed)
    num_params = flatten_model(model).size
    cluster = config.cluster
    keyholder = KeyHolderStub(cluster.keyholder)
    try:
        key = verified_signing_key(
            keyholder.get_public_context(timeout_s=_CALL_S),
            pinned=config.security.keyholder_key,
            refusing="its model",
        )
        state = keyholder.get_model_state(timeout_s=_CALL_S)
    except PeerUnavailableError:
        if not _saved_models(config):
            raise
        _log.info("the cluster is not running: reading the model its shards saved")
        return read_saved_model(config, task=task)
    finally:
        keyholder.close()
    if not state.initialized:
        raise FedPSError("the key holder has published no model yet")
    if state.num_params != num_params:
        raise ConfigError(
            f"the published model has {state.num_params} parameters but task {task.name!r}'s "
            f"model has {num_params}: export with the configuration the cluster trained with"
        )
    layout = BlockLayout(num_params, ckks_params(config).values_per_block)
    addresses = dict(zip(cluster.shard_ids, cluster.shards, strict=True))
    shards = ModelReader({sid: addresses[sid] for sid in published_ring(config).nodes})
    try:
        vector, version = _pull(shards, layout, state.version, key)
    finally:
        shards.close()
    load_flat(model, vector)
    return model, version


def published_ring(config: FedPSConfig) -> RingView:
    """The shard ring the coordinator publishes now (``fedps status`` shows it).

    The ring it checkpointed when it does not answer (:func:`checkpointed_ring`).
    """
    coordinator = CoordinatorStub(config.cluster.coordinator)
    try:
        view = RingView.of(coordinator.get_status(timeout_s=_CALL_S))
    except PeerUnavailableError:
        return checkpointed_ring(config)
    finally:
        coordinator.close()
    return view if view.carried else RingView.configured(config.cluster.ring_ids)


def checkpointed_ring(config: FedPSConfig) -> RingView:
    """The shard ring in the coordinator's checkpoint (none: the configured ring, version 0).

    Raises
    ------
    CorruptStateError
        The checkpoint cannot be read.
    """
    directory = config.cluster.state_dir / "coordinator"
    checkpoint = CheckpointStore(directory).load() if directory.is_dir() else None
    ring = checkpoint.state.get("ring") if checkpoint is not None else None
    if not ring:
        return RingView.configured(config.cluster.ring_ids)
    return RingView(int(ring["version"]), tuple(ring["nodes"]))


def _saved_models(config: FedPSConfig) -> list[Path]:
    """Each saved model of the shards on the checkpointed ring (empty unless all exist)."""
    cluster = config.cluster
    paths = [cluster.state_dir / sid / "model.pb" for sid in checkpointed_ring(config).nodes]
    return paths if all(p.exists() for p in paths) else []


def read_saved_model(
    config: FedPSConfig, *, task: Task | None = None
) -> tuple[torch.nn.Module, int]:
    """The published global model as the shards saved it in ``cluster.state_dir``, and its version.

    The shards read are those on the ring the coordinator checkpointed (:func:`checkpointed_ring`),
    each holding the blocks that ring gives it; every block is verified against the key
    holder's key.

    The key is ``security.keyholder_key`` when that pins one, else the key holder's
    ``keys/signing.pub`` in the same state folder.

    Raises
    ------
    FedPSError
        A shard saved no model, the files are damaged or at different versions, a block does
        not verify, the key is missing, or the model does not fit the task's model.
    """
    task = task or load_task(config)
    model = task.create_model(config.training.seed)
    cluster = config.cluster
    layout = BlockLayout(flatten_model(model).size, ckks_params(config).values_per_block)
    view = checkpointed_ring(config)
    owners = view.ring(cluster.virtual_nodes).assignment(layout.num_blocks)
    verify = model_verifier(_saved_key(config))
    published = saved_version(cluster.state_dir / "keyholder")
    blocks: dict[int, np.ndarray] = {}
    versions: set[int] = set()
    for sid in view.nodes:
        path = cluster.state_dir / sid / "model.pb"
        saved = load_published_model(path.parent)
        if saved is None:
            raise FedPSError(f"{sid} saved no published model in {path.parent}")
        versions.add(saved.version)
        if published is not None and saved.version != published:
            raise FedPSError(
                f"{path} holds version {saved.version} but the key holder published version "
                f"{published}; refusing the model"
            )
        got = sorted(block.block for block in saved.blocks)
        if saved.ring_version != view.version and got != owners.get(sid, []):
            raise FedPSError(
                f"{path} holds the blocks of ring version {saved.ring_version}, not of version "
                f"{view.version} that the coordinator checkpointed: start the cluster, so that "
                "the key holder publishes the model on it, and export again"
            )
        if got != owners.get(sid, []):
            raise FedPSError(
                f"{path} holds blocks other than {sid}'s ({len(got)} blocks, "
                f"{len(owners.get(sid, []))} expected): export with the configuration the "
                "cluster trained with"
            )
        for block in saved.blocks:
            # the signed version, not the file's: a shard cannot mix in an older block
            if block.version != saved.version or not verify(
                block.version, block.block, block.values, block.signature
            ):
                raise InvalidArgumentError(
                    f"block {block.block} in {path} does not verify as version {saved.version} "
                    "of the key holder's model; refusing the model"
                )
            blocks[block.block] = np.frombuffer(block.values, dtype="<f4").astype(np.float64)
    if len(versions) != 1:
        raise FedPSError(f"the shards saved different versions {sorted(versions)}")
    load_flat(model, layout.join(blocks))
    return model, versions.pop()


def _saved_key(config: FedPSConfig) -> bytes:
    """The pinned key, or the key holder's own ``keys/signing.pub`` in the state folder."""
    if config.security.keyholder_key:
        return bytes.fromhex(config.security.keyholder_key)
    path = config.cluster.state_dir / "keyholder" / "keys" / "signing.pub"
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        raise FedPSError(
            f"no key to verify the saved model with: pin security.keyholder_key or keep {path}"
        ) from None


def export_model(config: FedPSConfig, path: Path, *, task: Task | None = None) -> int:
    """Write the published global model's ``state_dict`` to ``path`` (``torch.save``).

    After checking its signature (:func:`pull_model`); returns the model's version.

    Raises
    ------
    FedPSError
        As :func:`pull_model`, or ``path`` cannot be written.
    """
    if not path.parent.is_dir():  # torch.save would raise a RuntimeError
        raise FedPSError(f"cannot write {path}: no folder {path.parent}")
    model, version = pull_model(config, task=task)
    try:
        torch.save(model.state_dict(), path)
    except OSError as exc:
        raise FedPSError(f"cannot write {path}: {exc.strerror or exc}") from None
    return version


def _pull(
    shards: ModelReader, layout: BlockLayout, version: int, key: bytes
) -> tuple[np.ndarray, int]:
    """Pull version ``version`` or later, every block verified against ``key``.

    A pull caught in a publish (shards at different versions) is tried again.
    """
    attempts = 0
    while True:
        try:
            return shards.pull(layout, version, verify=model_verifier(key))
        except RoundClosedError as exc:
            attempts += 1
            if attempts >= _PULL_ATTEMPTS:
                raise
            _log.info("pull caught in a publish (%s); trying again", exc)
            time.sleep(0.5)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc}; refusing the model") from None
