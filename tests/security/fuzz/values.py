"""Random values for the fuzz harness: integers and doubles at the edges, text with awkward
characters, and mutations of strings and bytes. Everything draws from the ``random.Random``
it is given, so a run is reproducible from its seed."""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Sequence

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1

_INTS: list[int] = [
    *range(0, 9),
    15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 1023, 1024, 2047, 2048, 2049,
    4095, 4096, 4809, 4810, 4811, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 2**32,
    2**53, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1,
]  # fmt: skip
_SNAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]
_NEG_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0]
_DOUBLES: list[float] = [
    math.nan, _SNAN, _NEG_NAN, math.inf, -math.inf, 0.0, -0.0, 5e-324, -5e-324,
    2.2250738585072014e-308, 1e-300, 1e-12, 0.5, 1.0, -1.0, 2.0, 1e6, 1000000.0000000001,
    1e6 + 1, -1e6, 1e9, 2.0**53, 2.0**63, 2.0**64, 1e300, 1.7976931348623157e308,
    -1.7976931348623157e308,
]  # fmt: skip
_TEXT_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/ "
    "\x00\n\t\"'\\%{}<>\u00e9\u4e2d\u200b\u202e\U0001f642\ufeff\uffff"
)


def rand_bytes(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little") if n > 0 else b""


def rand_len(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 100, 256, 1000, 4096])


def rand_int(rng: random.Random, bits: int, current: int = 0) -> int:
    r = rng.random()
    if r < 0.5:
        v = rng.choice(_INTS)
    elif r < 0.65:
        v = current + rng.choice([-2, -1, 1, 2])
    elif r < 0.75:
        v = current ^ (1 << rng.randrange(bits))
    elif r < 0.9:
        v = rng.randrange(1 << rng.randrange(1, bits + 1))  # log-uniform
    else:
        v = rng.getrandbits(bits)
    return v & ((1 << bits) - 1)


def rand_double(rng: random.Random, current: float = 0.0) -> float:
    r = rng.random()
    if r < 0.6:
        return rng.choice(_DOUBLES)
    if r < 0.7 and math.isfinite(current):
        return math.nextafter(current, rng.choice([math.inf, -math.inf]))
    if r < 0.8:
        return float(struct.unpack("<d", rand_bytes(rng, 8))[0])
    return rng.uniform(-1e9, 1e9)


def rand_text(rng: random.Random, n: int | None = None) -> str:
    n = rand_len(rng) if n is None else n
    return "".join(rng.choices(_TEXT_CHARS, k=min(n, 4096)))


def mutate_str(rng: random.Random, s: str, pool: Sequence[object] | None = None) -> str:
    choices: list[Callable[[], str]] = [
        lambda: "",
        lambda: "\x00",
        lambda: rand_text(rng),
        lambda: s + rand_text(rng, rng.randrange(1, 8)),
        lambda: s[:-1],
        lambda: s[1:],
        lambda: s.upper(),
        lambda: s + s,
        lambda: " " + s,
        lambda: "a" * rng.choice([256, 4096, 65536, 1 << 20]),
    ]
    if pool:
        choices += [lambda: str(rng.choice(pool))] * 3
    return rng.choice(choices)()


def flip_bits(rng: random.Random, b: bytes, count: int) -> bytes:
    if not b:
        return b
    out = bytearray(b)
    for _ in range(count):
        i = rng.randrange(len(out) * 8)
        out[i // 8] ^= 1 << (i % 8)
    return bytes(out)


def mutate_bytes(rng: random.Random, b: bytes, pool: Sequence[object] | None = None) -> bytes:
    n = len(b)
    ops: list[Callable[[], bytes]] = [
        lambda: b"",
        lambda: b[: rng.randrange(n)] if n else b"\x00",
        lambda: b[: -rng.choice([1, 2, 7, 8, 9])] if n else b,
        lambda: b + rand_bytes(rng, rng.choice([1, 7, 8, 9, 64])),
        lambda: b + b if n < (1 << 20) else b + b[:1024],
        lambda: flip_bits(rng, b, 1),
        lambda: flip_bits(rng, b, rng.randrange(2, 65)),
        lambda: rand_bytes(rng, n),
        lambda: b"\x00" * n,
        lambda: b"\xff" * n,
        lambda: rand_bytes(rng, rand_len(rng)),
        lambda: b[: (i := rng.randrange(n + 1))] + rand_bytes(rng, 1) + b[i:],
        lambda: (b[: (i := rng.randrange(n))] + b[i + 1 :]) if n else b"\x01",
    ]
    r = rng.random()
    if r < 0.004:
        return b"\xab" * (9 * 1024 * 1024)  # over the servers' 8 MiB limit
    if r < 0.014:
        return (b or b"\x5a") * (rng.randrange(1, 7 * 1024 * 1024) // max(1, n) + 1)
    if pool and r < 0.35:
        v = rng.choice(pool)
        return v if isinstance(v, bytes) else b
    return rng.choice(ops)()
