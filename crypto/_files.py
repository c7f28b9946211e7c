"""Private helper: write secrets (keys, tokens) readable by their owner only."""

from __future__ import annotations

from pathlib import Path

from fedps.atomic_file import write_atomic


def write_private(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` with mode 0600, atomically; never world-readable, not even
    briefly, whatever the umask. ``exclusive``: only if ``path`` does not exist
    (:class:`FileExistsError` otherwise)."""
    write_atomic(path, data, mode=0o600, exclusive=exclusive)
