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
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["loading"]


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
