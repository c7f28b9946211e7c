"""A whole fedps cluster on this machine, from a script or a notebook.

:class:`LocalCluster` starts the key holder, the shards and the coordinator as separate
processes exactly as ``fedps up`` does (:class:`~fedps.runtime.deployment.Deployment`: each role
is ``python -m fedps.cli ROLE`` with its log in ``STATE_DIR/logs``), so the user's script is
never re-run by a worker process and needs no ``if __name__ == "__main__"`` guard. Clients run
in the script's threads (:func:`fedps.run_client`, without TLS) or as processes
(:meth:`LocalCluster.start_client`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from crypto.files import private_directory
from crypto.tls import OPERATOR_NAME
from fedps.config import FedPSConfig
from fedps.errors import FedPSError
from fedps.provisioning import provision_cluster
from fedps.rpc.coordinator_stub import CoordinatorStub
from fedps.runtime.api_base import ConfigLike, as_config, enable_default_logging, use_identity
from fedps.runtime.deployment import Deployment, round_line, write_config
from fedps.runtime.history import History, read_history

if TYPE_CHECKING:
    import torch

__all__ = ["LocalCluster"]

_log = logging.getLogger("fedps")

#: The file a configuration given as an object is written to, in ``cluster.state_dir``.
CONFIG_FILE = "fedps.toml"


class LocalCluster:
    """Key holder, shards and coordinator as processes on this machine, for one run.

    Use it as a context manager: entering starts every server role and waits until each
    accepts connections; leaving stops every process it started (clients first, the key
    holder last), whatever happened inside::

        with fedps.LocalCluster("fedps.toml") as cluster:
            ...  # run the clients
            history = cluster.wait_finished()
            model = cluster.load_model()

    Certificates and enrolment tokens are created in ``tls.directory`` if there are none (as
    ``fedps up`` does), and this process speaks as the operator identity under mutual TLS.

    Parameters
    ----------
    config
        The cluster's configuration, or the path of its TOML file. A configuration object is
        written to ``cluster.state_dir/fedps.toml`` for the role processes to read (its task's
        project directory, ``[task] dir``, defaulting to the current directory).
    """

    def __init__(self, config: ConfigLike) -> None:
        enable_default_logging()
        self.config: FedPSConfig = as_config(config)
        if isinstance(config, FedPSConfig):
            self.config_path = self._write(config)
        else:
            self.config_path = Path(config)
        self._deployment: Deployment | None = None

    def _write(self, config: FedPSConfig) -> Path:
        """Write ``config`` for the role processes; returns the file."""
        if config.task.app and not config.task.dir:
            task = config.task.model_copy(update={"dir": os.getcwd()})
            self.config = config = config.model_copy(update={"task": task})
        path = config.cluster.state_dir / CONFIG_FILE
        private_directory(path.parent)
        write_config(config, path)
        return path

    @property
    def deployment(self) -> Deployment:
        """The role processes (raises if the cluster is not started)."""
        return self._require_started()

    def _require_started(self) -> Deployment:
        if self._deployment is None:
            raise FedPSError("the local cluster is not started (use it in a with block)")
        return self._deployment

    @property
    def log_dir(self) -> Path:
        """Where each process writes its log (``NAME.log``)."""
        return self.config.cluster.state_dir / "logs"

    def start(self) -> LocalCluster:
        """Start the key holder, the shards and the coordinator, and wait until each serves.

        Raises
        ------
        FedPSError
            A role stopped on an error (a port in use, a locked state folder, a bad task):
            the message is its one-line error. Every process started is stopped first.
        """
        if self._deployment is not None:
            raise FedPSError("the local cluster is started already")
        provision_cluster(self.config)
        use_identity(self.config, OPERATOR_NAME)
        self._deployment = Deployment(self.config_path, self.config)
        try:
            self._deployment.start_servers()
        except BaseException:
            self.stop()
            raise
        _log.info(
            "local cluster up: coordinator at %s, logs in %s",
            self.config.cluster.coordinator,
            self.log_dir,
        )
        if finished := self._deployment.finished_before():
            _log.warning("%s", finished)
        return self

    def start_client(
        self, index: int, *, data: str | os.PathLike[str] | None = None, threads: int = 1
    ) -> None:
        """Start edge client ``index`` as a process (``fedps client``), with its own data ``data``.

        It stops when training ends, or with the cluster.
        """
        args = ["client", "--index", str(index), "--threads", str(threads)]
        if data is not None:
            args += ["--data", str(Path(data).resolve())]
        self.deployment.start(f"client-{index}", *args)

    def wait_finished(self, timeout_s: float = 3600.0, *, poll_s: float = 0.5) -> History:
        """Wait until the coordinator reports training finished, logging one line per round (INFO).

        Returns the run's history.

        Raises
        ------
        FedPSError
            A process of the cluster exited with an error (the message names it, with its
            error or the end of its log), or ``timeout_s`` passed first.
        """
        deployment = self.deployment
        rounds = self.config.training.rounds
        until = time.monotonic() + timeout_s
        shown = 0
        coordinator = CoordinatorStub(self.config.cluster.coordinator)
        try:
            while True:
                deployment.check_alive()
                try:
                    status = coordinator.get_status(timeout_s=max(2.0, poll_s))
                except FedPSError:  # busy or restarting: ask again
                    status = None
                if status is not None:
                    for record in status.history[shown:]:
                        _log.info("%s", round_line(record, rounds))
                    shown = len(status.history)
                    if status.finished:
                        return History.of(status)
                if time.monotonic() > until:
                    raise FedPSError(f"training did not finish within {timeout_s:.0f} s")
                time.sleep(poll_s)
        finally:
            coordinator.close()

    def history(self) -> History:
        """The run's history so far (:func:`fedps.read_history`)."""
        return read_history(self.config)

    def load_model(self) -> torch.nn.Module:
        """The trained global model, its signature checked (:func:`fedps.load_model`)."""
        from fedps.runtime.export import pull_model  # torch: see export_model

        self._require_started()
        model, _ = pull_model(self.config)
        return model

    def export_model(self, path: str | os.PathLike[str]) -> Path:
        """Write the trained global model's ``state_dict`` (:func:`fedps.export_model`)."""
        # imported here: torch takes seconds of CPU to load, which a process that only runs
        # the servers (the dashboard until a run ends) never needs
        from fedps.runtime.export import export_model

        self._require_started()
        export_model(self.config, Path(path))
        return Path(path)

    def stop(self) -> None:
        """Stop every process the cluster started (clients, coordinator, shards, key holder last).

        Calling it again does nothing.
        """
        if self._deployment is not None:
            self._deployment.stop()
            self._deployment = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
