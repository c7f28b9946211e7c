"""Quantities in words people read: bytes as ``812 B``, ``45.2 kB``, ``1.234 MB``.

Every size fedps prints (a client's round line, the demo's rounds and summary) goes through
:func:`size_text`, so a small model's push is never ``0.0 MB``.
"""

from __future__ import annotations

__all__ = ["size_text"]

_UNITS = ("kB", "MB", "GB", "TB")


def size_text(num_bytes: float) -> str:
    """``num_bytes`` in decimal units with at most 4 significant digits.

    Parameters
    ----------
    num_bytes
        A count of bytes (not negative).

    Returns
    -------
    str
        ``"0 B"``, ``"812 B"``, ``"45.2 kB"``, ``"1.234 MB"``, ``"12.5 GB"``.
    """
    whole = round(num_bytes)
    if whole < 1000:
        return f"{whole} B"
    value = float(whole)
    for unit in _UNITS:
        value /= 1000
        if float(f"{value:.4g}") < 1000 or unit == _UNITS[-1]:  # 999.95 kB is 1 MB
            return f"{value:.4g} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
