"""The one way a plug-in registry gains an entry (Opacus's ``register_accountant``)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TypeVar

__all__ = ["add_entry"]

_T = TypeVar("_T")


def add_entry(registry: MutableMapping[str, _T], name: str, entry: _T, what: str) -> None:
    """Add ``entry`` to ``registry`` as ``name``.

    Parameters
    ----------
    registry
        The registry, a dict of names.
    name
        The new name: a non-empty string not yet registered.
    entry
        What the name stands for (a factory, a class, a loader).
    what
        What the registry holds, for the error (``"model"``, ``"partitioner"``).

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered.
    """
    if not name:
        raise ValueError(f"a {what} needs a non-empty name")
    if name in registry:
        raise ValueError(f"{what} {name!r} is already registered")
    registry[name] = entry
