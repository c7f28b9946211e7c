"""Wire each role's handler into a gRPC server.

Each ``add_*`` function builds a role from the configuration and registers its servicer on a
server that the caller created and bound (tests bind port 0 first, then build the config from
the bound ports). :func:`serve_forever` is what ``fedps keyholder|shard|coordinator`` run.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc

from crypto import PLAINTEXT_CONTEXT_ID, PlainContext, PublicContext
from crypto.signing import model_verifier
from fedps.ckks_params import ckks_params, quantized_packing, upload_fields
from fedps.config import FedPSConfig, is_loopback
from fedps.errors import InvalidArgumentError
from fedps.learning.accounting import client_level_noise
from fedps.learning.staleness import create_staleness
from fedps.proto import (
    common_pb2,
    coordinator_pb2_grpc,
    keyholder_party_pb2_grpc,
    keyholder_pb2_grpc,
    shard_pb2_grpc,
)
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_party_stub import KeyHolderPartyStub
from fedps.rpc.keyholder_stub import KeyHolderStub, verified_signing_key
from fedps.rpc.shard_stub import ShardStub
from fedps.rpc.transport import bind, call, create_channel, create_server
from fedps.sharding.blocks import group_mask
from fedps.sharding.hash_ring import HashRing
from fedps.startup import loading
from fedps.stop_signal import on_stop_signals
from fedps.storage.state_lock import StateLock
from server.keyholder.cluster_round_source import ClusterRoundSource
from server.keyholder.group_policy import GroupPolicy
from server.keyholder.joint_keys import JointKeys
from server.keyholder.keyholder import KeyHolder
from server.keyholder.keyholder_party_servicer import KeyHolderPartyServicer
from server.keyholder.keyholder_servicer import KeyHolderServicer
from server.keyholder.keyholder_settings import KeyHolderSettings
from server.keyholder.party_process import PartyProcess, PartySettings, party_folder
from server.keyholder.server_optimizer import create_server_optimizer
from server.metrics import CoordinatorMetrics, KeyHolderMetrics, PartyMetrics, ShardMetrics
from server.shard.shard import Shard
from server.shard.shard_log import ShardLog, discard_shard_state
from server.shard.shard_servicer import ShardServicer

if TYPE_CHECKING:  # the coordinator (and torch) load only in the coordinator's process
    from fedps.learning.tasks import Task
    from server.coordinator.coordinator import Coordinator
    from server.coordinator.coordinator_settings import CoordinatorSettings

__all__ = [
    "add_coordinator",
    "add_keyholder",
    "add_party",
    "add_shard",
    "coordinator_settings",
    "keyholder_settings",
    "open_coordinator",
    "open_keyholder",
    "party_round_source",
    "serve_forever",
]

_log = logging.getLogger("fedps")

#: Public contexts a shard keeps parsed (about 0.6 MiB each); an older key generation, which
#: only a round still open across a key rotation needs, is read again from the shard's log.
_CONTEXTS_KEPT = 4


def _ring(config: FedPSConfig) -> HashRing:
    """The ring the run starts on: every shard but ``cluster.standby`` (version 0)."""
    return HashRing(config.cluster.ring_ids, virtual_nodes=config.cluster.virtual_nodes)


def weight_bounds(config: FedPSConfig) -> tuple[float, float]:
    """The range of aggregation weights the key holder accepts (``security.weighting``)."""
    if config.security.weighting == "uniform" or config.privacy.level == "client":
        return (1.0, 1.0)
    return (config.security.min_weight, 1.0)


def _staleness(config: FedPSConfig) -> Callable[[int], float] | None:
    """The staleness function in async mode, None in sync mode."""
    t = config.training
    if t.mode != "async":
        return None
    return create_staleness(t.staleness, a=t.staleness_a, b=t.staleness_b)


def _group_policy(config: FedPSConfig) -> GroupPolicy | None:
    """The mixed policy of ``[groups]``, None when every parameter follows the mode."""
    t = config.training
    if not config.groups.sync:
        return None
    from fedps.learning.tasks import load_task

    model = load_task(config).create_model(t.seed)
    return GroupPolicy(group_mask(model, config.groups.sync), config.groups.buffers_per_round(t))


_M = TypeVar("_M", KeyHolderMetrics, ShardMetrics, PartyMetrics, CoordinatorMetrics)


def _metrics(address: str, role: str, make: Callable[[], _M]) -> _M | None:
    """The role's metrics (``make()``), served on ``address``.

    None when no address is configured.
    """
    if not address:
        return None
    if not is_loopback(address.rpartition(":")[0]):  # only with metrics.public = true
        _log.warning(
            "%s metrics on %s are public (metrics.public = true): anyone who reaches the port "
            "reads them",
            role,
            address,
        )
    metrics = make()
    port = metrics.serve(address)
    _log.info("%s metrics on port %d", role, port)
    return metrics


def keyholder_settings(config: FedPSConfig) -> KeyHolderSettings:
    """The key holder's policy from the configuration."""
    t = config.training
    return KeyHolderSettings(
        params=ckks_params(config),
        min_quorum=t.min_quorum,
        encrypted=config.he.enabled,
        max_clients=config.he.max_clients,
        max_abs_value=config.he.max_abs_value,
        flood_bits=config.security.flood_bits,
        rotate_every_rounds=config.security.rotate_every_rounds,
        staleness=_staleness(config),
        max_staleness=t.max_staleness,
        weight_bounds=weight_bounds(config),
        max_detections=config.security.max_detections,
        max_shard_misses=config.security.max_shard_misses,
        shard_deadline_s=config.security.shard_deadline_s,
        client_noise=(
            client_level_noise(t, config.privacy) if config.privacy.level == "client" else None
        ),
        density=config.compression.density,
        packing=quantized_packing(config),
        parties=config.keyholder.parties,
        threshold=config.keyholder.quorum,
        lambda_bits=config.keyholder.lambda_bits,
    )


def open_keyholder(config: FedPSConfig, state_dir: Path) -> KeyHolder:
    """The key holder of ``config`` on its state folder ``state_dir`` (:meth:`KeyHolder.open`)."""
    t = config.training
    return KeyHolder.open(
        state_dir,
        keyholder_settings(config),
        shards=dict(zip(config.cluster.shard_ids, config.cluster.shards, strict=True)),
        ring=_ring(config),
        optimizer=create_server_optimizer(
            t.server_optimizer, lr=t.server_lr, momentum=t.server_momentum
        ),
        groups=_group_policy(config),
        parties=dict(enumerate(config.cluster.parties, start=1)),
    )


def add_keyholder(server: grpc.Server, config: FedPSConfig, state_dir: Path) -> KeyHolder:
    """Open the key holder (:func:`open_keyholder`) and register its servicer."""
    keyholder = open_keyholder(config, state_dir)
    metrics = _metrics(config.metrics.keyholder, "keyholder", KeyHolderMetrics)
    if metrics is not None:
        metrics.version.set_function(lambda: keyholder.version)
        keyholder.suspects.on_tampering = metrics.tampering_detected
        keyholder.suspects.on_blame = metrics.client_blamed
        keyholder.shard_misses.on_miss = metrics.track_shard_misses()
        metrics.track_checkpoint(lambda: keyholder.last_saved)
        keys = keyholder.keys
        if isinstance(keys, JointKeys):  # key-holder parties: those the last decryption missed
            metrics.parties_down.set_function(lambda: len(keys.decryptor.down))
    servicer = KeyHolderServicer(keyholder, metrics)
    keyholder_pb2_grpc.add_KeyHolderServicer_to_server(servicer, server)
    return keyholder


def _combiner_key(config: FedPSConfig, public: PublicContext) -> bytes:
    """The combiner's signing key, from its public context (pinned by ``security.keyholder_key``).

    Raises
    ------
    InvalidArgumentError
        The combiner serves another context than the parties' joint one.
    """
    stub = KeyHolderStub(config.cluster.keyholder)
    try:
        info = stub.get_public_context(retry_s=60.0)
    finally:
        stub.close()
    if info.context_id != public.context_id:
        raise InvalidArgumentError(
            "the key holder serves another public context than the parties' joint one"
        )
    pinned = config.security.keyholder_key
    return verified_signing_key(info, pinned=pinned, refusing="its requests", who="combiner key")


def party_round_source(config: FedPSConfig, public: PublicContext) -> ClusterRoundSource:
    """The coordinator and the shards, as a party asks them.

    From the ring the run starts on; the party follows the ring each closed round comes with.
    """
    cluster = config.cluster
    shards = zip(cluster.shard_ids, cluster.shards, strict=True)
    return ClusterRoundSource(
        CoordinatorStub(cluster.coordinator),
        {sid: ShardStub(sid, address) for sid, address in shards},
        _ring(config),
        public,
    )


def add_party(server: grpc.Server, config: FedPSConfig, index: int) -> PartyProcess:
    """Open key-holder party ``index`` (1..P) in its folder and register its servicer."""
    addresses = dict(enumerate(config.cluster.parties, start=1))
    if config.keyholder.parties <= 1:
        raise InvalidArgumentError("keyholder.parties is 1: one key holder, no party to run")
    if index not in addresses:
        raise InvalidArgumentError(
            f"party {index} is not one of cluster.parties (1..{len(addresses)})"
        )
    settings = PartySettings(
        index=index,
        addresses=addresses,
        threshold=config.keyholder.quorum,
        params=ckks_params(config),
        min_quorum=config.training.min_quorum,
        lambda_bits=config.keyholder.lambda_bits,
    )
    party = PartyProcess(
        settings,
        party_folder(config.cluster.state_dir, index),
        source=lambda public: party_round_source(config, public),
        combiner_key=lambda public: _combiner_key(config, public),
    ).open()
    metric_addresses = config.metrics.parties
    name = f"party-{index}"
    metrics = _metrics(
        metric_addresses[index - 1] if metric_addresses else "", name, lambda: PartyMetrics(name)
    )
    if metrics is not None:
        metrics.ready.set_function(lambda: float(party.ready))
    servicer = KeyHolderPartyServicer(party, keygen=party, metrics=metrics)
    keyholder_party_pb2_grpc.add_KeyHolderPartyServicer_to_server(servicer, server)
    return party


def _generate_keys(party: PartyProcess, config: FedPSConfig, stop: threading.Event) -> None:
    """Start ``party``'s key generation with the other parties in a thread (if it has no share).

    The other parties are kept for the key rotations the combiner asks for, too.
    """
    n = ckks_params(config).poly_modulus_degree
    peers = {
        j: KeyHolderPartyStub(address, n=n)
        for j, address in enumerate(config.cluster.parties, start=1)
        if j != party.index
    }
    party.connect(peers, stop)
    if party.ready:
        return
    thread = threading.Thread(target=party.generate, args=(peers, stop), name="keygen", daemon=True)
    thread.start()


def add_shard(
    server: grpc.Server, config: FedPSConfig, index: int, *, empty: bool = False
) -> Shard:
    """Build shard ``index`` and register its servicer.

    ``empty``: set the shard's old state aside first (:func:`.discard_shard_state`), for a shard
    declared gone that comes back to join the ring again.
    """
    ids = config.cluster.shard_ids
    if not 0 <= index < len(ids):
        raise InvalidArgumentError(f"shard index {index} out of range [0, {len(ids)})")
    if empty:
        aside = discard_shard_state(config.cluster.state_dir / ids[index])
        if aside is not None:
            _log.warning("%s starts empty; its old state is set aside in %s", ids[index], aside)
    stub = keyholder_pb2_grpc.KeyHolderStub(create_channel(config.cluster.keyholder))
    contexts: OrderedDict[str, PublicContext] = OrderedDict()  # the latest used last
    lock = threading.Lock()
    log = ShardLog(config.cluster.state_dir / ids[index], fsync=config.cluster.fsync)

    def public_context(context_id: str) -> PublicContext | PlainContext:
        if context_id == PLAINTEXT_CONTEXT_ID:
            if config.he.enabled:
                raise InvalidArgumentError("this shard only accepts encrypted updates")
            return PlainContext(ckks_params(config).values_per_block)
        with lock:
            saved = log.load_context(context_id) if context_id not in contexts else None
            if saved is not None:  # fetched before a restart
                restored = PublicContext.from_bytes(saved)
                contexts[restored.context_id] = restored
            if context_id not in contexts:
                reply = call(
                    lambda: stub.GetPublicContext(common_pb2.Empty()), "fetch public context"
                )
                public = PublicContext.from_bytes(reply.context)
                contexts[public.context_id] = public
                log.save_context(public.context_id, bytes(reply.context))
            if context_id not in contexts:
                raise InvalidArgumentError("unknown key generation (context id)")
            contexts.move_to_end(context_id)
            while len(contexts) > _CONTEXTS_KEPT:  # the key holder rotates its keys
                contexts.popitem(last=False)
            return contexts[context_id]

    keyholder_key: list[bytes] = []

    def verify_model(version: int, block: int, values: bytes, signature: bytes) -> bool:
        if not keyholder_key:
            reply = call(lambda: stub.GetPublicContext(common_pb2.Empty()), "key holder key")
            keyholder_key.append(bytes(reply.signing_key))
        return model_verifier(keyholder_key[0])(version, block, values, signature)

    t = config.training
    shard = Shard(
        ids[index],
        _ring(config),
        public_context,
        max_messages_per_round=config.security.max_pushes_per_round,
        staleness=_staleness(config),
        max_staleness=t.max_staleness,
        verify_model=verify_model,
        log=log,
        density=config.compression.density,
        fields=upload_fields(config),
        standby=ids[index] in config.cluster.standby or empty,
    )
    shard.recover()
    address = config.metrics.shards[index] if config.metrics.shards else ""
    metrics = _metrics(address, ids[index], lambda: ShardMetrics(ids[index]))
    if metrics is not None:
        metrics.version.set_function(lambda: shard.version)
    shard_pb2_grpc.add_ShardServicer_to_server(ShardServicer(shard, metrics), server)
    return shard


def _server_threads(role: str) -> int:
    """The gRPC server threads of ``role``.

    The coordinator has one more for each waiting client's ``GetTask`` call it may hold (a long
    poll).
    """
    if role != "coordinator":
        return 16
    from server.coordinator.coordinator_settings import MAX_HELD_CALLS

    return 16 + MAX_HELD_CALLS


def coordinator_settings(config: FedPSConfig) -> CoordinatorSettings:
    """The coordinator's schedule and limits from the configuration."""
    from server.coordinator.coordinator_settings import CoordinatorSettings

    return CoordinatorSettings(
        training=config.training,
        privacy=config.privacy,
        cluster=config.cluster,
        tls=config.tls,
        values_per_block=ckks_params(config).values_per_block,
        max_clients=config.he.max_clients,
        max_shard_misses=config.security.max_shard_misses,
        shard_deadline_s=config.security.shard_deadline_s,
        client_eval=config.task.client_eval,
    )


def open_coordinator(
    config: FedPSConfig, state_dir: Path, *, task: Task | None = None, new_ledger: bool = False
) -> Coordinator:
    """The coordinator of ``config`` on its state folder ``state_dir`` (:meth:`Coordinator.open`).

    Running ``task`` (default: the configured one); ``new_ledger``: with a new privacy ledger.
    """
    from fedps.learning.tasks import load_task
    from server.coordinator.coordinator import Coordinator

    settings = coordinator_settings(config)
    return Coordinator.open(
        state_dir, settings, task=task or load_task(config), new_ledger=new_ledger
    )


def add_coordinator(
    server: grpc.Server, config: FedPSConfig, state_dir: Path, *, new_ledger: bool = False
) -> Coordinator:
    """Open the coordinator (:func:`open_coordinator`), register its servicer, start its round loop.

    The loop runs in a thread; ``new_ledger``: with a new privacy ledger.
    """
    from server.coordinator.coordinator_servicer import CoordinatorServicer

    coordinator = open_coordinator(config, state_dir, new_ledger=new_ledger)
    metrics = _metrics(config.metrics.coordinator, "coordinator", CoordinatorMetrics)
    if metrics is not None:
        metrics.version.set_function(lambda: coordinator.version)
        metrics.buffer_fill.set_function(coordinator.desk.reported_in_open_round)
        metrics.track_checkpoint(lambda: coordinator.last_checkpoint)
        coordinator.shard_misses.on_miss = metrics.track_shard_misses()
        metrics.watch(coordinator)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
    threading.Thread(target=coordinator.run, name="rounds", daemon=True).start()
    return coordinator


def serve_forever(
    role: str,
    config: FedPSConfig,
    *,
    index: int = 0,
    clear_detections: bool = False,
    new_ledger: bool = False,
    empty: bool = False,
) -> None:
    """Run one role until SIGINT, SIGTERM or SIGHUP, then stop gracefully.

    One instance per role: the role's state directory is locked
    (:class:`~fedps.storage.state_lock.StateLock`) before anything in it is read or written, and its
    port is not shared; a second instance raises instead of serving. ``clear_detections`` (key
    holder): forget the tampering detected so far; ``new_ledger`` (coordinator): start a new
    privacy ledger with a new run; ``empty`` (shard): set its old state aside and start empty.

    Raises
    ------
    StateLockedError
        Another process holds the role's state directory.
    AddressInUseError
        Another process listens on the role's listen address.
    """
    from fedps.provisioning import setup_tls  # before any channel or port exists

    setup_tls(config.tls, f"{role}-{index}" if role in ("shard", "party") else role)
    cluster = config.cluster
    try:  # [cluster.listen], else the address peers dial
        address = cluster.listen_address(role, index)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    name = cluster.shard_ids[index] if role == "shard" else role
    if role == "party":
        name = party_folder(cluster.state_dir, index).name
    label = name if role == "party" else role  # of its log lines
    with StateLock(cluster.state_dir / name):  # held until this process stops serving
        with loading():  # the role's modules and state (the coordinator's: torch, its task)
            server = create_server(_server_threads(role))
            try:
                bind(server, address, role=name)
            except BaseException:
                server.stop(None)  # an unstarted server left to the interpreter's exit can hang it
                raise
            coordinator: Coordinator | None = None
            party: PartyProcess | None = None
            if role == "party":
                party = add_party(server, config, index)
            elif role == "keyholder":
                keyholder = add_keyholder(server, config, cluster.state_dir / "keyholder")
                if clear_detections:
                    keyholder.clear_detections()
            elif role == "shard":
                add_shard(server, config, index, empty=empty)
            else:
                coordinator = add_coordinator(
                    server, config, cluster.state_dir / "coordinator", new_ledger=new_ledger
                )
        server.start()
        _log.info("%s listening on %s", label, address)
        stop = threading.Event()
        on_stop_signals(stop.set)  # the command ends by the signal once this returns
        if party is not None:
            _generate_keys(party, config, stop)
        stop.wait()
        if coordinator is not None:
            coordinator.stop()
        server.stop(grace=2.0).wait()
    _log.info("%s stopped", label)
