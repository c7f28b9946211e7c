"""fedps: a secure federated parameter server.

This package is the shared core every role uses: configuration, the wire protocol, the hash
ring, model <-> vector <-> blocks, datasets, partitioners, models and the CLI.

Its top level is the Python API for scripts and notebooks (docs/api.md): run a local cluster
(:class:`LocalCluster`) and clients (:func:`run_client`), read the run's history
(:func:`read_history`) and the trained model (:func:`load_model`, :func:`export_model`). The
API's names are imported on first use, so ``import fedps`` stays light.
"""

from __future__ import annotations

import os

# gRPC core reads its log level once, when grpc is first imported: only its errors, unless the
# user set GRPC_VERBOSITY (its INFO lines, such as "Got goaway", are noise to an operator).
# Every role imports fedps before grpc (server/__init__.py imports fedps first).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from fedps._layout import check_layout

check_layout()  # first: a user's server.py must not hide fedps's server/ package

import importlib  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from fedps.errors import FedPSError  # noqa: E402

if TYPE_CHECKING:
    from fedps.learning.tasks import ClientData, Task
    from fedps.rpc.coordinator_messages import RoundSummary
    from fedps.runtime.api import ClientSummary, export_model, load_model, run_client
    from fedps.runtime.history import History, read_history
    from fedps.runtime.local_cluster import LocalCluster

__all__ = [
    "ClientData",
    "ClientSummary",
    "FedPSError",
    "History",
    "LocalCluster",
    "RoundSummary",
    "Task",
    "export_model",
    "load_model",
    "read_history",
    "run_client",
]
__version__ = "0.1.0"

# Each name of the API and the module that defines it, imported on first use.
_LAZY = {
    "ClientData": "fedps.learning.tasks",
    "ClientSummary": "fedps.runtime.api",
    "History": "fedps.runtime.history",
    "LocalCluster": "fedps.runtime.local_cluster",
    "RoundSummary": "fedps.rpc.coordinator_messages",
    "Task": "fedps.learning.tasks",
    "export_model": "fedps.runtime.api",
    "load_model": "fedps.runtime.api",
    "read_history": "fedps.runtime.history",
    "run_client": "fedps.runtime.api",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as exc:  # e.g. torch, without the [client] extra
            from fedps.extras import missing_extra

            missing = missing_extra(exc)
            if missing is None:
                raise
            raise missing from exc
        return getattr(module, name)
    raise AttributeError(f"module 'fedps' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
