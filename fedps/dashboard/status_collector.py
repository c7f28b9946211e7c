"""One background thread that polls the cluster's roles and keeps the dashboard's snapshot.

Every browser reads the same snapshot: the roles are asked once per ``poll_s`` whatever the
number of viewers, each call with a short deadline, so a role that is down shows as down and
no page waits on it. The snapshot is JSON-ready (see :meth:`StatusCollector.snapshot`).

With a :class:`~fedps.dashboard.run_store.RunStore`, the progress of the run followed is kept
in its record there at each poll, and the snapshot carries that record (``record``): the page
draws a live run and a finished one from the same record, which stays once the cluster stops.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from fedps.config import FedPSConfig
from fedps.dashboard.run_store import RunStore, settings_view
from fedps.errors import FedPSError
from fedps.rpc.coordinator_messages import ClusterStatus, RoundSummary
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.rpc.keyholder_messages import ModelState
from fedps.rpc.keyholder_stub import KeyHolderStub
from fedps.rpc.shard_stub import ShardStub
from fedps.runtime.cluster_status import party_states

__all__ = ["Snapshot", "StatusCollector", "config_view"]

#: A JSON-ready snapshot of the cluster.
Snapshot = dict[str, Any]

_log = logging.getLogger("fedps")


def config_view(config: FedPSConfig) -> dict[str, Any]:
    """The configuration in force, JSON-ready.

    It holds no key: only addresses, paths (of the certificates and tokens), settings, and the key
    holder's public key pin.
    """
    view: dict[str, Any] = config.model_dump(mode="json")
    return view


def _round_view(record: RoundSummary) -> dict[str, Any]:
    return {
        "round": record.round,
        "version": record.version,
        "contributors": record.contributors,
        "accuracy": record.accuracy if record.accuracy >= 0 else None,
        "loss": record.loss if record.accuracy >= 0 else None,
        "max_epsilon": record.max_epsilon,
        "bytes_pushed": record.bytes_pushed,
        "seconds": record.seconds,
        "abandoned": record.abandoned,
        "metrics": dict(record.metrics),
    }


def _run_view(status: ClusterStatus) -> dict[str, Any]:
    """The run as the page shows it.

    Its ``max_epsilon`` (the page's tile) is the last round's row of ``history`` (the page's
    table), ``None`` before a round closed: the coordinator's running maximum also holds the
    spends that clients reported for the round still open, so the tile would run ahead of the
    table.
    """
    clients = sorted(set(status.client_epsilons) | set(status.client_rounds))
    spent, flagged = set(status.spent_clients), set(status.flagged_clients)
    history = [_round_view(r) for r in status.history]
    if status.finished and history:
        # a client reports its epsilon once it has pushed, so reports that came after the
        # last round closed are that round's: once no round is left, they count in its row
        last = history[-1]
        last["max_epsilon"] = max(last["max_epsilon"], status.max_epsilon)
    return {
        "run_id": status.run_id,
        "round": status.round,
        "version": status.version,
        "registered": status.registered,
        "finished": status.finished,
        "max_epsilon": history[-1]["max_epsilon"] if history else None,
        "delta": status.delta,
        "bytes_pushed": status.bytes_pushed,
        "noise": status.noise or "secure",
        "last_checkpoint_unix": status.last_checkpoint_unix,
        "history": history,
        "clients": [
            {
                "id": c,
                "epsilon": status.client_epsilons.get(c, 0.0),
                "rounds": status.client_rounds.get(c, 0),
                "noise_multiplier": status.client_noise_multipliers.get(c),
                # the client's own figure (epsilon is the server's), whether the server's
                # ledger stopped it, whether a privacy warning names it
                "reported_epsilon": status.client_reported_epsilons.get(c),
                "spent": c in spent,
                "warned": c in flagged,
            }
            for c in clients
        ],
        "privacy_warnings": list(status.privacy_warnings),
    }


class StatusCollector:
    """Polls the coordinator, the key holder and every shard of the configuration it follows.

    Parameters
    ----------
    config
        The cluster to watch (``None``: none yet); :meth:`follow` switches to another.
    poll_s
        Seconds between two polls.
    call_s
        Deadline of each call: a role that does not answer within it shows as down.
    extra
        Called at each poll for more JSON-ready entries of the snapshot (the run launcher's
        state).
    store
        Where the followed run's record is kept (``None``: nowhere; the snapshot has no
        record).
    """

    def __init__(
        self,
        config: FedPSConfig | None,
        *,
        poll_s: float = 1.0,
        call_s: float = 0.8,
        extra: Callable[[], dict[str, Any]] | None = None,
        store: RunStore | None = None,
    ) -> None:
        self.poll_s = poll_s
        self.call_s = call_s
        self.extra = extra
        self.store = store
        self._config = config
        self._record_id: str | None = None
        self._seen_id: str | None = None  # the coordinator's last run, without a record id
        self._lock = threading.Condition()
        self._snapshot: Snapshot = self._empty()
        self._serial = 0  # changes whenever the snapshot does
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> StatusCollector:
        """Start polling in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="fedps-dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (waits for the poll under way)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    def follow(self, config: FedPSConfig, record_id: str | None = None) -> None:
        """Watch the cluster of ``config`` from the next poll on.

        Its progress goes to the record ``record_id`` of the store (``None``: the record named
        after the coordinator's run id).
        """
        with self._lock:
            self._config = config
            self._record_id = record_id
            self._seen_id = None
        self.poke()

    def poke(self) -> None:
        """Poll again now (something changed: a run started or ended)."""
        with self._lock:
            self._lock.notify_all()

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> tuple[int, Snapshot]:
        """The latest snapshot and its serial number (higher: newer, different)."""
        with self._lock:
            return self._serial, self._snapshot

    def wait_change(self, serial: int, timeout_s: float) -> tuple[int, Snapshot]:
        """The snapshot once its serial differs from ``serial``, or after ``timeout_s``."""
        with self._lock:
            self._lock.wait_for(lambda: self._serial != serial or self.stopped, timeout_s)
            return self._serial, self._snapshot

    # ------------------------------------------------------------------ polling
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # the page keeps its last snapshot; the next poll tries again
                _log.exception("dashboard: polling the cluster failed")
            with self._lock:
                self._lock.wait(self.poll_s)

    def poll_once(self) -> Snapshot:
        """Ask every role once; store and return the new snapshot."""
        with self._lock:
            config = self._config
        snapshot = self._empty() if config is None else self._collect(config)
        if self.extra is not None:
            snapshot.update(self.extra())
        if self.store is not None:
            record_id = self._keep(config, snapshot["run"]) if config is not None else None
            snapshot["record"] = None if record_id is None else self.store.get(record_id)
            snapshot["runs_serial"] = self.store.serial
        with self._lock:
            # compare without the clock: a snapshot changes when what it shows does
            if json.dumps(snapshot, sort_keys=True) != json.dumps(self._snapshot, sort_keys=True):
                self._serial += 1
                self._snapshot = snapshot
                self._lock.notify_all()
        return snapshot

    def _keep(self, config: FedPSConfig, run: dict[str, Any] | None) -> str | None:
        """Keep ``run``'s progress in its record; returns the record's id (``None``: none).

        ``run``: the coordinator's view (``None``: it did not answer, the record stays as it
        was). A run the launcher did not start is named after its coordinator's run id.
        """
        assert self.store is not None
        with self._lock:
            record_id = self._record_id
        if run is None:
            return record_id or self._seen_id
        if record_id is None:
            try:
                record_id = self._seen_id = RunStore.check_id(run["run_id"])
            except ValueError:
                return None
        record = self.store.get(record_id) or {}
        if record.get("run_id") not in (None, "", run["run_id"]):
            return record_id  # another run answers at that address: not this record's
        now = time.time()
        fields: dict[str, Any] = {
            "run_id": run["run_id"],
            "run": run,
            "settings": settings_view(config),
            "state_dir": str(config.cluster.state_dir),
        }
        if not record:  # first seen: it started when its rounds did
            fields["started_unix"] = now - sum(r["seconds"] for r in run["history"])
        status = "finished" if run["finished"] else "training"
        ended = {"ended_unix": now} if run["finished"] else {}
        self.store.progress(record_id, status, ended, **fields)
        return record_id

    @staticmethod
    def _empty() -> Snapshot:
        return {
            "config": None,
            "coordinator": None,
            "run": None,
            "keyholder": None,
            "parties": [],
            "shards": [],
            "refusals": {},
            "tampering": {},
        }

    def _collect(self, config: FedPSConfig) -> Snapshot:
        cluster = config.cluster
        coordinator: dict[str, Any] = {"address": cluster.coordinator, "up": False, "error": ""}
        status = _ask(
            CoordinatorStub(cluster.coordinator),
            lambda c: c.get_status(timeout_s=self.call_s),
            coordinator,
        )
        run = None if status is None else {**_run_view(status), "rounds": config.training.rounds}
        keyholder: dict[str, Any] = {"address": cluster.keyholder, "up": False, "error": ""}
        state = _ask(
            KeyHolderStub(cluster.keyholder),
            lambda h: h.get_model_state(timeout_s=self.call_s),
            keyholder,
        )
        if state is not None:
            keyholder.update(
                version=state.version,
                last_round=state.last_round,
                detections=dict(state.detections),
                quarantined=list(state.quarantined),
                detection_reasons=dict(state.detection_reasons),
                shard_misses=dict(state.shard_misses),
                stalled=list(state.stalled),
            )
        shards = [self._shard(sid, address, state, status) for sid, address in _shards(config)]
        refusals: Counter[str] = Counter()
        for shard in shards:
            refusals.update(shard.get("refusals", {}))
        return {
            "config": config_view(config),
            "coordinator": coordinator,
            "run": run,
            "keyholder": keyholder,
            "parties": self._parties(config),
            "shards": shards,
            "refusals": dict(refusals),
            "tampering": {} if state is None else dict(state.detection_reasons),
        }

    def _parties(self, config: FedPSConfig) -> list[dict[str, Any]]:
        """Each key-holder party: its name, address, and whether it is up (or why not)."""
        states = party_states(config, timeout_s=self.call_s)
        return [
            {
                "id": f"party-{j}",
                "address": config.cluster.parties[j - 1],
                "up": not why,
                "error": why,
            }
            for j, why in sorted(states.items())
        ]

    def _shard(
        self, sid: str, address: str, state: ModelState | None, run: ClusterStatus | None
    ) -> dict[str, Any]:
        # missed deadlines: the key holder's fetches and the coordinator's open/close calls
        counted = [r for r in (state, run) if r is not None]
        view: dict[str, Any] = {
            "id": sid,
            "address": address,
            "up": False,
            "error": "",
            "detections": 0 if state is None else state.detections.get(sid, 0),
            "quarantined": state is not None and sid in state.quarantined,
            "misses": sum(r.shard_misses.get(sid, 0) for r in counted),
            "stalled": any(sid in r.stalled for r in counted),
        }
        status = _ask(ShardStub(sid, address), lambda c: c.get_status(timeout_s=self.call_s), view)
        if status is not None:
            view.update(
                version=status.version,
                blocks=status.blocks,
                pushes_accepted=status.pushes_accepted,
                pushes_refused=status.pushes_refused,
                refusals=dict(status.refusals),
            )
        return view


class _Client(Protocol):
    def close(self) -> None: ...


_C = TypeVar("_C", bound=_Client)
_R = TypeVar("_R")


def _ask(client: _C, call: Callable[[_C], _R], view: dict[str, Any]) -> _R | None:
    """``call(client)``, then close ``client``; None when the role did not answer.

    The role's ``view`` says whether it answered (``up``) or why not (``error``).
    """
    try:
        answer = call(client)
    except FedPSError as exc:
        view["error"] = str(exc)
        return None
    finally:
        client.close()
    view["up"] = True
    return answer


def _shards(config: FedPSConfig) -> list[tuple[str, str]]:
    cluster = config.cluster
    return list(zip(cluster.shard_ids, cluster.shards, strict=True))
