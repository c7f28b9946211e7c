"""A fedps process's start: its modules and data loaded without the garbage collector.

Importing torch and Opacus creates some 400,000 objects that live as long as the process, and
hardly any garbage; Python's cyclic garbage collector walks them all nonetheless, and again each
time they grow by a quarter: 1 to 1.5 s of CPU of the 5 s a client spends before its first
round. A role loads inside :func:`loading`, which pauses the collector and then freezes what the
block made: those objects are left out of every later collection, the one at the interpreter's
exit included (``fedps``'s entry point freezes the rest before it exits).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["loading", "root_logging_kept"]


@contextmanager
def loading() -> Iterator[None]:
    """Run the block (a role's imports and set-up) with the cyclic garbage collector paused.

    After the block, whatever happened in it, every object tracked so far is frozen
    (:func:`gc.freeze`: never collected again; fit for what lives as long as the process) and
    the collector runs again if it ran before.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@contextmanager
def root_logging_kept() -> Iterator[None]:
    """Run the block (an import) with the root logger's handlers kept as they were.

    Opacus calls :func:`logging.basicConfig` when it is imported: in a process whose application
    configures logging itself (a Flower app: Flower's logger has its own handler and propagates),
    every record would then be printed a second time, DEBUG ones included. While the block runs
    (an import can take seconds, while other threads log) the root logger has a handler that
    prints nothing, so that ``basicConfig`` does nothing; whatever handler the block added is
    removed after it.
    """
    root = logging.getLogger()
    handlers = list(root.handlers)
    if not handlers:
        root.addHandler(logging.NullHandler())
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
