"""Start the next training run from the dashboard, one at a time, each in its own folder.

A run is the configuration the dashboard was started with, with the operator's training and
privacy settings over it, validated by :func:`fedps.config.load_config` (the same model as
every role's), and a fresh state folder ``STATE_DIR/runs/N``. Starting it does what
``fedps up`` does (:class:`~fedps.runtime.local_cluster.LocalCluster`: key holder, shards and
coordinator as processes on the configured addresses, logs in ``runs/N/logs``) and, with
local clients, starts ``training.clients`` edge clients as processes on this machine as
``fedps demo`` does. With remote clients nothing else is started: the clients of the
deployment register with the coordinator themselves (``fedps client`` on their machines) and
train in the new run.

With a :class:`~fedps.dashboard.run_store.RunStore`, each run has a record there named after its
number (``N``): its settings and state folder when it starts, then how it ended (``finished``,
``stopped`` by the operator, ``failed`` with the error), and the model it trained, exported to
``runs/N/model.pt`` once it has finished.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedps.config import FedPSConfig, load_config
from fedps.dashboard.run_store import MODEL_FILE, RunStore, settings_view
from fedps.errors import ConfigError, FedPSError
from fedps.runtime.local_cluster import LocalCluster

__all__ = ["FORM_FIELDS", "RunInProgressError", "RunLauncher", "RunNotInProgressError"]

_log = logging.getLogger("fedps")

#: The settings of the next run the form offers: (section, field).
FORM_FIELDS: tuple[tuple[str, str], ...] = (
    ("training", "rounds"),
    ("training", "clients"),
    ("training", "mode"),
    ("training", "lr"),
    ("training", "batch_size"),
    ("training", "local_epochs"),
    ("privacy", "target_epsilon"),
    ("privacy", "noise_multiplier"),
    ("privacy", "delta"),
    ("privacy", "max_grad_norm"),
)

#: Seconds a finished run's servers stay up, so that polling clients hear it and exit.
LINGER_S = 3.0


class RunInProgressError(FedPSError):
    """A run is in progress: the next one starts once it has finished."""


class RunNotInProgressError(FedPSError):
    """The run to stop is not in progress (it has ended, or another one runs)."""


def _overrides(form: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """The form's fields (``section.field``: value) as ``load_config`` overrides.

    An empty value of a field that may be unset (``privacy.noise_multiplier``) unsets it.

    Raises
    ------
    ConfigError
        A field the form does not offer (``fields`` names it).
    """
    allowed = {f"{s}.{f}" for s, f in FORM_FIELDS}
    unknown = [name for name in form if name not in allowed]
    if unknown:
        fields = {name: "not a setting the dashboard can change" for name in unknown}
        raise ConfigError(f"unknown fields: {', '.join(sorted(unknown))}", fields=fields)
    overrides: dict[str, dict[str, object]] = {}
    for name, value in form.items():
        section, field = name.split(".", 1)
        text = value.strip() if isinstance(value, str) else value
        overrides.setdefault(section, {})[field] = None if text == "" else text
    return overrides


class RunLauncher:
    """Starts training runs of ``base`` with the form's settings, one at a time.

    Parameters
    ----------
    config_path
        The configuration file every run starts from (``None``: the built-in defaults).
    base_overrides
        Sections merged over the file for every run (the command line's ``--insecure``).
    state_root
        Runs get ``state_root/runs/N`` as ``cluster.state_dir``.
    local_clients
        Start the run's clients as processes here (``False``: the deployment's own clients
        join the run).
    on_change
        Called when a run starts or ends, with its configuration and its number as a string
        (the dashboard follows it and keeps its progress in the record of that name).
    store
        Where each run's record is kept (``None``: nowhere).
    """

    def __init__(
        self,
        config_path: Path | None,
        *,
        base_overrides: Mapping[str, Mapping[str, object]] | None = None,
        state_root: Path,
        local_clients: bool = True,
        on_change: Callable[[FedPSConfig, str], None] | None = None,
        store: RunStore | None = None,
    ) -> None:
        self.config_path = config_path
        self.base_overrides = {k: dict(v) for k, v in (base_overrides or {}).items()}
        self.state_root = state_root
        self.local_clients = local_clients
        self.on_change = on_change
        self.store = store
        self.busy: Callable[[], str] = lambda: ""
        """Another reason no run may start now (a run of another process in progress)."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._cluster: LocalCluster | None = None
        self._serving = False  # the run's processes have all started
        self._stopping = threading.Event()
        self._state: dict[str, Any] = {"number": 0, "running": False, "error": "", "message": ""}

    # ------------------------------------------------------------------ the form
    def validate(self, form: Mapping[str, object], *, number: int = 0) -> FedPSConfig:
        """The configuration of the next run with ``form``'s settings.

        Raises
        ------
        ConfigError
            An invalid setting; ``fields`` holds one message per bad field.
        """
        overrides: dict[str, dict[str, object]] = {
            k: dict(v) for k, v in self.base_overrides.items()
        }
        for section, values in _overrides(form).items():
            overrides[section] = {**overrides.get(section, {}), **values}
        state_dir = self.state_root / "runs" / str(number or self._next_number())
        overrides["cluster"] = {**overrides.get("cluster", {}), "state_dir": str(state_dir)}
        return load_config(self.config_path, **overrides)

    def defaults(self) -> dict[str, object]:
        """The form's fields as the next run would have them without changes."""
        config = load_config(self.config_path, **self.base_overrides)
        dump = config.model_dump(mode="json")
        return {f"{s}.{f}": dump[s][f] for s, f in FORM_FIELDS}

    def _next_number(self) -> int:
        runs = self.state_root / "runs"
        taken = [int(p.name) for p in runs.glob("*") if p.name.isdigit()] if runs.is_dir() else []
        return max(taken, default=0) + 1

    # ------------------------------------------------------------------ runs
    @property
    def running(self) -> bool:
        """Whether a run started here has not ended yet."""
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def state(self) -> dict[str, Any]:
        """The launcher's part of the dashboard's snapshot."""
        with self._lock:
            return {"launch": {**self._state, "local_clients": self.local_clients}}

    def start(self, form: Mapping[str, object]) -> FedPSConfig:
        """Validate ``form`` and start the run in a thread; returns its configuration.

        Raises
        ------
        ConfigError
            An invalid setting (nothing started).
        RunInProgressError
            A run is in progress (nothing started).
        """
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RunInProgressError(
                    f"run {self._state['number']} is in progress; start the next one once it "
                    "has finished"
                )
            other = self.busy()
            if other:
                raise RunInProgressError(other)
            number = self._next_number()
            config = self.validate(form, number=number)
            config.cluster.state_dir.mkdir(parents=True)
            self._record(
                number,
                status="starting",
                started_unix=time.time(),
                state_dir=str(config.cluster.state_dir),
                settings=settings_view(config),
            )
            self._state = {"number": number, "running": True, "error": "", "message": "starting"}
            self._stopping = threading.Event()
            self._thread = threading.Thread(
                target=self._run,
                args=(config, number, self._stopping),
                name=f"fedps-run-{number}",
                daemon=True,
            )
            self._thread.start()
        return config

    def _record(self, number: int, **fields: Any) -> None:
        """Write ``fields`` into run ``number``'s record, if runs are recorded."""
        if self.store is not None:
            self.store.update(str(number), **fields)

    def _end(self, number: int, status: str, error: str = "") -> None:
        """Record that run ``number`` ended with ``status`` (unless it had ended already)."""
        if self.store is not None:
            ended = {"ended_unix": time.time(), "error": error}
            self.store.progress(str(number), status, ended)

    def _set(self, **values: Any) -> None:
        with self._lock:
            self._state = {**self._state, **values}

    def _run(self, config: FedPSConfig, number: int, stopping: threading.Event) -> None:
        cluster = LocalCluster(config)
        with self._lock:
            self._cluster = cluster
        if self.on_change is not None:
            self.on_change(config, str(number))
        try:
            cluster.start()
            if self.local_clients:
                for i in range(config.training.clients):
                    cluster.start_client(i)
                self._set(message="training")
            else:
                self._set(message="waiting for the deployment's clients to register")
            with self._lock:  # from now on stop() stops the processes itself
                self._serving = True
                if stopping.is_set():  # stopped while they started: stop() left them to us
                    raise FedPSError("stopped while starting")
            self._end_starting(number)
            history = cluster.wait_finished(math.inf)  # a run takes what it takes; stop() ends it
            self._set(message=f"finished after {len(history.rounds)} rounds")
            self._export(cluster, number)
            self._end(number, "finished")
            stopping.wait(LINGER_S)
        except FedPSError as exc:
            if stopping.is_set():
                self._set(message="stopped by the operator")
                self._end(number, "stopped")
            else:
                _log.warning("run %d stopped: %s", number, exc)
                self._set(error=str(exc), message="failed")
                self._end(number, "failed", str(exc))
        finally:
            cluster.stop()
            with self._lock:
                self._cluster = None
                self._serving = False
                self._state = {**self._state, "running": False}
            if self.on_change is not None:
                self.on_change(config, str(number))

    def _end_starting(self, number: int) -> None:
        """Record that run ``number``'s servers serve (it trains, unless it ended already)."""
        if self.store is not None:
            self.store.progress(str(number), "training", {})

    def _export(self, cluster: LocalCluster, number: int) -> None:
        """Export the model run ``number`` trained into its state folder (a WARNING if not)."""
        try:
            cluster.export_model(cluster.config.cluster.state_dir / MODEL_FILE)
        except FedPSError as exc:
            _log.warning("run %d: its model was not exported: %s", number, exc)
        else:
            self._record(number, model=MODEL_FILE)

    def stop_run(self, number: int) -> None:
        """Stop run ``number``, in progress here, with every process it started.

        Raises
        ------
        RunNotInProgressError
            Run ``number`` is not in progress here (it has ended, or was not started here).
        """
        with self._lock:
            current = self._state["number"]
            if current != number or self._thread is None or not self._thread.is_alive():
                raise RunNotInProgressError(f"run {number} is not in progress")
        self.stop()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the run in progress, if any (every process it started).

        A run still starting its processes stops them itself once they have started (stopping
        a cluster while it starts could leave the ones started last).
        """
        with self._lock:
            cluster = self._cluster if self._serving else None
            thread = self._thread
            self._stopping.set()
        if cluster is not None:
            cluster.stop()
        if thread is not None:
            thread.join(timeout_s)

    def wait(self, poll_s: float = 0.2) -> None:
        """Block until no run is in progress."""
        while self.running:
            time.sleep(poll_s)
