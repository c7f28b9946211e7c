"""Taking a serialised public context apart, for tests that change one of its parts."""

from __future__ import annotations

import struct

from crypto.public_context import _WIRE_MAGIC


def context_parts(serialized: bytes) -> list[bytes]:
    """Split a serialised public context into its length-prefixed parts (header, parameters,
    public key)."""
    assert serialized.startswith(_WIRE_MAGIC)
    parts, pos = [], len(_WIRE_MAGIC)
    while pos < len(serialized):
        (size,) = struct.unpack_from("<I", serialized, pos)
        parts.append(serialized[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return parts
