"""What every entry point of the Python API does first, with no client in sight.

Take the configuration or its file's path (:data:`ConfigLike`, :func:`as_config`), make fedps's
lines visible in a script (:func:`enable_default_logging`) and speak as a TLS identity
(:func:`use_identity`). :mod:`fedps.runtime.api` exports them; a local cluster and a run's
history take them from here, so that a process that only runs the servers (``fedps up``, the
dashboard) never imports the clients' training stack (Opacus, seconds of CPU at each start).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TypeAlias

from crypto.tls import TlsIdentity, tls_identity
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError
from fedps.provisioning import setup_tls

__all__ = ["ConfigLike", "as_config", "enable_default_logging", "use_identity"]

ConfigLike: TypeAlias = FedPSConfig | str | os.PathLike[str]
"""A configuration, or the path of its TOML file."""

_LOGGER = "fedps"


def as_config(config: ConfigLike) -> FedPSConfig:
    """``config`` itself, or the configuration loaded from the TOML file it names.

    Raises
    ------
    ConfigError
        The file is missing or invalid (the message names the field).
    """
    if isinstance(config, FedPSConfig):
        return config
    return load_config(Path(config))


class _UntilConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """Prints to stderr while the root logger has no handler.

    That is, while the application configured no logging; afterwards the record reaches the
    application's handlers by propagation.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def enable_default_logging() -> None:
    """Make fedps's INFO lines visible in a script without logging set up.

    See the module's docstring; calling it again changes nothing.
    """
    logger = logging.getLogger(_LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, _UntilConfigured) for h in logger.handlers):
        handler = _UntilConfigured(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def use_identity(config: FedPSConfig, name: str) -> None:
    """Speak as TLS identity ``name`` from now on, or plaintext when ``config`` turns TLS off.

    The identity is ``tls.name`` if set.

    Raises
    ------
    ConfigError
        Under mutual TLS, this process speaks as another identity already (TLS is
        process-wide).
    """
    tls = config.tls
    if tls.enabled:
        current = tls_identity()
        wanted = tls.name or name
        if current is not None and current != TlsIdentity.load(tls.directory, wanted):
            raise ConfigError(
                f"this process speaks mutual TLS as another identity, not {wanted!r} (TLS is "
                "process-wide): run each client in its own process (LocalCluster.start_client "
                "or `fedps client`), or set [tls] insecure = true for in-process clients"
            )
    setup_tls(tls, name)
