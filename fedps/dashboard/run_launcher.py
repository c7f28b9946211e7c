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
from fedps.errors import ConfigError, FedPSError
from fedps.runtime.local_cluster import LocalCluster

__all__ = ["FORM_FIELDS", "RunInProgressError", "RunLauncher"]

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
        Called when a run starts or ends, with its configuration (the dashboard follows it).
    """

    def __init__(
        self,
        config_path: Path | None,
        *,
        base_overrides: Mapping[str, Mapping[str, object]] | None = None,
        state_root: Path,
        local_clients: bool = True,
        on_change: Callable[[FedPSConfig], None] | None = None,
    ) -> None:
        self.config_path = config_path
        self.base_overrides = {k: dict(v) for k, v in (base_overrides or {}).items()}
        self.state_root = state_root
        self.local_clients = local_clients
        self.on_change = on_change
        self.busy: Callable[[], str] = lambda: ""
        """Another reason no run may start now (a run of another process in progress)."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._cluster: LocalCluster | None = None
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
            self._state = {"number": number, "running": True, "error": "", "message": "starting"}
            self._thread = threading.Thread(
                target=self._run, args=(config, number), name=f"fedps-run-{number}", daemon=True
            )
            self._thread.start()
        return config

    def _set(self, **values: Any) -> None:
        with self._lock:
            self._state = {**self._state, **values}

    def _run(self, config: FedPSConfig, number: int) -> None:
        cluster = LocalCluster(config)
        with self._lock:
            self._cluster = cluster
        if self.on_change is not None:
            self.on_change(config)
        try:
            cluster.start()
            if self.local_clients:
                for i in range(config.training.clients):
                    cluster.start_client(i)
                self._set(message="training")
            else:
                self._set(message="waiting for the deployment's clients to register")
            history = cluster.wait_finished(math.inf)  # a run takes what it takes; stop() ends it
            self._set(message=f"finished after {len(history.rounds)} rounds")
            self._stopping.wait(LINGER_S)
        except FedPSError as exc:
            if not self._stopping.is_set():
                _log.warning("run %d stopped: %s", number, exc)
                self._set(error=str(exc), message="failed")
        finally:
            cluster.stop()
            with self._lock:
                self._cluster = None
                self._state = {**self._state, "running": False}
            if self.on_change is not None:
                self.on_change(config)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the run in progress, if any (every process it started)."""
        self._stopping.set()
        with self._lock:
            cluster, thread = self._cluster, self._thread
        if cluster is not None:
            cluster.stop()
        if thread is not None:
            thread.join(timeout_s)

    def wait(self, poll_s: float = 0.2) -> None:
        """Block until no run is in progress."""
        while self.running:
            time.sleep(poll_s)
