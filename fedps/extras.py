"""The optional dependencies (pip extras) of fedps, and the one line that names a missing one.

The core install (``pip install fedps``) is what a shard and a key holder need; training
(edge clients, the coordinator, the demo, the Python API) needs ``[client]``; the Flower
integration ``[flower]``, the web dashboard ``[ui]``, the experiment reports
``[experiments]``; ``[all]`` is everything (what the README installs).
"""

from __future__ import annotations

from fedps.errors import ConfigError

__all__ = ["EXTRA_OF", "MissingExtraError", "missing_extra"]

#: The extra that installs each optional top-level module.
EXTRA_OF = {
    "torch": "client",
    "opacus": "client",
    "sklearn": "client",
    "mlxtend": "client",
    "flwr": "flower",
    "starlette": "ui",
    "uvicorn": "ui",
    "matplotlib": "experiments",
}


class MissingExtraError(ConfigError):
    """What was asked for needs an optional dependency that is not installed."""


def missing_extra(exc: ModuleNotFoundError) -> MissingExtraError | None:
    """The error to show for ``exc`` when the missing module is one an extra installs.

    None for any other module: a real bug, left as it is.
    """
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return None
    return MissingExtraError(
        f"{module} is not installed: this needs fedps's [{extra}] extra "
        f"(pip install 'fedps[{extra}]', or 'fedps[all]' for everything)"
    )
