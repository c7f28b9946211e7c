"""Bounded fuzzing of every fedps RPC and every deserialisation path, run as a subprocess.

Usage (from the repository root)::

    python -m tests.security.fuzz_target rpc N SEED [--only Service.Method] [...]
    python -m tests.security.fuzz_target deser N SEED [--only PATH] [...]

The last line on stdout is one JSON report; the exit status is 0 only if nothing went wrong.
A crash (a signal such as SIGSEGV) kills this process, which the parent test
(``tests/security/test_fuzz.py``) sees as a negative return code; ``faulthandler`` writes the
Python stack to stderr and the breadcrumb file (``--breadcrumb``) names the RPC or path and
the iteration that was running. Everything is derived from ``random.Random`` seeded with SEED
(per RPC or path), so a run is reproducible.

``rpc`` mode
    Starts a real cluster on loopback (key holder, one shard, coordinator), lets the
    coordinator initialise the model and registers two cohort clients (Ed25519 keys from
    :class:`crypto.signing.BlockSigner`), so that the coordinator opens round 1's commit
    phase at the key holder. Both clients commit their genuine signed updates and sketches
    (``GetChallenge``, ``Commit``), as :class:`clients.edge_client.EdgeClient` does; the
    coordinator then freezes the commitments and opens round 1 on the shard with them. One
    genuine block is pushed as the baseline, and round 2's commit phase is opened with one
    client committed and the other not, so that a commitment reaches the key holder's checks.
    Then N calls go to every RPC of the ``Shard``, ``KeyHolder`` and ``Coordinator`` services
    through real gRPC channels. Each call carries messages that are protobuf-parsed random
    wire data, structured mutations of a valid request (boundary and random numbers,
    NaN/inf, wrong lengths, truncated, extended and bit-flipped ciphertexts, coefficients and
    sketches >= q, foreign ids, roots, signatures and keys, updates signed over other
    fields, empty and long repeated fields), or (about 5%) bytes that do not parse at all.
    Per RPC an oracle mirrors the protocol's rules and classifies every request as *genuine*
    (must succeed: an idempotent repeat of what the cluster already holds), *legit* (success
    allowed), *malformed* (must be refused) or *skip* (valid and state-changing: never sent,
    so that the cluster state stays comparable). Outcomes:

    - refused with a status other than INTERNAL/UNKNOWN/DEADLINE_EXCEEDED/...: expected,
      unless the request is genuine ("refused_genuine");
    - INTERNAL ``Exception deserializing request!`` for bytes that do not parse: expected
      (gRPC's own refusal);
    - INTERNAL, UNKNOWN (an uncaught exception in a servicer), DEADLINE_EXCEEDED (a hang)
      or any other unexpected status: a bug ("unexpected");
    - OK for a malformed request, or a reply that differs from the cluster's state (a
      challenge seed, a commit set): a bug ("accepted_malformed").

    At the end the shard's accepted-block count, running sums, per-client entries (signed
    updates and the blocks added), rounds and their commitments, the published model on the
    shard, the key holder's model, version, last round, commit phases (cohorts, commitments,
    frozen or not), refused rounds and detections, and the coordinator's round and version
    are compared with the baseline, and every server must still answer. Rate limiting
    (``security.max_pushes_per_round``) is raised so that the fuzz reaches the deep
    validation paths instead of the per-client message limit.

``deser`` mode
    Feeds N generated inputs to each deserialisation path directly:
    ``PublicContext.from_bytes``, ``unpack_block``, ``unpack_blocks`` (encrypted and
    plaintext), ``CiphertextSum.add_packed``, ``bitpack.unpack``/``unpack_rows``,
    ``SecretContext.decrypt`` (arbitrary arrays, values >= q), the key holder's
    bytes -> unpack -> decrypt path, ``_seal_io.uncompressed_body``, ``SecretContext.load``
    on a directory with a fuzzed ``secret.key`` (mode 0600) and the signature helpers. Each
    must return a validated object or raise :class:`fedps.errors.FedPSError`; any other
    exception is a failure.

Budget
    Every RPC and path gets N calls (10,000 in the full test), each call with a 20 s deadline;
    an RPC stops early after ``--rpc-budget`` seconds, 3 deadline hits or 12 slow failures
    (and then counts as incomplete). Measured on 2 cores, 10,000 calls take 8-50 s per RPC
    (PushBlocks and OpenRound are the slowest: 23 KB ciphertexts; a public-context refetch
    per unknown context id), about 5 minutes for all 20 RPCs, and 1-40 s per
    deserialisation path (``SecretContext.load`` is the slowest), about 1.5 minutes in all.
    The data segment is capped (``FEDPS_FUZZ_MEMORY_MB``, default 4096) so that an unbounded
    allocation in a handler fails with MemoryError instead of taking the machine down.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import hashlib
import json
import logging
import math
import os
import random
import re
import resource
import shutil
import stat
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor

GENUINE, LEGIT, MALFORMED, SKIP = "genuine", "legit", "malformed", "skip"


def bad(reason: str) -> str:
    """A MALFORMED verdict with its reason."""
    return f"{MALFORMED}: {reason}"


DESERIALIZE_DETAILS = "Exception deserializing request!"
#: Refusals a malformed request may get. Anything else but OK is a bug.
REFUSAL_CODES = frozenset(
    {
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "FAILED_PRECONDITION",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "OUT_OF_RANGE",
        "ALREADY_EXISTS",
        "UNAUTHENTICATED",
    }
)
FUZZ_CLIENT_MAX_BYTES = 16 * 1024 * 1024  # above the servers' 8 MiB, to test their limit
MAX_EXAMPLES = 5
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

# ---------------------------------------------------------------------------- random values


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


def mutate_str(rng: random.Random, s: str, pool: list[Any] | None = None) -> str:
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


def mutate_bytes(rng: random.Random, b: bytes, pool: list[Any] | None = None) -> bytes:
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


# ---------------------------------------------------------------------------- protobuf wire

_WIRE_TYPE = {
    FieldDescriptor.TYPE_DOUBLE: 1,
    FieldDescriptor.TYPE_FLOAT: 5,
    FieldDescriptor.TYPE_INT64: 0,
    FieldDescriptor.TYPE_UINT64: 0,
    FieldDescriptor.TYPE_INT32: 0,
    FieldDescriptor.TYPE_FIXED64: 1,
    FieldDescriptor.TYPE_FIXED32: 5,
    FieldDescriptor.TYPE_BOOL: 0,
    FieldDescriptor.TYPE_STRING: 2,
    FieldDescriptor.TYPE_MESSAGE: 2,
    FieldDescriptor.TYPE_BYTES: 2,
    FieldDescriptor.TYPE_UINT32: 0,
    FieldDescriptor.TYPE_ENUM: 0,
    FieldDescriptor.TYPE_SFIXED32: 5,
    FieldDescriptor.TYPE_SFIXED64: 1,
    FieldDescriptor.TYPE_SINT32: 0,
    FieldDescriptor.TYPE_SINT64: 0,
}
_UNSIGNED = {
    FieldDescriptor.TYPE_UINT64: 64,
    FieldDescriptor.TYPE_FIXED64: 64,
    FieldDescriptor.TYPE_UINT32: 32,
    FieldDescriptor.TYPE_FIXED32: 32,
}
_SIGNED = {
    FieldDescriptor.TYPE_INT64: 64,
    FieldDescriptor.TYPE_SINT64: 64,
    FieldDescriptor.TYPE_SFIXED64: 64,
    FieldDescriptor.TYPE_INT32: 32,
    FieldDescriptor.TYPE_SINT32: 32,
    FieldDescriptor.TYPE_SFIXED32: 32,
    FieldDescriptor.TYPE_ENUM: 32,
}


def varint(n: int) -> bytes:
    n &= U64
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def random_wire(rng: random.Random, desc: Descriptor, depth: int = 0) -> bytes:
    """Random protobuf wire data, mostly shaped like ``desc`` (so that much of it parses)."""
    out = bytearray()
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4, 6, 10])):
        f: FieldDescriptor | None = None
        if desc.fields and rng.random() < 0.8:
            f = rng.choice(desc.fields)
            number, wt = f.number, _WIRE_TYPE[f.type]
            if f.is_repeated and wt != 2 and rng.random() < 0.5:
                wt = 2  # packed
            if rng.random() < 0.05:
                wt = rng.randrange(8)
        else:
            number = rng.choice([rng.randrange(1, 32), rng.randrange(1, 1 << 29), 0])
            wt = rng.choice([0, 0, 1, 2, 2, 5, 3, 4])
        out += varint((number << 3) | wt)
        if wt == 0:
            if rng.random() < 0.03:
                out += b"\xff" * rng.randrange(9, 12)  # over-long varint
            else:
                out += varint(rand_int(rng, 64))
        elif wt == 1:
            out += struct.pack("<d", rand_double(rng)) if rng.random() < 0.7 else rand_bytes(rng, 8)
        elif wt == 5:
            out += rand_bytes(rng, 4)
        elif wt == 2:
            if f is not None and f.type == FieldDescriptor.TYPE_MESSAGE and depth < 3:
                payload = random_wire(rng, _message_type(f), depth + 1)
            elif f is not None and f.type == FieldDescriptor.TYPE_STRING:
                text = rand_text(rng).encode("utf-8", "surrogatepass")
                payload = text if rng.random() < 0.9 else flip_bits(rng, text + b"\xc3", 1)
            elif f is not None and f.is_repeated and _WIRE_TYPE[f.type] != 2:
                payload = b"".join(varint(rand_int(rng, 64)) for _ in range(rng.randrange(8)))
            else:
                payload = rand_bytes(rng, rand_len(rng))
            size = len(payload)
            if rng.random() < 0.03:
                size = rng.choice([size + 1, max(0, size - 1), U32, rand_int(rng, 64)])
            out += varint(size) + payload
        # wire types 3, 4 (groups), 6, 7: no payload; mostly unparseable
    if out and rng.random() < 0.03:
        out = out[: rng.randrange(len(out))]
    return bytes(out)


class Mutator:
    """Structured mutations of a protobuf message, guided by its descriptor.

    ``pools`` maps a field name to meaningful alternative values (other parties' ids, keys,
    genuine ciphertexts of other blocks, near-valid corruptions); ``focus`` weights fields by
    name so that the deep paths (ciphertexts) get more of the mutations.
    """

    def __init__(
        self,
        rng: random.Random,
        pools: dict[str, list[Any]] | None = None,
        focus: dict[str, float] | None = None,
    ) -> None:
        self.rng = rng
        self.pools = pools or {}
        self.focus = focus or {}

    def mutate(self, msg: pb_message.Message, rounds: int) -> None:
        for _ in range(rounds):
            self._once(msg, 0)

    def _pick(self, fields: list[FieldDescriptor]) -> FieldDescriptor:
        weights = [self.focus.get(f.name, 1.0) for f in fields]
        return self.rng.choices(fields, weights)[0]

    def _once(self, msg: pb_message.Message, depth: int) -> None:
        rng = self.rng
        desc = cast(Descriptor, msg.DESCRIPTOR)
        if not desc.fields or rng.random() < 0.03:
            with contextlib.suppress(pb_message.DecodeError):
                msg.MergeFromString(random_wire(rng, desc, depth))
            return
        f = self._pick(list(desc.fields))
        if f.is_repeated:
            self._repeated(msg, f, depth)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            sub = getattr(msg, f.name)
            if rng.random() < 0.2:
                msg.ClearField(f.name)
            elif depth < 3:
                self._once(sub, depth + 1)
        else:
            self._set(msg, f, self.value(f, getattr(msg, f.name)))

    def _set(self, msg: pb_message.Message, f: FieldDescriptor, value: Any) -> None:
        with contextlib.suppress(ValueError, TypeError):
            setattr(msg, f.name, value)

    def value(self, f: FieldDescriptor, current: Any) -> Any:
        rng = self.rng
        pool = self.pools.get(f.name)
        t = f.type
        if t in _UNSIGNED:
            if pool and rng.random() < 0.3:
                return int(rng.choice(pool)) & ((1 << _UNSIGNED[t]) - 1)
            return rand_int(rng, _UNSIGNED[t], int(current))
        if t in _SIGNED:
            bits = _SIGNED[t]
            v = rand_int(rng, bits, int(current) & ((1 << bits) - 1))
            return v - (1 << bits) if v >> (bits - 1) else v
        if t == FieldDescriptor.TYPE_BOOL:
            return not current if rng.random() < 0.8 else bool(rng.getrandbits(1))
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            if pool and rng.random() < 0.3:
                return float(rng.choice(pool))
            return rand_double(rng, float(current))
        if t == FieldDescriptor.TYPE_STRING:
            return mutate_str(rng, current, pool)
        if t == FieldDescriptor.TYPE_BYTES:
            return mutate_bytes(rng, current, pool)
        return current

    def _repeated(self, msg: pb_message.Message, f: FieldDescriptor, depth: int) -> None:
        rng = self.rng
        c = getattr(msg, f.name)
        is_msg = f.type == FieldDescriptor.TYPE_MESSAGE
        op = rng.choice(
            ["clear", "drop", "dup", "elem", "elem", "elem", "elem", "add", "many", "reverse"]
        )
        n = len(c)
        if op == "clear":
            del c[:]
        elif op == "drop" and n:
            del c[rng.randrange(n)]
        elif op == "dup" and n:
            i = rng.randrange(n)
            if is_msg:
                c.add().CopyFrom(c[i])
            else:
                c.append(c[i])
        elif op == "elem" and n:
            i = rng.randrange(n)
            if is_msg:
                if depth < 3:
                    for _ in range(rng.choice([1, 1, 2])):
                        self._once(c[i], depth + 1)
            else:
                with contextlib.suppress(ValueError, TypeError):
                    c[i] = self.value(f, c[i])
        elif op in ("add", "elem"):
            self._add(c, f, depth)
        elif op == "many":
            budget = 4 * 1024 * 1024
            count = rng.choice([100, 1000, 10_000, 100_000])
            if is_msg:
                # A few distinct items (random, or copies of existing ones), repeated.
                template = message_factory.GetMessageClass(_message_type(f))
                distinct = []
                for _ in range(3):
                    item = template()
                    if n and rng.random() < 0.5:
                        item.CopyFrom(c[rng.randrange(n)])
                    with contextlib.suppress(pb_message.DecodeError):
                        item.MergeFromString(random_wire(rng, _message_type(f), 3))
                    distinct.append(item)
                size = max(item.ByteSize() for item in distinct) + 4
                count = min(count, budget // size)
                c.extend(distinct[i % 3] for i in range(count))
            else:
                value = self.value(f, c[0] if n else _default(f))
                size = len(value) if isinstance(value, bytes | str) else 8
                with contextlib.suppress(ValueError, TypeError):
                    c.extend([value] * min(count, budget // (size + 2)))
        elif op == "reverse" and n > 1:
            if is_msg:
                items = [copy.deepcopy(x) for x in c]
                del c[:]
                c.extend(reversed(items))
            else:
                values = list(c)
                del c[:]
                c.extend(reversed(values))
        else:
            self._add(c, f, depth)

    def _add(self, c: Any, f: FieldDescriptor, depth: int) -> None:
        rng = self.rng
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if len(c) and rng.random() < 0.5:
                item = c.add()
                item.CopyFrom(c[rng.randrange(len(c) - 1)] if len(c) > 1 else item)
                if depth < 3:
                    self._once(item, depth + 1)
            else:
                item = c.add()
                with contextlib.suppress(pb_message.DecodeError):
                    item.MergeFromString(random_wire(rng, _message_type(f), depth + 1))
        else:
            with contextlib.suppress(ValueError, TypeError):
                c.append(self.value(f, c[rng.randrange(len(c))] if len(c) else _default(f)))


def _message_type(f: FieldDescriptor) -> Descriptor:
    """The message type of a message field."""
    assert f.message_type is not None, f.full_name
    return f.message_type


def _default(f: FieldDescriptor) -> Any:
    if f.type == FieldDescriptor.TYPE_BYTES:
        return b""
    if f.type == FieldDescriptor.TYPE_STRING:
        return ""
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return 0.0
    if f.type == FieldDescriptor.TYPE_BOOL:
        return False
    return 0


def describe(item: Any, limit: int = 700) -> Any:
    """A short JSON-able description of a request (bytes and long strings abbreviated)."""

    def short(v: Any) -> Any:
        if isinstance(v, bytes):
            return f"<{len(v)} bytes {v[:12].hex()}{'...' if len(v) > 12 else ''}>"
        if isinstance(v, str):
            return v if len(v) <= 48 else f"{v[:40]!r}...<{len(v)} chars>"
        if isinstance(v, float) and not math.isfinite(v):
            return repr(v)
        if isinstance(v, pb_message.Message):
            return {f.name: short(x) for f, x in v.ListFields()}
        if isinstance(v, list | tuple) or (hasattr(v, "__len__") and hasattr(v, "__getitem__")):
            items = list(v)
            head = [short(x) for x in items[:3]]
            return head if len(items) <= 3 else [*head, f"...<{len(items)} items>"]
        return v

    if isinstance(item, list):
        out: Any = [describe(x, limit) for x in item[:4]]
        if len(item) > 4:
            out.append(f"...<{len(item)} messages>")
        return out
    if isinstance(item, bytes):
        return f"raw {short(item)}"
    text = json.dumps(short(item), default=str)
    return json.loads(text) if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------- RPC harness


Metadata = list[tuple[str, str]] | None
Judge = Callable[[list[pb_message.Message], Metadata], str]


@dataclass
class Case:
    items: list[Any]  # messages, or raw bytes that do not parse
    kind: str  # "mutated" | "random" | "raw" | "empty"
    allowed_ok: bool
    raw: bool
    metadata: Metadata = None
    verdict: str = LEGIT

    @property
    def required_ok(self) -> bool:
        """A genuine request: refusing it is a bug."""
        return self.verdict == GENUINE and not self.raw


@dataclass
class RpcSpec:
    service: str
    method: MethodDescriptor
    base: Callable[[random.Random], pb_message.Message]
    judge: Judge
    pools: dict[str, list[Any]] = field(default_factory=dict)
    metadata: Callable[[random.Random], Metadata] | None = None
    #: Cumulative shares of unparseable bytes, uniform random bytes and random wire data;
    #: the rest are mutations of a valid request.
    mix: tuple[float, float, float] = (0.05, 0.12, 0.45)
    #: A protocol-aware mutation used for half of the mutated requests, if given.
    custom: Callable[[random.Random], pb_message.Message] | None = None
    focus: dict[str, float] = field(default_factory=dict)
    concurrency: int = 4
    check_reply: Callable[[Any], str | None] | None = None

    @property
    def name(self) -> str:
        return f"{self.service}.{self.method.name}"


@dataclass
class RpcStats:
    target: int
    calls: int = 0
    messages: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    ok_legit: int = 0
    refused: int = 0
    raw_refused: int = 0
    skipped_valid: int = 0
    client_errors: int = 0
    accepted_malformed: int = 0
    refused_genuine: int = 0
    unexpected: int = 0
    hangs: int = 0
    slow: int = 0
    slow_unexpected: int = 0
    max_call_s: float = 0.0
    seconds: float = 0.0
    stopped: str = ""
    examples: dict[str, list[Any]] = field(default_factory=dict)
    refusals: Counter[str] = field(default_factory=Counter)
    accepted_reasons: Counter[str] = field(default_factory=Counter)

    def example(self, category: str, entry: Callable[[], dict[str, Any]]) -> None:
        """Keep the first few examples of ``category`` (``entry`` is built only for those)."""
        bucket = self.examples.setdefault(category, [])
        if len(bucket) < MAX_EXAMPLES:
            bucket.append(entry())

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "calls": self.calls,
            "messages": self.messages,
            "complete": self.calls >= self.target,
            "kinds": dict(self.kinds),
            "codes": dict(self.codes),
            "ok_legit": self.ok_legit,
            "refused": self.refused,
            "raw_refused": self.raw_refused,
            "skipped_valid": self.skipped_valid,
            "client_errors": self.client_errors,
            "accepted_malformed": self.accepted_malformed,
            "refused_genuine": self.refused_genuine,
            "unexpected": self.unexpected,
            "hangs": self.hangs,
            "slow": self.slow,
            "max_call_s": round(self.max_call_s, 3),
            "seconds": round(self.seconds, 2),
            "stopped": self.stopped,
            "top_refusals": dict(self.refusals.most_common(20)),
            "accepted_malformed_reasons": dict(self.accepted_reasons.most_common(12)),
            "examples": self.examples,
        }


class CaseGenerator:
    """Produces the requests of one RPC: random wire data, mutations, unparseable bytes."""

    def __init__(self, spec: RpcSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.cls = message_factory.GetMessageClass(spec.method.input_type)
        self.desc = spec.method.input_type
        self.mutator = Mutator(rng, spec.pools, spec.focus)
        self.skipped = 0

    def next(self) -> Case | None:
        for _ in range(100):
            items, kind = self._items()
            metadata = self.spec.metadata(self.rng) if self.spec.metadata else None
            raw = any(isinstance(i, bytes) for i in items)
            msgs = [i for i in items if not isinstance(i, bytes)]
            if not msgs and not self.spec.method.client_streaming:
                verdict = MALFORMED  # unparseable bytes only
            else:
                verdict = self.spec.judge(msgs, metadata)
            if verdict == SKIP:
                self.skipped += 1
                continue
            allowed = verdict in (GENUINE, LEGIT) and not raw
            return Case(items, kind, allowed, raw, metadata, verdict)
        return None

    def _items(self) -> tuple[list[Any], str]:
        rng = self.rng
        count = 1
        if self.spec.method.client_streaming:
            count = rng.choice([0, *[1] * 14, 2, 2, 3, 4])
        items: list[Any] = []
        kinds: list[str] = []
        for _ in range(count):
            r = rng.random()
            raw, uniform, wire = self.spec.mix
            if r < raw:
                items.append(self._raw())
                kinds.append("raw")
            elif r < uniform:
                items.append(self._uniform())
                kinds.append("random")
            elif r < wire:
                items.append(self._wire())
                kinds.append("random")
            else:
                items.append(self._mutated())
                kinds.append("mutated")
        kind = "empty" if not kinds else "raw" if "raw" in kinds else kinds[0]
        return items, kind

    def _parse(self, data: bytes) -> pb_message.Message | None:
        try:
            return self.cls.FromString(data)
        except Exception:  # DecodeError, or anything upb raises on garbage
            return None

    def _uniform(self) -> pb_message.Message:
        for _ in range(20):
            msg = self._parse(rand_bytes(self.rng, rand_len(self.rng) % 80))
            if msg is not None:
                return msg
        return self._wire()

    def _wire(self) -> pb_message.Message:
        for _ in range(20):
            msg = self._parse(random_wire(self.rng, self.desc))
            if msg is not None:
                return msg
        return self.cls()

    def _raw(self) -> bytes:
        for _ in range(50):
            data = (
                random_wire(self.rng, self.desc)
                if self.rng.random() < 0.6
                else rand_bytes(self.rng, 1 + rand_len(self.rng))
            )
            if self._parse(data) is None:
                return data
        return b"\x0a\xff\xff\x03"  # field 1, length 65535, truncated

    def _mutated(self) -> pb_message.Message:
        if self.spec.custom is not None and self.rng.random() < 0.5:
            return self.spec.custom(self.rng)
        msg = self.spec.base(self.rng)
        self.mutator.mutate(msg, self.rng.choice([1, 1, 1, 2, 2, 3, 5]))
        return msg


def _serialize(item: Any) -> bytes:
    return item if isinstance(item, bytes) else item.SerializeToString()


def make_callable(channel: grpc.Channel, spec: RpcSpec) -> Callable[..., Any]:
    method = spec.method
    path = f"/{method.containing_service.full_name}/{method.name}"
    response = message_factory.GetMessageClass(method.output_type).FromString
    if method.client_streaming and method.server_streaming:
        return channel.stream_stream(path, _serialize, response)
    if method.client_streaming:
        return channel.stream_unary(path, _serialize, response)
    if method.server_streaming:
        return channel.unary_stream(path, _serialize, response)
    return channel.unary_unary(path, _serialize, response)


def invoke(
    fn: Callable[..., Any], spec: RpcSpec, case: Case, timeout: float
) -> tuple[str, str, float, str | None]:
    """One call; returns (status code name, details, seconds, reply problem)."""
    start = time.monotonic()
    note = None
    try:
        request = iter(list(case.items)) if spec.method.client_streaming else case.items[0]
        if spec.method.server_streaming:
            reply: Any = list(fn(request, timeout=timeout, metadata=case.metadata))
        else:
            reply = fn(request, timeout=timeout, metadata=case.metadata)
        code, details = "OK", ""
        if spec.check_reply is not None:
            note = spec.check_reply(reply)
    except grpc.RpcError as exc:
        status = exc.code() if isinstance(exc, grpc.Call) else None
        code = status.name if status is not None else "UNKNOWN"
        details = (exc.details() if isinstance(exc, grpc.Call) else str(exc)) or ""
    except Exception as exc:  # the fuzz client itself failed (not the server)
        code, details = "CLIENT_ERROR", repr(exc)
    return code, details, time.monotonic() - start, note


def fuzz_rpc(
    spec: RpcSpec,
    fn: Callable[..., Any],
    n: int,
    rng: random.Random,
    *,
    budget_s: float,
    timeout: float,
    slow_s: float,
    max_hangs: int,
    crumb: Breadcrumb,
) -> RpcStats:
    stats = RpcStats(target=n)
    gen = CaseGenerator(spec, rng)
    start = time.monotonic()
    submitted = 0
    pending: dict[Future[tuple[str, str, float, str | None]], Case] = {}
    with ThreadPoolExecutor(spec.concurrency, thread_name_prefix="fuzz") as pool:
        while True:
            while not stats.stopped and submitted < n and len(pending) < 2 * spec.concurrency:
                case = gen.next()
                if case is None:
                    stats.stopped = "could not generate a malformed request"
                    break
                crumb.mark(f"rpc {spec.name} call {submitted}")
                pending[pool.submit(invoke, fn, spec, case, timeout)] = case
                submitted += 1
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                _record(stats, pending.pop(fut), *fut.result(), slow_s=slow_s)
            if not stats.stopped and time.monotonic() - start > budget_s:
                stats.stopped = f"time budget of {budget_s:g} s spent"
            if not stats.stopped and stats.hangs >= max_hangs:
                stats.stopped = f"{stats.hangs} calls hit the {timeout:g} s deadline"
            if not stats.stopped and stats.slow_unexpected >= 4 * max_hangs:
                stats.stopped = f"{stats.slow_unexpected} slow calls (> {slow_s:g} s) failed"
    stats.skipped_valid = gen.skipped
    stats.seconds = time.monotonic() - start
    return stats


def _record(
    stats: RpcStats,
    case: Case,
    code: str,
    details: str,
    seconds: float,
    note: str | None,
    *,
    slow_s: float,
) -> None:
    if code == "CLIENT_ERROR":
        stats.client_errors += 1
        stats.example(
            "client_error", lambda: {"details": details[:300], "request": describe(case.items)}
        )
        return
    stats.calls += 1
    stats.messages += len(case.items)
    stats.kinds[case.kind] += 1
    stats.codes[code] += 1
    stats.max_call_s = max(stats.max_call_s, seconds)

    def entry() -> dict[str, Any]:  # described only when kept as an example
        out = {
            "code": code,
            "details": details[:300],
            "seconds": round(seconds, 3),
            "request": describe(case.items),
        }
        if case.metadata:
            out["metadata"] = [(k, v[:16] + "...") for k, v in case.metadata]
        return out

    if seconds > slow_s:
        stats.slow += 1
        stats.example("slow", entry)
    if code != "OK" and case.required_ok:
        stats.refused_genuine += 1
        stats.example("refused_genuine", entry)
    if code == "OK":
        if case.allowed_ok and note is None:
            stats.ok_legit += 1
        else:
            stats.accepted_malformed += 1
            why = note or case.verdict
            stats.example("accepted_malformed", lambda: {**entry(), "why": why})
            stats.accepted_reasons[_normalize(why)] += 1
    elif code == "INTERNAL" and case.raw and details == DESERIALIZE_DETAILS:
        stats.raw_refused += 1
    elif code in REFUSAL_CODES:
        stats.refused += 1
        stats.refusals[f"{code}: {_normalize(details)}"] += 1
    else:
        stats.unexpected += 1
        if code == "DEADLINE_EXCEEDED":
            stats.hangs += 1
        elif seconds > slow_s:
            stats.slow_unexpected += 1
        stats.example(f"unexpected_{code}", entry)


def _normalize(text: str) -> str:
    """A refusal message without its numbers and quoted names (for a histogram)."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", text)
    return re.sub(r"\d+", "N", text)[:90]


class Breadcrumb:
    """The current RPC or path and iteration, in a file the parent reads after a crash."""

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if path else None

    def mark(self, text: str) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, text.encode()[:200].ljust(200), 0)


# ---------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class CommitPhaseView:
    """What the key holder's commit board holds for one round (the oracles' view of it)."""

    members: dict[str, bytes]  # client id -> signing key
    committed: frozenset[str]
    frozen: bool


class RpcFixture:
    """A running cluster in round 1, the genuine material to mutate, and one oracle per RPC."""

    def __init__(self, tmp: Path) -> None:
        from crypto import BlockEncryptor, bitpack
        from crypto.signing import BlockSigner, update_digest
        from fedps.proto import (
            common_pb2,
            coordinator_pb2,
            coordinator_pb2_grpc,
            keyholder_pb2,
            keyholder_pb2_grpc,
            shard_pb2,
            shard_pb2_grpc,
        )
        from fedps.transport import MAX_MESSAGE_BYTES, create_channel
        from tests.conftest import start_cluster

        self.max_message_bytes = MAX_MESSAGE_BYTES
        self.cluster = start_cluster(
            tmp,
            num_shards=1,
            coordinator=True,
            training={"clients": 2, "min_quorum": 2, "rounds": 1000, "deadline_s": 3600.0},
            security={"max_pushes_per_round": 1_000_000_000},
        )
        c = self.cluster
        self.shard, self.kh, self.coord = c.shards[0], c.keyholder, c.coordinator
        self.addresses = {
            "Shard": c.config.cluster.shards[0],
            "KeyHolder": c.config.cluster.keyholder,
            "Coordinator": c.config.cluster.coordinator,
        }
        _wait(lambda: self.kh.params is not None and self.shard._published, 120, "model")
        public = self.kh.keys.public
        self.public = public
        self.n = public.params.values_per_block
        self.num_params = self.coord.layout.num_params
        self.num_blocks = self.coord.layout.num_blocks
        coord_stub = coordinator_pb2_grpc.CoordinatorStub(
            create_channel(self.addresses["Coordinator"])
        )
        self.signers = {}
        self.ids = {}
        self.credentials: dict[str, bytes] = {}  # client id -> credential (if issued)
        self.credential_header = _credential_header()
        # One provisioned identity each (the cluster runs without TLS: enrolment tokens).
        self.tokens = _enrolment_tokens(c.config, {"a": 0, "b": 1, "c": 2})
        for name in ("a", "b", "c"):
            signer = BlockSigner()
            reply = coord_stub.Register(
                coordinator_pb2.RegisterRequest(
                    name=f"fuzz-{name}",
                    num_examples=100,
                    num_params=self.num_params,
                    signing_key=signer.public_key,
                    **_fields_of(
                        coordinator_pb2.RegisterRequest, enrolment_token=self.tokens.get(name, "")
                    ),
                )
            )
            self.signers[name], self.ids[name] = signer, reply.client_id
            credential = bytes(getattr(reply, "credential", b""))
            if credential:
                self.credentials[reply.client_id] = credential
            if name == "b":  # a and b are the cohort of round 1; c registers afterwards
                _wait(lambda: bool(self.kh.commits._phases), 60, "round 1's commit phase")
        a, b = self.ids["a"], self.ids["b"]
        self.cohort = {a, b}
        self.round = max(self.kh.commits._phases)
        phase = self.kh.commits._phases[self.round]
        assert set(phase.members) == self.cohort, phase.members
        self.version = phase.version
        self.run_id = self.coord.run_id
        self.context_id = self.kh.context_id
        self.cohort_keys = {
            cid: self.signers[n].public_key for n, cid in self.ids.items() if cid in self.cohort
        }
        self.cohort_members = [
            common_pb2.CohortMember(client_id=cid, signing_key=key)
            for cid, key in sorted(self.cohort_keys.items())
        ]

        # Genuine updates of both cohort clients (all blocks each), committed as a client
        # commits: the coordinator then freezes round 1's commitments and opens it on the shard.
        keyholder = keyholder_pb2_grpc.KeyHolderStub(create_channel(self.addresses["KeyHolder"]))
        encryptor = BlockEncryptor(public)
        self.genuine: dict[str, dict[str, Any]] = {}
        for name in ("a", "b"):
            packed, coeffs = encryptor.encrypt_with_coefficients(
                np.full(self.num_params, 0.01 if name == "a" else -0.02)
            )
            self.genuine[self.ids[name]] = {"blocks": dict(packed), "coeffs": coeffs}
        self.commit_requests: dict[tuple[int, str], Any] = {}  # (round, client) -> genuine
        self.seeds: dict[int, bytes] = {}
        for name in ("a", "b"):
            self._commit(keyholder, self.round, name, send=True)
        _wait(
            lambda: self.shard.round_is_open and self.shard.open_round_number == self.round,
            60,
            "round 1 to open on the shard",
        )
        state = self.shard._rounds[self.round]
        assert set(state.members) == set(state.commitments) == self.cohort, state.commitments
        self.pushes: dict[str, Any] = {}
        for cid in sorted(self.cohort):
            update = self.commit_requests[(self.round, cid)].update
            self.genuine[cid]["header"] = (
                self.round,
                self.version,
                self.context_id,
                update.weight,
                update.nonce,
                update.signature,
                tuple(update.roots),
            )
            self.pushes[cid] = shard_pb2.PushRequest(
                client_id=cid,
                round=self.round,
                version=update.version,
                weight=update.weight,
                context_id=self.context_id,
                blocks=[
                    shard_pb2.EncryptedBlock(block=b, ciphertext=x)
                    for b, x in self.genuine[cid]["blocks"].items()
                ],
                nonce=update.nonce,
                signature=update.signature,
                roots=update.roots,
            )
        # Baseline: client a's block 0, accepted for real; nothing else may ever be added.
        baseline = copy.deepcopy(self.pushes[a])
        del baseline.blocks[1:]
        shard_stub = shard_pb2_grpc.ShardStub(create_channel(self.addresses["Shard"]))
        pushed = shard_stub.PushBlocks(iter([baseline]))
        assert pushed.accepted == 1, pushed

        # Round 2's commit phase stays open with a committed and b not: b's commitments
        # reach every check of the key holder (a's, and round 1's, are settled already).
        self.open_round = self.round + 1
        self.open_requests = {
            r: keyholder_pb2.OpenCommitsRequest(
                round=r,
                version=self.version,
                run_id=self.run_id,
                members=self.cohort_members,
                context_id=self.context_id,
            )
            for r in (self.round, self.open_round)
        }
        keyholder.OpenCommits(self.open_requests[self.open_round])
        self._commit(keyholder, self.open_round, "a", send=True)
        self._commit(keyholder, self.open_round, "b", send=False)
        # What the key holder's commit board holds: the oracles' view of it.
        self.commit_phases = {
            self.round: CommitPhaseView(self.cohort_keys, frozenset({a, b}), frozen=True),
            self.open_round: CommitPhaseView(self.cohort_keys, frozenset({a}), frozen=False),
        }
        self.snapshot = self.take_snapshot()

        # Pools of meaningful alternative values for the mutator.
        q, bits = public.modulus, public.coeff_bits
        over_q = []
        for value, pos in [(q, 0), (q, -1), ((1 << bits) - 1, 7), (q + 12345, 1000)]:
            coeffs = self.genuine[a]["coeffs"][1].copy()
            coeffs[pos] = value
            over_q.append(bitpack.pack(coeffs, bits))
        zero_block = bitpack.pack(np.zeros(public.coeffs_per_block, dtype=np.uint64), bits)
        genuine_blocks = [x for g in self.genuine.values() for x in g["blocks"].values()]
        ciphertexts = [
            *genuine_blocks,
            *over_q,
            zero_block,
            b"\xff" * public.block_bytes,
            genuine_blocks[0][:-1],
            genuine_blocks[0] + b"\x00",
            genuine_blocks[0][:-8],
            genuine_blocks[0] + b"\x00" * 8,
            b"",
        ]
        other_keys = [rand_bytes(random.Random(i), 32) for i in range(2)]
        keys = [
            self.signers["a"].public_key,
            self.signers["b"].public_key,
            *other_keys,
            b"\x00" * 32,
            b"\xff" * 32,
            b"\x01" * 31,
            b"\x01" * 33,
            b"",
        ]
        commits = list(self.commit_requests.values())
        all_roots = [r for g in self.genuine.values() for r in g["header"][6]]
        common_ids = [self.ids["c"], "", "mallory", "client-0", "x" * 1000, "\x00"]
        self.cohort_pools: dict[str, list[Any]] = {
            "client_id": [a, b, a + "x", a.upper(), *common_ids],
            "context_id": [
                self.context_id,
                "plaintext-insecure",
                self.context_id[:-1],
                self.context_id + "0",
                self.context_id.upper(),
                "0" * 64,
                "",
            ],
            "run_id": [self.run_id, "", self.run_id + "x", self.run_id.upper()],
            "ciphertext": ciphertexts,
            "signature": [
                *(m.update.signature for m in commits),
                rand_bytes(random.Random(7), 64),
                b"\x00" * 64,
                commits[0].update.signature[:63],
                commits[0].update.signature + b"\x00",
                b"",
            ],
            "nonce": [*(m.update.nonce for m in commits), b"", b"\x00" * 16],
            "roots": [*all_roots, b"\x00" * 32, all_roots[0][:31], all_roots[0] + b"\x00", b""],
            "signing_key": keys,
            "round": [0, self.round, self.open_round, self.round + 2, self.round - 1, U64],
            "version": [0, self.version, self.version + 1, U64],
            "block": [0, 1, 2, self.num_blocks - 1, self.num_blocks, 2**32 - 1],
            "weight": [1.0, 0.999999, 1e6, 1e6 + 1, 0.0, -1.0],
            "num_params": [self.num_params, self.num_params - 1, self.num_params + 1, 1, 0],
            "num_blocks": [self.num_blocks, self.num_blocks + 1, self.num_blocks - 1, 0, 1],
            "values_per_block": [self.n, self.n - 1, self.n + 1, 0, 1, 2 * self.n],
        }
        values = [self.shard._values[b].astype("<f4").tobytes() for b in sorted(self.shard._values)]
        nan_block = np.full(self.n, np.nan, dtype="<f4").tobytes()
        inf_block = np.full(self.n, np.inf, dtype="<f4").tobytes()
        self.values_pool = [
            *values,
            nan_block,
            inf_block,
            values[0][:-4],
            values[0] + b"\x00" * 4,
            values[0] + b"\x00",
            values[0][:-1],
            b"",
        ]
        # Commitment material: sketches of every genuine commitment and near-valid
        # corruptions, and b's round-2 update signed (by b, unless said) over other fields.
        sketches = commits[0].sketches
        self.sketches_pool = [
            *(m.sketches for m in commits),
            sketches[:-8],
            sketches + b"\x00" * 8,
            sketches[:-1],
            sketches + sketches,
            np.full(len(sketches) // 8, q, dtype="<u8").tobytes(),
            np.full(len(sketches) // 8, U64, dtype="<u8").tobytes(),
            b"",
        ]
        update = self.commit_requests[(self.open_round, b)].update
        signed = dict(
            run_id=self.run_id,
            round_=self.open_round,
            client_id=b,
            context_id=self.context_id,
            weight=update.weight,
            nonce=bytes(update.nonce),
            roots=list(update.roots),
            version=update.version,
        )

        def forged(signer: str = "b", **change: Any) -> Any:
            fields = {**signed, **change}
            return common_pb2.SignedUpdate(
                client_id=b,
                weight=fields["weight"],
                nonce=fields["nonce"],
                signature=self.signers[signer].sign(update_digest(**fields)),
                roots=fields["roots"],
                version=fields["version"],
            )

        roots = list(update.roots)
        self.forged_updates = [
            forged(weight=2.0),
            forged(weight=0.5),
            forged(weight=0.0),
            forged(weight=-1.0),
            forged(weight=math.nan),
            forged(weight=math.inf),
            forged(version=self.version + 1),
            forged(version=(self.version - 1) & U64),
            forged(roots=roots[:-1]),
            forged(roots=[*roots, roots[0]]),
            forged(roots=[]),
            forged(run_id=self.run_id + "x"),
            forged(context_id="plaintext-insecure"),
            forged(round_=self.round),
            forged(client_id=a),
            forged("a"),
            forged("c"),
        ]
        self.outsider_update = copy.deepcopy(self.commit_requests[(self.round, a)].update)
        self.outsider_update.client_id = self.ids["c"]
        self.commit_pools = {**self.cohort_pools, "sketches": self.sketches_pool}
        self.common_pb2 = common_pb2

    def _commit(self, keyholder: Any, round_: int, name: str, *, send: bool) -> None:
        """Client ``name``'s genuine commitment to ``round_``, as a client makes it: its
        update signed for the round, and its blocks' sketches under the round's challenge;
        ``send``: commit it at the key holder."""
        from crypto.signing import sign_update
        from crypto.sketch import Challenge
        from fedps.proto import common_pb2, keyholder_pb2

        cid = self.ids[name]
        coeffs = self.genuine[cid]["coeffs"]
        nonce, signature, roots = sign_update(
            self.signers[name],
            coeffs,
            run_id=self.run_id,
            round_=round_,
            client_id=cid,
            context_id=self.context_id,
            weight=1.0,
            version=self.version,
        )
        reply = keyholder.GetChallenge(keyholder_pb2.ChallengeRequest(round=round_, client_id=cid))
        seed = self.seeds.setdefault(round_, reply.seed)
        assert reply.seed == seed and len(seed) == 32, "two cohort members got other challenges"
        challenge = Challenge(
            seed, modulus=self.public.modulus, coeffs_per_block=self.public.coeffs_per_block
        )
        request = keyholder_pb2.CommitRequest(
            round=round_,
            update=common_pb2.SignedUpdate(
                client_id=cid,
                weight=1.0,
                nonce=nonce,
                signature=signature,
                roots=roots,
                version=self.version,
            ),
            sketches=challenge.sketch(coeffs).astype("<u8").tobytes(),
        )
        self.commit_requests[(round_, cid)] = request
        if send:
            keyholder.Commit(request)

    # ------------------------------------------------------------------ state
    def take_snapshot(self) -> dict[str, Any]:
        shard, kh, coord = self.shard, self.kh, self.coord
        state = shard._rounds[self.round]
        return {
            "accepted": shard.stats["accepted"],
            "sums": {b: s.coefficients for b, s in state.sums.items()},
            "entries": copy.deepcopy(state.entries),
            "round_closed": state.closed,
            "commitments": dict(state.commitments),
            "shard_rounds": sorted(shard._rounds),
            "shard_version": shard.version,
            "shard_blocks": {b: v.copy() for b, v in shard._values.items()},
            "kh_params": None if kh.params is None else kh.params.copy(),
            "kh_version": kh.version,
            "kh_last_round": kh.last_round,
            "kh_commit_phases": {
                r: (
                    p.version,
                    p.run_id,
                    p.context_id,
                    dict(p.members),
                    p.frozen,
                    {
                        c: (x.update.SerializeToString(deterministic=True), x.sketches.tobytes())
                        for c, x in p.commitments.items()
                    },
                )
                for r, p in sorted(kh.commits._phases.items())
            },
            "kh_refused_rounds": sorted(kh._refused),
            "kh_detections": copy.deepcopy(kh.detections),
            "coord_round": coord.round,
            "coord_version": coord.version,
        }

    def compare(self, before: dict[str, Any]) -> list[str]:
        """Differences from a snapshot: each is a malformed request that changed state."""
        now = self.take_snapshot()
        problems = []
        if now["accepted"] != before["accepted"]:
            problems.append(
                f"shard accepted {now['accepted'] - before['accepted']} malformed block(s)"
            )
        if set(now["sums"]) != set(before["sums"]) or any(
            not np.array_equal(now["sums"][b], before["sums"][b]) for b in before["sums"]
        ):
            problems.append("the shard's running sums changed")
        for key in ("entries", "round_closed", "commitments", "shard_rounds", "shard_version"):
            if now[key] != before[key]:
                problems.append(f"shard {key} changed: {before[key]!r:.200} -> {now[key]!r:.200}")
        if set(now["shard_blocks"]) != set(before["shard_blocks"]) or any(
            not np.array_equal(now["shard_blocks"][b], before["shard_blocks"][b])
            for b in before["shard_blocks"]
        ):
            problems.append("the shard's published blocks changed")
        if now["kh_params"] is None or not np.array_equal(now["kh_params"], before["kh_params"]):
            problems.append("the key holder's model changed")
        for key in (
            "kh_version",
            "kh_last_round",
            "kh_commit_phases",
            "kh_refused_rounds",
            "kh_detections",
            "coord_round",
            "coord_version",
        ):
            if now[key] != before[key]:
                problems.append(f"{key} changed: {before[key]!r:.200} -> {now[key]!r:.200}")
        return problems

    def liveness(self) -> list[str]:
        """One ordinary call to every server; returns what failed."""
        from fedps.proto import (
            coordinator_pb2_grpc,
            keyholder_pb2,
            keyholder_pb2_grpc,
            shard_pb2_grpc,
        )
        from fedps.transport import create_channel

        if not hasattr(self, "_live_stubs"):
            self._live_stubs = (
                shard_pb2_grpc.ShardStub(create_channel(self.addresses["Shard"])),
                keyholder_pb2_grpc.KeyHolderStub(create_channel(self.addresses["KeyHolder"])),
                coordinator_pb2_grpc.CoordinatorStub(create_channel(self.addresses["Coordinator"])),
            )
        shard, keyholder, coordinator = self._live_stubs
        empty = self.common_pb2.Empty()
        close_commits = keyholder_pb2.CloseCommitsRequest(round=self.round)  # takes its lock
        checks: dict[str, Callable[[], Any]] = {
            "Shard.GetStatus": lambda: shard.GetStatus(empty, timeout=20),
            "KeyHolder.GetModelState": lambda: keyholder.GetModelState(empty, timeout=20),
            "KeyHolder.CloseCommits": lambda: keyholder.CloseCommits(close_commits, timeout=20),
            "Coordinator.GetStatus": lambda: coordinator.GetStatus(empty, timeout=20),
        }
        failed = []
        for name, check in checks.items():
            try:
                check()
            except grpc.RpcError as exc:
                code = exc.code().name if isinstance(exc, grpc.Call) else "?"
                failed.append(f"{name}: {code}")
        return failed

    def mutate_push_ciphertext(self, rng: random.Random) -> Any:
        """A genuine signed push (some of its blocks) with one ciphertext corrupted."""
        from crypto import bitpack

        cid = rng.choice(sorted(self.pushes))
        msg = copy.deepcopy(self.pushes[cid])
        if rng.random() < 0.5:
            keep = sorted(rng.sample(range(len(msg.blocks)), rng.randrange(1, len(msg.blocks) + 1)))
            kept = [copy.deepcopy(msg.blocks[i]) for i in keep]
            del msg.blocks[:]
            msg.blocks.extend(kept)
        target = rng.choice(msg.blocks)
        data, block = target.ciphertext, target.block
        q, bits = self.public.modulus, self.public.coeff_bits
        r = rng.random()
        if r < 0.35:
            coeffs = self.genuine[cid]["coeffs"][block].copy()
            for _ in range(rng.choice([1, 1, 2, 5])):
                i = rng.randrange(coeffs.size)
                coeffs[i] = rng.choice(
                    [q, q + 1, (1 << bits) - 1, rng.randrange(q, 1 << bits), rng.randrange(q)]
                )
            data = bitpack.pack(coeffs, bits)
        elif r < 0.55:
            data = flip_bits(rng, data, rng.choice([1, 1, 2, 3, 8, 64]))
        elif r < 0.7:
            others = [x for g in self.genuine.values() for x in g["blocks"].values() if x != data]
            data = rng.choice(others)
        elif r < 0.8:
            data = rng.choice([data[:-1], data[:-8], data + b"\x00", data + data[:8], data[1:]])
        else:
            data = mutate_bytes(rng, data, self.cohort_pools["ciphertext"])
        target.ciphertext = data
        if rng.random() < 0.15:
            Mutator(rng, self.cohort_pools).mutate(msg, 1)
        return msg

    def mutate_commit(self, rng: random.Random) -> Any:
        """A genuine commitment (mostly b's, still open in round 2) with its sketches, its
        signed update or its round replaced by a near-valid alternative."""
        keys = sorted(self.commit_requests)
        key = (self.open_round, self.ids["b"]) if rng.random() < 0.6 else rng.choice(keys)
        msg = copy.deepcopy(self.commit_requests[key])
        r = rng.random()
        if r < 0.4:
            msg.sketches = self.corrupt_sketches(rng, msg.sketches)
        elif r < 0.7:
            msg.update.CopyFrom(rng.choice(self.forged_updates))
        elif r < 0.8:
            msg.update.CopyFrom(self.commit_requests[rng.choice(keys)].update)
        elif r < 0.9:
            msg.round = rng.choice(self.cohort_pools["round"])
        else:
            Mutator(rng, self.commit_pools).mutate(msg, 1)
        if rng.random() < 0.1:
            Mutator(rng, self.commit_pools).mutate(msg, 1)
        return msg

    def corrupt_sketches(self, rng: random.Random, data: bytes) -> bytes:
        """Sketches with values >= q, the wrong length, or one value changed below q."""
        q = self.public.modulus
        values = np.frombuffer(data, dtype="<u8").copy()
        r = rng.random()
        if r < 0.35 and values.size:
            for _ in range(rng.choice([1, 1, 2, 5])):
                values[rng.randrange(values.size)] = rng.choice(
                    [q, q + 1, U64, 1 << 63, rng.randrange(q, 1 << 64)]
                )
            return values.tobytes()
        if r < 0.5 and values.size:  # well-formed, but not the client's sketch
            i = rng.randrange(values.size)
            values[i] = (int(values[i]) + rng.randrange(1, q)) % q
            return values.tobytes()
        if r < 0.7:
            return rng.choice(
                [data[:-8], data[:-1], data + b"\x00" * 8, data + data, data[8:], b""]
            )
        return mutate_bytes(rng, data, self.sketches_pool)

    def shard_open_request(self) -> Any:
        """Round 1's OpenRound as the coordinator sent it: the committed cohort and updates."""
        from fedps.proto import shard_pb2

        return shard_pb2.OpenRoundRequest(
            round=self.round,
            version=self.version,
            members=self.cohort_members,
            context_id=self.context_id,
            run_id=self.run_id,
            commitments=[self.commit_requests[(self.round, c)].update for c in sorted(self.cohort)],
        )

    def mutate_open_round(self, rng: random.Random) -> Any:
        """Round 1's OpenRound with a commitment replaced (another round's, a forged one, an
        outsider's), added or renamed, or a member dropped while its commitment stays."""
        msg = self.shard_open_request()
        updates = [
            *(self.commit_requests[k].update for k in sorted(self.commit_requests)),
            *self.forged_updates,
            self.outsider_update,
        ]
        r = rng.random()
        if r < 0.35:
            msg.commitments[rng.randrange(len(msg.commitments))].CopyFrom(rng.choice(updates))
        elif r < 0.5:
            msg.commitments.add().CopyFrom(rng.choice(updates))
        elif r < 0.65:
            del msg.members[rng.randrange(len(msg.members))]
        elif r < 0.8:
            item = msg.commitments[rng.randrange(len(msg.commitments))]
            item.client_id = mutate_str(rng, item.client_id, self.cohort_pools["client_id"])
        else:
            Mutator(rng, self.cohort_pools, {"commitments": 3.0}).mutate(msg, rng.choice([1, 2]))
        return msg

    # ------------------------------------------------------------------ oracles
    # Each returns GENUINE (must succeed), LEGIT (success allowed), SKIP (valid and
    # state-changing: not sent) or bad(reason) (malformed: must be refused).
    def push_valid(self, m: Any) -> bool:
        g = self.genuine.get(m.client_id)
        if g is None:
            return False
        header = (m.round, m.version, m.context_id, m.weight, m.nonce, m.signature, tuple(m.roots))
        if header != g["header"] or not m.blocks:
            return False
        ids = [b.block for b in m.blocks]
        if len(set(ids)) != len(ids):
            return False
        return all(g["blocks"].get(b.block) == b.ciphertext for b in m.blocks)

    def judge_push(self, msgs: list[Any], metadata: Metadata = None) -> str:
        if any(self.push_valid(m) for m in msgs):
            return SKIP  # would be accepted (or acknowledged as a duplicate)
        if not msgs:
            return LEGIT  # an empty stream adds nothing
        return bad("not a cohort member's genuine signed update and blocks")

    def judge_open_round(self, msgs: list[Any], metadata: Metadata = None) -> str:
        from crypto.signing import is_weak_key

        m = msgs[0]
        members = {x.client_id: bytes(x.signing_key) for x in m.members}
        if not members:
            return bad("empty cohort")
        if any(is_weak_key(k) for k in members.values()):
            return bad("a signing key is not a valid 32-byte Ed25519 key")
        commitments = {u.client_id: _signed_fields(u) for u in m.commitments}
        if any(c not in members for c in commitments):
            return bad("a commitment of no cohort member")
        if m.context_id != self.context_id:
            return bad("unknown context id")
        genuine = {
            c: _signed_fields(self.commit_requests[(self.round, c)].update) for c in self.cohort
        }
        if (m.round, m.version, m.run_id, members, commitments) == (
            self.round,
            self.version,
            self.run_id,
            self.cohort_keys,
            genuine,
        ):
            return GENUINE  # round 1 as it is open: a repeat changes nothing
        return SKIP

    def judge_known_round(self, msgs: list[Any], metadata: Metadata = None) -> str:
        return SKIP if msgs[0].round in self.shard._rounds else bad("unknown round")

    def judge_publish(self, msgs: list[Any], metadata: Metadata = None) -> str:
        if not msgs:
            return bad("empty stream")
        headers = {(m.version, m.num_blocks, m.values_per_block) for m in msgs}
        if len(headers) != 1:
            return bad("messages disagree on the header")
        version, num_blocks, per_block = headers.pop()
        blocks: dict[int, bytes] = {}
        for m in msgs:
            for b in m.blocks:
                if len(b.values) % 4:
                    return bad("values are not float32")
                blocks[b.block] = b.values
        # A model has at least one block of at least one value (the rest mirrors the shard).
        if num_blocks < 1 or per_block < 1:
            return bad(f"num_blocks={num_blocks}, values_per_block={per_block}: an empty model")
        # One shard owns every block (compare sizes first: num_blocks may be huge).
        if len(blocks) != num_blocks or set(blocks) != set(range(num_blocks)):
            return bad("blocks are not exactly the shard's blocks")
        for values in blocks.values():
            v = np.frombuffer(values, dtype="<f4")
            if v.shape != (per_block,) or not np.all(np.isfinite(v)):
                return bad("a block has the wrong size or non-finite values")
        if version < self.shard.version:
            return bad("older version")
        return SKIP

    def judge_initialize(self, msgs: list[Any], metadata: Metadata = None) -> str:
        num_params = force = 0
        blocks: dict[int, bytes] = {}
        for m in msgs:
            num_params, force = m.num_params, m.force
            for b in m.blocks:
                if len(b.values) % 4:
                    return bad("values are not float32")
                blocks[b.block] = b.values
        if num_params == 0:
            return bad("no parameters")
        num_blocks = -(-num_params // self.n)
        if num_blocks > len(blocks):
            return bad(f"{num_params} parameters need {num_blocks} blocks, got {len(blocks)}")
        for b in range(num_blocks):
            if b not in blocks or len(blocks[b]) != 4 * self.n:
                return bad(f"block {b} is missing or has the wrong size")
        return SKIP if force else LEGIT  # force replaces the model; otherwise a no-op

    def credential_ok(self, client_id: str, metadata: Metadata) -> bool:
        """Whether the call carries ``client_id``'s credential (when credentials exist)."""
        expected = self.credentials.get(client_id)
        if expected is None:
            return client_id in self.coord.clients and not self.credentials
        sent = next((v for k, v in metadata or [] if k == self.credential_header), "")
        try:
            return bool(expected) and bytes.fromhex(sent) == expected
        except ValueError:
            return False

    def token_pool(self) -> list[str]:
        """Valid tokens and near misses: another name with a valid MAC, a MAC of another
        name, a MAC under another key, case and whitespace changes."""
        if not self.tokens:
            return []
        valid = list(self.tokens.values())
        first, second = valid[0], valid[1 % len(valid)]
        name, _, mac = first.rpartition(".")
        other_mac = second.rpartition(".")[2]
        return [
            *valid,
            f"{name}.{other_mac}",
            f"client-7.{mac}",
            f"{name}.{'0' * 64}",
            f"{name}.{mac.upper()}",
            f"{name.upper()}.{mac}",
            f" {first}",
            f"{first}\n",
            f"{name}.{mac}.{mac}",
            f".{mac}",
            name,
        ]

    def judge_register(self, msgs: list[Any], metadata: Metadata = None) -> str:
        m = msgs[0]
        if len(m.signing_key) != 32 or m.num_params != self.num_params or m.num_examples < 1:
            return bad("bad key length, parameter count or example count")
        if not self.tokens:  # identities not provisioned by token: the old protocol
            known = self.coord.clients.get(m.client_id) if m.client_id else None
            if known is None:
                return LEGIT  # a new registration
            if known.signing_key != m.signing_key.hex():
                return bad("a known client id with another key")
            return LEGIT if self.credential_ok(m.client_id, metadata) else bad("wrong credential")
        if m.enrolment_token not in self.tokens.values():
            return bad("no valid enrolment token")
        # A valid re-registration replaces the identity's key and credential: never sent, so
        # the credentials the other RPCs' oracles use stay valid.
        return SKIP

    def judge_report(self, msgs: list[Any], metadata: Metadata = None) -> str:
        m = msgs[0]
        if m.client_id in self.cohort:
            return SKIP  # a cohort member's report would close round 1 early
        if m.client_id not in self.coord.clients:
            return bad("unknown client")
        if not self.credential_ok(m.client_id, metadata):
            return bad("wrong credential")
        if math.isnan(m.epsilon) or m.epsilon < 0:  # +inf is a client without DP noise
            return bad(f"epsilon {m.epsilon!r} is NaN or negative")
        if not (math.isfinite(m.delta) and 0 <= m.delta < 1):
            return bad(f"delta {m.delta!r} is not in [0, 1)")
        return LEGIT

    def judge_open_commits(self, msgs: list[Any], metadata: Metadata = None) -> str:
        from crypto.signing import is_weak_key

        m = msgs[0]
        members = {x.client_id: bytes(x.signing_key) for x in m.members}
        if m.context_id != self.context_id:
            return bad("the round names another key generation")
        if m.round <= self.kh.last_round:
            return bad("round already applied")
        if not members:
            return bad("empty cohort")
        if any(is_weak_key(k) for k in members.values()):
            return bad("a signing key is not a valid 32-byte Ed25519 key")
        phase = self.commit_phases.get(m.round)
        if phase is None:
            return SKIP  # a new commit phase (which may make the key holder forget round 1)
        if (m.version, m.run_id, members) == (self.version, self.run_id, phase.members):
            return GENUINE  # the phase as it is open: a repeat changes nothing
        if phase.frozen:
            return bad("the round's commitments are frozen: no reopening with another cohort")
        return SKIP  # reopens round 2 afresh, dropping a's commitment

    def judge_challenge(self, msgs: list[Any], metadata: Metadata = None) -> str:
        m = msgs[0]
        phase = self.commit_phases.get(m.round)
        if phase is None:
            return bad("the round has no commit phase")
        if m.client_id not in phase.members:
            return bad("not a member of the round's cohort")
        return GENUINE

    def judge_commit(self, msgs: list[Any], metadata: Metadata = None) -> str:
        m = msgs[0]
        phase = self.commit_phases.get(m.round)
        if phase is None:
            return bad("the round has no commit phase")
        client = m.update.client_id
        if client not in phase.members:
            return bad("not a member of the round's cohort")
        genuine = self.commit_requests[(m.round, client)]
        same = _signed_fields(m.update) == _signed_fields(genuine.update)
        if client in phase.committed:
            if not same or m.sketches != genuine.sketches:
                return bad("a second, different commitment of a client that committed")
            serialized = m.update.SerializeToString(deterministic=True)
            if serialized == genuine.update.SerializeToString(deterministic=True):
                return GENUINE  # a retry after a lost acknowledgement
            return LEGIT  # the same commitment with unknown fields added
        if phase.frozen:
            return bad("the round's commitments are frozen")
        if not same:
            return bad("not the update the client signed for this round")
        values = np.frombuffer(m.sketches, dtype="<u8") if len(m.sketches) % 8 == 0 else None
        if (
            values is None
            or len(m.sketches) != len(genuine.sketches)
            or int(values.max()) >= self.public.modulus
        ):
            return bad("sketches are not one value below q per sketch and block")
        # b's own update with well-formed sketches: accepted (only the aggregate's check can
        # tell sketches that do not match the ciphertexts)
        return SKIP

    def judge_close_commits(self, msgs: list[Any], metadata: Metadata = None) -> str:
        m = msgs[0]
        phase = self.commit_phases.get(m.round)
        if phase is None:
            return bad("the round has no commit phase")
        if m.freeze and not phase.frozen:
            return SKIP  # would freeze round 2
        return GENUINE

    def check_challenge(self, reply: Any) -> str | None:
        """A challenge must be the seed the cohort got for its round."""
        if self.seeds.get(reply.round) != reply.seed:
            return f"round {reply.round}: not the round's challenge seed"
        return None

    def check_commit_set(self, reply: Any) -> str | None:
        """A commit set must be one of the phases as the key holder holds them."""
        expected = set()
        for r, phase in self.commit_phases.items():
            committed = tuple(sorted(phase.committed))
            updates = tuple(
                self.commit_requests[(r, c)].update.SerializeToString(deterministic=True)
                for c in committed
            )
            expected.add((committed, phase.frozen, updates if phase.frozen else ()))
        got = (
            tuple(reply.client_ids),
            reply.frozen,
            tuple(u.SerializeToString(deterministic=True) for u in reply.updates),
        )
        return None if got in expected else f"a commit set of no phase: {describe(reply)}"

    # ------------------------------------------------------------------ specs
    def specs(self) -> list[RpcSpec]:
        from fedps.proto import (
            common_pb2,
            coordinator_pb2,
            keyholder_pb2,
            shard_pb2,
        )

        a = self.ids["a"]
        c = self.ids["c"]
        genuine_pushes = list(self.pushes.values())
        commit_keys = sorted(self.commit_requests)
        pools = self.cohort_pools
        signature_of = getattr(self.shard, "signature_of", lambda b: b"")
        layout_blocks = [
            common_pb2.ParameterBlock(
                block=b,
                version=self.kh.version,
                values=v,
                **_fields_of(common_pb2.ParameterBlock, signature=signature_of(b)),
            )
            for b, v in enumerate(self.values_pool[: self.num_blocks])
        ]

        def push_base(rng: random.Random) -> Any:
            return copy.deepcopy(rng.choice(genuine_pushes))

        def publish_base(rng: random.Random) -> Any:
            return shard_pb2.PublishRequest(
                version=self.shard.version,
                num_blocks=self.num_blocks,
                values_per_block=self.n,
                blocks=layout_blocks,
            )

        def initialize_base(rng: random.Random) -> Any:
            return keyholder_pb2.InitializeRequest(
                num_params=self.num_params,
                blocks=layout_blocks,
                force=rng.random() < 0.5,
                version=self.kh.version,
            )

        legit: Judge = lambda msgs, metadata: LEGIT  # noqa: E731
        malformed: Judge = lambda msgs, metadata: bad("no round has valid aggregates")  # noqa: E731
        value_pools = {**pools, "values": self.values_pool}
        coordinator_pools = {**pools, "client_id": [c, "", "mallory", "client-0", "x" * 1000]}

        header = self.credential_header

        def credential_metadata(rng: random.Random) -> Metadata:
            cred = self.credentials.get(c, b"").hex()
            r = rng.random()
            if r < 0.6 and cred:
                return [(header, cred)]
            if r < 0.7:
                return None
            if r < 0.8:
                return [(header, rand_bytes(rng, 32).hex())]
            if r < 0.85:
                return [(header, rng.choice(["zz", "0", "", "-"]))]
            if r < 0.9:
                return [(header, cred[:-2])]
            if r < 0.95:
                return [(header, cred.upper())]
            return [(header, rand_bytes(rng, 32).hex()), (header, cred)]

        def reject_accepted(reply: Any) -> str | None:
            return f"accepted={reply.accepted}" if reply.accepted else None

        table: dict[tuple[str, str], dict[str, Any]] = {
            ("Shard", "OpenRound"): {
                "base": lambda rng: self.shard_open_request(),
                "judge": self.judge_open_round,
                "custom": self.mutate_open_round,
                "focus": {"commitments": 2.0},
                "concurrency": 4,
            },
            ("Shard", "PushBlocks"): {
                "base": push_base,
                "judge": self.judge_push,
                "focus": {"blocks": 4.0, "roots": 1.5},
                "check_reply": reject_accepted,
                "mix": (0.03, 0.05, 0.2),  # mostly mutations: they reach the deep checks
                "custom": self.mutate_push_ciphertext,
            },
            ("Shard", "PullBlocks"): {
                "base": lambda rng: shard_pb2.PullRequest(min_version=self.shard.version),
                "judge": legit,
            },
            ("Shard", "CloseRound"): {
                "base": lambda rng: shard_pb2.CloseRoundRequest(round=self.round),
                "judge": self.judge_known_round,
            },
            ("Shard", "DiscardRound"): {
                "base": lambda rng: shard_pb2.CloseRoundRequest(round=self.round),
                "judge": self.judge_known_round,
            },
            ("Shard", "FetchAggregate"): {
                "base": lambda rng: shard_pb2.FetchAggregateRequest(round=self.round),
                "judge": legit,
            },
            ("Shard", "Publish"): {
                "base": publish_base,
                "judge": self.judge_publish,
                "pools": value_pools,
                "concurrency": 4,
            },
            ("Shard", "GetStatus"): {"base": lambda rng: common_pb2.Empty(), "judge": legit},
            ("KeyHolder", "GetPublicContext"): {
                "base": lambda rng: common_pb2.Empty(),
                "judge": legit,
            },
            ("KeyHolder", "InitializeModel"): {
                "base": initialize_base,
                "judge": self.judge_initialize,
                "pools": value_pools,
                "concurrency": 2,
            },
            ("KeyHolder", "ApplyRound"): {
                "base": lambda rng: keyholder_pb2.ApplyRoundRequest(
                    round=self.round,
                    version=self.version,
                    run_id=self.run_id,
                    members=self.cohort_members,
                ),
                "judge": malformed,  # no round has valid aggregates: nothing may be applied
                "concurrency": 4,
            },
            ("KeyHolder", "GetModelState"): {
                "base": lambda rng: common_pb2.Empty(),
                "judge": legit,
            },
            ("KeyHolder", "OpenCommits"): {
                "base": lambda rng: copy.deepcopy(rng.choice(list(self.open_requests.values()))),
                "judge": self.judge_open_commits,
            },
            ("KeyHolder", "GetChallenge"): {
                "base": lambda rng: keyholder_pb2.ChallengeRequest(
                    round=rng.choice(list(self.commit_phases)),
                    client_id=rng.choice(sorted(self.cohort)),
                ),
                "judge": self.judge_challenge,
                "check_reply": self.check_challenge,
            },
            ("KeyHolder", "Commit"): {
                "base": lambda rng: copy.deepcopy(self.commit_requests[rng.choice(commit_keys)]),
                "judge": self.judge_commit,
                "pools": self.commit_pools,
                "focus": {"update": 2.0, "sketches": 2.0},
                "mix": (0.03, 0.06, 0.25),  # mostly mutations: they reach the deep checks
                "custom": self.mutate_commit,
            },
            ("KeyHolder", "CloseCommits"): {
                "base": lambda rng: keyholder_pb2.CloseCommitsRequest(
                    round=rng.choice(list(self.commit_phases)), freeze=rng.random() < 0.5
                ),
                "judge": self.judge_close_commits,
                "check_reply": self.check_commit_set,
            },
            ("Coordinator", "Register"): {
                "base": lambda rng: coordinator_pb2.RegisterRequest(
                    name="fuzz",
                    num_examples=100,
                    num_params=self.num_params,
                    client_id=rng.choice(["", c]),
                    signing_key=self.signers["c"].public_key,
                    **_fields_of(
                        coordinator_pb2.RegisterRequest,
                        enrolment_token=self.tokens.get("c", ""),
                    ),
                ),
                "judge": self.judge_register,
                "metadata": credential_metadata,
                "pools": {
                    **coordinator_pools,
                    "enrolment_token": self.token_pool(),
                    "signing_key": [*pools["signing_key"], self.signers["c"].public_key],
                },
            },
            ("Coordinator", "GetTask"): {
                "base": lambda rng: _task_request(rng.choice([a, c])),
                "judge": legit,
                "metadata": credential_metadata,
                "pools": pools,
            },
            ("Coordinator", "ReportUpdate"): {
                "base": lambda rng: coordinator_pb2.UpdateReport(
                    client_id=c,
                    round=self.round,
                    weight=1.0,
                    epsilon=1.5,
                    delta=1e-5,
                    bytes_pushed=70_000,
                    budget_exhausted=False,
                ),
                "judge": self.judge_report,
                "metadata": credential_metadata,
                "pools": coordinator_pools,
            },
            ("Coordinator", "GetStatus"): {"base": lambda rng: common_pb2.Empty(), "judge": legit},
        }
        services = [
            (shard_pb2, "Shard"),
            (keyholder_pb2, "KeyHolder"),
            (coordinator_pb2, "Coordinator"),
        ]
        rpcs = {
            (service, method.name): method
            for module, service in services
            for method in module.DESCRIPTOR.services_by_name[service].methods
        }
        if set(rpcs) != set(table):  # an RPC added or removed: it needs (or lost) its oracle
            raise RuntimeError(
                f"RPCs without an oracle: {sorted(set(rpcs) - set(table))}; oracles of RPCs "
                f"that do not exist: {sorted(set(table) - set(rpcs))}"
            )
        specs = [
            RpcSpec(
                service,
                rpcs[(service, name)],
                entry["base"],
                entry["judge"],
                pools=entry.get("pools", pools),
                focus=entry.get("focus", {}),
                concurrency=entry.get("concurrency", 4),
                check_reply=entry.get("check_reply"),
                metadata=entry.get("metadata"),
                mix=entry.get("mix", (0.05, 0.12, 0.45)),
                custom=entry.get("custom"),
            )
            for (service, name), entry in table.items()
        ]
        # Pushes first (round 1 must be open), read-only calls next, state-changing ones last.
        order = [
            "Shard.PushBlocks",
            "Shard.GetStatus",
            "Shard.PullBlocks",
            "Shard.FetchAggregate",
            "KeyHolder.GetPublicContext",
            "KeyHolder.GetModelState",
            "KeyHolder.GetChallenge",
            "KeyHolder.CloseCommits",
            "Coordinator.Register",
            "Coordinator.GetTask",
            "Coordinator.ReportUpdate",
            "Coordinator.GetStatus",
            "KeyHolder.Commit",
            "KeyHolder.OpenCommits",
            "KeyHolder.ApplyRound",
            "KeyHolder.InitializeModel",
            "Shard.OpenRound",
            "Shard.CloseRound",
            "Shard.DiscardRound",
            "Shard.Publish",
        ]
        return sorted(specs, key=lambda s: order.index(s.name))


def _signed_fields(update: Any) -> tuple[Any, ...]:
    """What a client signs of a ``SignedUpdate`` (and its signature), unknown fields aside."""
    return (
        update.client_id,
        update.weight,
        bytes(update.nonce),
        bytes(update.signature),
        tuple(bytes(r) for r in update.roots),
        update.version,
    )


def _fields_of(cls: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments that name fields of message class ``cls``."""
    return {k: v for k, v in kwargs.items() if k in cls.DESCRIPTOR.fields_by_name}


def _credential_header() -> str:
    try:
        from server.coordinator.coordinator_servicer import CREDENTIAL_HEADER
    except ImportError:
        return "x-fedps-credential"
    return str(CREDENTIAL_HEADER)


def _enrolment_tokens(config: Any, names: dict[str, int]) -> dict[str, str]:
    """The enrolment token of each fuzz client (``client-N``), issued into the cluster's
    certificate directory; empty where registration takes no token."""
    try:
        from crypto.enrolment import issue_tokens, read_token
    except ImportError:
        return {}
    directory = config.tls.directory
    issue_tokens(directory, [f"client-{i}" for i in names.values()])
    tokens = {name: read_token(directory, f"client-{i}") for name, i in names.items()}
    return {name: token for name, token in tokens.items() if token}


def _task_request(client_id: str) -> Any:
    from fedps.proto import coordinator_pb2

    return coordinator_pb2.TaskRequest(client_id=client_id)


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_rpc_mode(args: argparse.Namespace, crumb: Breadcrumb) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="fedps-fuzz-"))
    started = time.monotonic()
    fixture = RpcFixture(tmp)
    setup_s = time.monotonic() - started
    channels = {
        name: grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", FUZZ_CLIENT_MAX_BYTES),
                ("grpc.max_receive_message_length", FUZZ_CLIENT_MAX_BYTES),
                ("grpc.enable_retries", 0),
            ],
        )
        for name, address in fixture.addresses.items()
    }
    results: dict[str, Any] = {}
    liveness: dict[str, list[str]] = {}
    after_push: list[str] = []
    for spec in fixture.specs():
        if args.only and spec.name not in args.only:
            continue
        rng = random.Random(f"{args.seed}:{spec.name}")
        _log(f"fuzzing {spec.name} ({args.n} calls)")
        stats = fuzz_rpc(
            spec,
            make_callable(channels[spec.service], spec),
            args.n,
            rng,
            budget_s=args.rpc_budget,
            timeout=args.call_timeout,
            slow_s=args.slow,
            max_hangs=args.max_hangs,
            crumb=crumb,
        )
        results[spec.name] = stats.as_json()
        _log(
            f"  {stats.calls} calls in {stats.seconds:.1f} s; codes {dict(stats.codes)}; "
            f"unexpected {stats.unexpected}; accepted malformed {stats.accepted_malformed}; "
            f"refused genuine {stats.refused_genuine}"
            + (f"; stopped: {stats.stopped}" if stats.stopped else "")
        )
        failed = fixture.liveness()
        if failed:
            liveness[spec.name] = failed
        if spec.name == "Shard.PushBlocks":
            after_push = fixture.compare(fixture.snapshot)
    state_changes = fixture.compare(fixture.snapshot)
    final_liveness = fixture.liveness()
    accepted_blocks = fixture.shard.stats["accepted"] - fixture.snapshot["accepted"]
    report = {
        "mode": "rpc",
        "n": args.n,
        "seed": args.seed,
        "setup_s": round(setup_s, 2),
        "seconds": round(time.monotonic() - started, 2),
        "params": {
            "poly_modulus_degree": fixture.n,
            "block_bytes": fixture.public.block_bytes,
            "num_params": fixture.num_params,
            "num_blocks": fixture.num_blocks,
        },
        "rpcs": results,
        "calls_per_rpc": {name: r["calls"] for name, r in results.items()},
        "unexpected": sum(r["unexpected"] for r in results.values()),
        "accepted_malformed": sum(r["accepted_malformed"] for r in results.values()),
        "refused_genuine": sum(r["refused_genuine"] for r in results.values()),
        "accepted_malformed_blocks": accepted_blocks,
        "state_changes_after_push": after_push,
        "state_changes": state_changes,
        "liveness_failures": {**liveness, **({"final": final_liveness} if final_liveness else {})},
        "incomplete": sorted(n for n, r in results.items() if not r["complete"]),
    }
    report["ok"] = not (
        report["unexpected"]
        or report["accepted_malformed"]
        or report["refused_genuine"]
        or accepted_blocks
        or after_push
        or state_changes
        or report["liveness_failures"]
        or report["incomplete"]
    )
    # Stop the round loop only: stopping the servers waits for handlers that may hang (the
    # process exits with os._exit right after the report).
    with contextlib.suppress(Exception):
        fixture.coord.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    return report


# ---------------------------------------------------------------------------- deser mode


@dataclass
class PathSpec:
    name: str
    generate: Callable[[random.Random], Any]
    call: Callable[[Any], Any]
    check: Callable[[Any, Any], str | None]  # (input, result) -> problem or None


class DeserFixture:
    """Genuine serialised objects of two key generations, and one spec per path."""

    def __init__(self, tmp: Path) -> None:
        from crypto import BlockEncryptor, CkksParams, PlainContext, SecretContext, _seal_io
        from crypto.public_context import _WIRE_MAGIC

        self.tmp = tmp
        self.secret = SecretContext.generate(CkksParams(2048, 46, 37))
        self.other = SecretContext.generate(CkksParams(4096, 60, 40))
        self.public = self.secret.public
        self.plain = PlainContext(self.public.params.values_per_block)
        self.magic = _WIRE_MAGIC
        self.ctx_bytes = self.public.serialize()
        self.other_ctx = self.other.public.serialize()
        self.ctx_parts = self._split(self.ctx_bytes)
        self.other_parts = self._split(self.other_ctx)
        self.secret_key = _seal_io.save_bytes(self.secret._secret_key)
        self.other_key = _seal_io.save_bytes(self.other._secret_key)
        enc = BlockEncryptor(self.public)
        packed, coeffs = enc.encrypt_with_coefficients(np.linspace(-1, 1, 3 * 2048))
        self.blocks = [packed[b] for b in sorted(packed)]
        self.coeffs = coeffs
        self.q = self.public.modulus
        self.bits = self.public.coeff_bits
        self.count = self.public.coeffs_per_block
        self.key_dir = tmp / "keys"
        self.secret.save(self.key_dir)
        self.key_path = self.key_dir / "secret.key"
        self.ctx_path = self.key_dir / "public.ctx"

    @staticmethod
    def _split(data: bytes) -> list[bytes]:
        from crypto.public_context import _WIRE_MAGIC

        parts, pos = [], len(_WIRE_MAGIC)
        while pos < len(data):
            (size,) = struct.unpack_from("<I", data, pos)
            parts.append(data[pos + 4 : pos + 4 + size])
            pos += 4 + size
        return parts

    # ------------------------------------------------------------------ inputs
    def seal_object(self, rng: random.Random, data: bytes) -> bytes:
        """Mutate a SEAL-serialised object: header fields, compressed body, or raw bytes."""
        import zstandard

        magic, hsize, major, minor, mode, res, size = struct.unpack_from("<HBBBBHQ", data)
        body = data[16:]
        r = rng.random()
        if r < 0.35:
            fields = [magic, hsize, major, minor, mode, res, size]
            i = rng.randrange(7)
            widths = [16, 8, 8, 8, 8, 16, 64]
            fields[i] = rng.choice(
                [
                    rand_int(rng, widths[i], fields[i]),
                    {0: 0xA15E, 4: rng.choice([0, 1, 2, 3, 255])}.get(i, fields[i] + 1),
                ]
            ) & ((1 << widths[i]) - 1)
            return struct.pack("<HBBBBHQ", *fields) + body
        if r < 0.6:
            try:
                plain = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 26)
            except zstandard.ZstdError:
                plain = body
            new_plain = mutate_bytes(rng, plain) if rng.random() < 0.8 else plain
            level = rng.choice([1, 3])
            comp = zstandard.ZstdCompressor(
                level=level, write_content_size=rng.random() < 0.7
            ).compress(new_plain)
            if rng.random() < 0.4:
                comp = mutate_bytes(rng, comp)
            mode_value = 2 if rng.random() < 0.85 else 0
            if mode_value == 0:
                comp = new_plain
            total = 16 + len(comp)
            if rng.random() < 0.1:
                total = rand_int(rng, 64, total)
            return (
                struct.pack("<HBBBBHQ", magic, hsize, major, minor, mode_value, res, total) + comp
            )
        return mutate_bytes(rng, data)

    def gen_context(self, rng: random.Random) -> bytes:
        parts = list(self.ctx_parts)
        r = rng.random()
        if r < 0.2:
            return mutate_bytes(rng, self.ctx_bytes)
        if r < 0.35:
            n = rng.choice([0, 1, 1024, 2048, 4096, 8192, 16384, 32768, U32])
            qb = rng.choice([0, 19, 20, 45, 46, 54, 55, 60, 61, 109, U32])
            sb = rng.choice([0, 9, 10, 37, 40, 42, 56, U32])
            parts[0] = struct.pack("<III", n, qb, sb)
        elif r < 0.45:
            i = rng.randrange(3)
            parts[i] = self.other_parts[i]
        elif r < 0.85:
            i = rng.choice([1, 2, 2])
            parts[i] = self.seal_object(rng, parts[i])
        else:
            parts[rng.randrange(3)] = mutate_bytes(rng, parts[rng.randrange(3)])
        out = bytearray(self.magic if rng.random() > 0.02 else mutate_bytes(rng, self.magic))
        for p in parts:
            size = len(p) if rng.random() > 0.05 else rand_int(rng, 32, len(p))
            out += struct.pack("<I", size) + p
        if rng.random() < 0.03:
            out += rand_bytes(rng, rng.randrange(1, 9))
        return bytes(out)

    def gen_block(self, rng: random.Random) -> bytes:
        from crypto import bitpack

        r = rng.random()
        base = rng.choice(self.blocks)
        if r < 0.25:
            return mutate_bytes(rng, base)
        if r < 0.45:
            return flip_bits(rng, base, rng.choice([1, 1, 2, 8, 100]))
        if r < 0.6:
            coeffs = self.coeffs[rng.randrange(len(self.coeffs))].copy()
            for _ in range(rng.choice([1, 1, 3])):
                coeffs[rng.randrange(len(coeffs))] = rng.choice(
                    [self.q, self.q - 1, self.q + 1, (1 << self.bits) - 1, 0]
                )
            return bitpack.pack(coeffs, self.bits)
        if r < 0.8:
            return rand_bytes(rng, self.public.block_bytes)
        if r < 0.9:
            return rng.choice([b"\x00", b"\xff"]) * self.public.block_bytes
        return rand_bytes(
            rng, rng.choice([0, 1, self.public.block_bytes + rng.choice([-8, -1, 1, 8])])
        )

    def gen_plain_block(self, rng: random.Random) -> bytes:
        n = self.plain.values_per_block
        r = rng.random()
        if r < 0.4:
            return np.random.default_rng(rng.getrandbits(32)).standard_normal(n).tobytes()
        if r < 0.7:
            return rand_bytes(rng, 8 * n)  # may hold NaN or inf
        return rand_bytes(rng, rng.choice([0, 8 * n - 1, 8 * n + 8, rand_len(rng)]))

    def gen_coeff_array(self, rng: random.Random) -> np.ndarray:
        gen = np.random.default_rng(rng.getrandbits(32))
        n = self.count
        shape = rng.choice([(n,)] * 12 + [(n - 1,), (n + 1,), (0,), (2, n // 2), (1, n), (2 * n,)])
        r = rng.random()
        if r < 0.45:
            arr = gen.integers(0, self.q, size=shape, dtype=np.uint64)
        elif r < 0.65:
            arr = gen.integers(0, 1 << 63, size=shape, dtype=np.uint64) * np.uint64(2)
        else:
            base = self.coeffs[rng.randrange(len(self.coeffs))]
            arr = np.resize(base, shape).astype(np.uint64)
            if arr.size:
                for _ in range(rng.choice([1, 2, 10])):
                    arr.flat[rng.randrange(arr.size)] = rng.choice(
                        [self.q, self.q - 1, U64, 1 << 63, 0]
                    )
        if rng.random() < 0.05 and arr.shape == (n,):
            arr[n // 2 :] = 0  # second polynomial zero: a "transparent" ciphertext
        dtype = rng.choice([np.uint64] * 10 + [np.int64, np.float64, np.uint32, np.uint8, bool])
        if dtype is not np.uint64:
            with np.errstate(all="ignore"):
                arr = arr.astype(dtype)
        if rng.random() < 0.05 and arr.ndim == 1 and arr.size:
            arr = np.repeat(arr, 2)[::2]  # non-contiguous view of the same values
        return arr

    def gen_bitpack(self, rng: random.Random) -> tuple[Any, Any, Any]:
        from crypto import bitpack

        count: Any = rng.choice(
            [0, 64, 128, 4096, 64 * rng.randrange(1, 70), 63, 65, -64, 1 << 40, True, np.int64(128)]
        )
        bits: Any = rng.choice([1, 2, 7, 45, 46, 47, 63, 64, 0, 65, -1, True, np.uint8(46), 2.0])
        try:
            size = bitpack.packed_size(count, bits)
        except Exception:
            size = rand_len(rng)
        if size > 1 << 22:
            size = rand_len(rng)
        r = rng.random()
        data: Any = rand_bytes(rng, size)
        if r < 0.1:
            data = rand_bytes(rng, max(0, size + rng.choice([-8, -1, 1, 8])))
        elif r < 0.15:
            data = memoryview(rand_bytes(rng, 2 * size))[::2]  # not contiguous
        elif r < 0.2:
            data = bytearray(data)
        elif r < 0.25 and size % 8 == 0:
            data = np.frombuffer(data, dtype="<u8").data  # a memoryview of format 'Q'
        return data, count, bits

    # ------------------------------------------------------------------ paths
    def paths(self) -> list[PathSpec]:
        from crypto import CiphertextSum, PublicContext, SecretContext, _seal_io, bitpack
        from crypto.ciphertext_sum import unpack_block, unpack_blocks
        from crypto.signing import update_digest, verify_block

        public, q, count = self.public, self.q, self.count

        def check_coeffs(_: Any, out: Any) -> str | None:
            if not isinstance(out, np.ndarray) or out.dtype != np.uint64:
                return f"returned {type(out).__name__} {getattr(out, 'dtype', '')}"
            if out.shape[-1:] != (count,):
                return f"returned shape {out.shape}"
            if out.size and int(out.max()) >= q:
                return "returned a coefficient >= q"
            return None

        def check_values(_: Any, out: Any) -> str | None:
            n = public.params.values_per_block
            if not isinstance(out, np.ndarray) or out.dtype != np.float64 or out.shape != (n,):
                return f"returned {type(out).__name__} {getattr(out, 'shape', '')}"
            return None

        def check_context(data: bytes, out: Any) -> str | None:
            if not isinstance(out, PublicContext):
                return f"returned {type(out).__name__}"
            if out.block_bytes <= 0 or out.modulus.bit_length() != out.params.coeff_modulus_bits:
                return "returned an inconsistent context"
            return None

        def gen_blocks(rng: random.Random) -> list[bytes]:
            return [self.gen_block(rng) for _ in range(rng.choice([0, 1, 1, 2, 3, 4]))]

        def check_blocks(data: list[bytes], out: Any) -> str | None:
            if not isinstance(out, np.ndarray) or out.shape != (len(data), count):
                return f"returned shape {getattr(out, 'shape', None)} for {len(data)} blocks"
            return check_coeffs(None, out) if len(data) else None

        def check_plain(data: list[bytes], out: Any) -> str | None:
            n = self.plain.values_per_block
            if not isinstance(out, np.ndarray) or out.shape != (len(data), n):
                return f"returned shape {getattr(out, 'shape', None)}"
            if not np.all(np.isfinite(out)):
                return "returned NaN or infinite values"
            return None

        acc = CiphertextSum(public)
        acc.add(unpack_block(public, self.blocks[0]))

        def add_packed(data: bytes) -> Any:
            before = acc.coefficients
            try:
                acc.add_packed(data)
            except Exception:
                if not np.array_equal(acc.coefficients, before):
                    raise AssertionError("a refused block changed the running sum") from None
                raise
            coeffs = unpack_block(public, data)
            expected = (before.astype(object) + coeffs.astype(object)) % q
            return acc.coefficients, expected

        def check_add(_: Any, out: Any) -> str | None:
            got, expected = out
            if not np.array_equal(got.astype(object), expected):
                return "the running sum is not (old + block) mod q"
            return None

        def unpack(args: tuple[Any, Any, Any]) -> Any:
            return bitpack.unpack(*args)

        def check_unpack(args: tuple[Any, Any, Any], out: Any) -> str | None:
            data, n, bits = args
            if not isinstance(out, np.ndarray) or out.dtype != np.uint64 or out.shape != (n,):
                return f"returned {getattr(out, 'dtype', None)} {getattr(out, 'shape', None)}"
            if int(bits) < 64 and out.size and int(out.max()) >> int(bits):
                return "returned a value that does not fit in bits"
            if bitpack.pack(out, int(bits)) != memoryview(data).tobytes():
                return "unpack does not invert pack"
            return None

        def gen_rows(rng: random.Random) -> tuple[list[bytes], Any, Any]:
            data, n, bits = self.gen_bitpack(rng)
            return [memoryview(data).tobytes()] * rng.choice([0, 1, 2, 3]), n, bits

        def check_rows(args: tuple[list[bytes], Any, Any], out: Any) -> str | None:
            data, n, bits = args
            if not isinstance(out, np.ndarray) or out.shape != (len(data), n):
                return f"returned shape {getattr(out, 'shape', None)}"
            for row, item in zip(out, data, strict=True):
                if bitpack.pack(np.ascontiguousarray(row), int(bits)) != item:
                    return "unpack_rows does not invert pack"
            return None

        def keyholder_open(data: bytes) -> Any:
            return self.secret.decrypt(unpack_block(public, data))

        def gen_secret_dir(rng: random.Random) -> tuple[bytes, bytes, int]:
            r = rng.random()
            if r < 0.45:
                key = self.seal_object(rng, self.secret_key)
            elif r < 0.8:
                key = mutate_bytes(rng, self.secret_key)
            elif r < 0.9:
                key = self.other_key
            else:
                key = rand_bytes(rng, rand_len(rng))
            ctx = self.ctx_bytes if rng.random() < 0.9 else self.gen_context(rng)
            mode = 0o600 if rng.random() < 0.97 else rng.choice([0o644, 0o640, 0o604])
            return key, ctx, mode

        def load_secret(args: tuple[bytes, bytes, int]) -> Any:
            key, ctx, mode = args
            for path, data in ((self.key_path, key), (self.ctx_path, ctx)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            os.chmod(self.key_path, mode)
            return SecretContext.load(self.key_dir)

        def check_secret(args: Any, out: Any) -> str | None:
            if not isinstance(out, SecretContext):
                return f"returned {type(out).__name__}"
            if stat.S_IMODE(self.key_path.stat().st_mode) & 0o077:
                return "loaded a secret key readable by others"
            return None

        def gen_seal_body(rng: random.Random) -> bytes:
            import zstandard

            r = rng.random()
            if r < 0.5:
                return self.seal_object(rng, rng.choice([self.secret_key, *self.ctx_parts[1:]]))
            if r < 0.6:  # a small frame that claims (or expands to) a large body
                size = rng.choice([1 << 20, 1 << 24, (1 << 28) + 1])
                comp = zstandard.ZstdCompressor(write_content_size=rng.random() < 0.5).compress(
                    b"\x00" * min(size, 1 << 24)
                )
                return struct.pack("<HBBBBHQ", 0xA15E, 16, 4, 3, 2, 0, 16 + len(comp)) + comp
            header = struct.pack(
                "<HBBBBHQ",
                rng.choice([0xA15E, 0xA15E, 0, 0x5EA1]),
                rng.choice([16, 16, 0, 15, 17]),
                rng.choice([3, 4]),
                rng.choice([0, 3]),
                rng.choice([0, 1, 2, 2, 3, 255]),
                0,
                0,
            )
            body = rand_bytes(rng, rand_len(rng))
            total = 16 + len(body) if rng.random() < 0.8 else rand_int(rng, 64)
            return header[:8] + struct.pack("<Q", total & U64) + body

        def check_body(data: bytes, out: Any) -> str | None:
            if not isinstance(out, bytes):
                return f"returned {type(out).__name__}"
            if data[5] == 0 and out != data[16:]:  # byte 5 is the compression mode
                return "uncompressed body differs from the input"
            return None

        def gen_signing(rng: random.Random) -> tuple[str, Any]:
            r = rng.random()
            if r < 0.4:
                identity = b"\x01" + b"\x00" * 31  # the neutral point (small order)
                key = rng.choice(
                    [
                        rand_bytes(rng, 32),
                        b"\x00" * 32,
                        b"\xff" * 32,
                        identity,
                        rand_bytes(rng, rand_len(rng)),
                    ]
                )
                sig = rng.choice(
                    [
                        rand_bytes(rng, 64),
                        b"\x00" * 64,
                        identity + b"\x00" * 32,
                        rand_bytes(rng, rand_len(rng)),
                    ]
                )
                return "verify_block", (key, rand_bytes(rng, rng.choice([0, 32, 33])), sig)
            roots = [
                rand_bytes(rng, rng.choice([32, 32, 32, 31, 33, 0]))
                for _ in range(rng.randrange(5))
            ]
            return "update_digest", dict(
                run_id=rand_text(rng),
                round_=rand_int(rng, 64),
                client_id=rand_text(rng),
                context_id=rand_text(rng),
                weight=rand_double(rng),
                nonce=rand_bytes(rng, rand_len(rng)),
                roots=roots,
            )

        def signing(args: tuple[str, Any]) -> Any:
            what, params = args
            if what == "verify_block":
                return verify_block(*params)
            return update_digest(**params)

        def check_signing(args: tuple[str, Any], out: Any) -> str | None:
            what = args[0]
            if what == "update_digest":
                return None if isinstance(out, bytes) and len(out) == 32 else "bad digest"
            return None if out is False else f"{what} returned {out!r} for random input"

        return [
            PathSpec(
                "PublicContext.from_bytes",
                self.gen_context,
                PublicContext.from_bytes,
                check_context,
            ),
            PathSpec(
                "unpack_block", self.gen_block, lambda d: unpack_block(public, d), check_coeffs
            ),
            PathSpec("unpack_blocks", gen_blocks, lambda d: unpack_blocks(public, d), check_blocks),
            PathSpec(
                "unpack_blocks(plaintext)",
                lambda rng: [self.gen_plain_block(rng) for _ in range(rng.choice([0, 1, 2, 3]))],
                lambda d: unpack_blocks(self.plain, d),
                check_plain,
            ),
            PathSpec("CiphertextSum.add_packed", self.gen_block, add_packed, check_add),
            PathSpec("bitpack.unpack", self.gen_bitpack, unpack, check_unpack),
            PathSpec(
                "bitpack.unpack_rows", gen_rows, lambda a: bitpack.unpack_rows(*a), check_rows
            ),
            PathSpec(
                "SecretContext.decrypt", self.gen_coeff_array, self.secret.decrypt, check_values
            ),
            PathSpec(
                "KeyHolder._open (unpack_block + decrypt)",
                self.gen_block,
                keyholder_open,
                check_values,
            ),
            PathSpec(
                "_seal_io.uncompressed_body", gen_seal_body, _seal_io.uncompressed_body, check_body
            ),
            PathSpec("SecretContext.load", gen_secret_dir, load_secret, check_secret),
            PathSpec(
                "signing (verify_block, update_digest)",
                gen_signing,
                signing,
                check_signing,
            ),
        ]


def run_deser_mode(args: argparse.Namespace, crumb: Breadcrumb) -> dict[str, Any]:
    from fedps.errors import FedPSError

    tmp = Path(tempfile.mkdtemp(prefix="fedps-fuzz-deser-"))
    started = time.monotonic()
    fixture = DeserFixture(tmp)
    results: dict[str, Any] = {}
    for path in fixture.paths():
        if args.only and path.name not in args.only:
            continue
        _log(f"fuzzing {path.name} ({args.n} inputs)")
        rng = random.Random(f"{args.seed}:{path.name}")
        outcome: Counter[str] = Counter()
        refusals: Counter[str] = Counter()
        examples: list[dict[str, Any]] = []
        slow: list[dict[str, Any]] = []
        t0 = time.monotonic()
        done = 0
        stopped = ""
        for i in range(args.n):
            if time.monotonic() - t0 > args.path_budget:
                stopped = f"time budget of {args.path_budget:g} s spent"
                break
            data = path.generate(rng)
            crumb.mark(f"deser {path.name} input {i}")
            start = time.monotonic()
            problem = None
            try:
                out = path.call(data)
            except FedPSError as exc:
                outcome["refused"] += 1
                refusals[f"{type(exc).__name__}: {str(exc)[:60]}"] += 1
            except Exception as exc:
                outcome["failed"] += 1
                problem = f"{type(exc).__name__}: {str(exc)[:300]}"
                tb = traceback.extract_tb(exc.__traceback__)[-3:]
                problem += " at " + " <- ".join(f"{f.filename}:{f.lineno}" for f in tb[::-1])
            else:
                problem = path.check(data, out)
                outcome["failed" if problem else "returned"] += 1
            elapsed = time.monotonic() - start
            if elapsed > args.slow and len(slow) < MAX_EXAMPLES:
                slow.append({"input": i, "seconds": round(elapsed, 3), "data": _short(data)})
            if problem and len(examples) < MAX_EXAMPLES:
                examples.append({"input": i, "problem": problem, "data": _short(data)})
            done += 1
        seconds = time.monotonic() - t0
        results[path.name] = {
            "target": args.n,
            "calls": done,
            "complete": done >= args.n,
            "returned": outcome["returned"],
            "refused": outcome["refused"],
            "failures": outcome["failed"],
            "seconds": round(seconds, 2),
            "stopped": stopped,
            "top_refusals": dict(refusals.most_common(6)),
            "examples": examples,
            "slow": slow,
        }
        _log(
            f"  {done} inputs in {seconds:.1f} s: {dict(outcome)}"
            + (f"; stopped: {stopped}" if stopped else "")
        )
    report = {
        "mode": "deser",
        "n": args.n,
        "seed": args.seed,
        "seconds": round(time.monotonic() - started, 2),
        "paths": results,
        "calls_per_path": {name: r["calls"] for name, r in results.items()},
        "failures": sum(r["failures"] for r in results.values()),
        "incomplete": sorted(n for n, r in results.items() if not r["complete"]),
    }
    report["ok"] = not (report["failures"] or report["incomplete"])
    shutil.rmtree(tmp, ignore_errors=True)
    return report


def _short(data: Any) -> Any:
    if isinstance(data, bytes | bytearray | memoryview):
        raw = memoryview(data).tobytes()
        return f"<{len(raw)} bytes sha256:{hashlib.sha256(raw).hexdigest()[:16]} {raw[:24].hex()}>"
    if isinstance(data, np.ndarray):
        return f"<array {data.dtype} {data.shape}>"
    if isinstance(data, tuple | list):
        return [_short(x) for x in list(data)[:4]]
    if isinstance(data, dict):
        return {k: _short(v) for k, v in data.items()}
    return repr(data)[:120]


# ---------------------------------------------------------------------------- main


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _limit_memory() -> None:
    """Cap the data segment so that an unbounded allocation fails (MemoryError) instead of
    taking the machine down; FEDPS_FUZZ_MEMORY_MB=0 disables the cap."""
    mb = int(os.environ.get("FEDPS_FUZZ_MEMORY_MB", "4096"))
    if mb <= 0:
        return
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = mb * 1024 * 1024
    if hard == resource.RLIM_INFINITY or limit < hard:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.security.fuzz_target")
    parser.add_argument("mode", choices=["rpc", "deser"])
    parser.add_argument("n", type=int, help="calls per RPC, or inputs per path")
    parser.add_argument("seed", type=int)
    parser.add_argument("--only", action="append", help="an RPC (Service.Method) or path name")
    parser.add_argument("--rpc-budget", type=float, default=240.0, help="seconds per RPC")
    parser.add_argument("--path-budget", type=float, default=240.0, help="seconds per path")
    parser.add_argument("--call-timeout", type=float, default=20.0)
    parser.add_argument("--slow", type=float, default=2.0, help="report calls slower than this")
    parser.add_argument(
        "--max-hangs",
        type=int,
        default=3,
        help="stop an RPC after this many calls time out (or 4 times as many slow failures)",
    )
    parser.add_argument("--breadcrumb", default=os.environ.get("FEDPS_FUZZ_BREADCRUMB"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _limit_memory()
    logging.getLogger("fedps").setLevel(logging.ERROR)
    crumb = Breadcrumb(args.breadcrumb)
    try:
        report = run_rpc_mode(args, crumb) if args.mode == "rpc" else run_deser_mode(args, crumb)
    except Exception:
        traceback.print_exc()
        report = {"mode": args.mode, "ok": False, "error": traceback.format_exc()[-2000:]}
    crumb.mark("done")
    seal_io = sys.modules.get("crypto._seal_io")
    if seal_io is not None:  # os._exit below skips the usual clean-up
        shutil.rmtree(seal_io.scratch_root(), ignore_errors=True)
    print(json.dumps(report, default=str), flush=True)
    sys.stderr.flush()
    # Servers and stuck handler threads must not keep the process alive.
    os._exit(0 if report.get("ok") else 1)


if __name__ == "__main__":
    sys.exit(main())
