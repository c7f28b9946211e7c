"""Protobuf-aware fuzzing: random wire data shaped like a message type, structured mutations
of a valid message (:class:`Mutator`), and short descriptions of requests for reports."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import struct
from collections.abc import Sequence
from typing import Any, cast

from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from tests.security.fuzz.values import (
    U32,
    U64,
    flip_bits,
    mutate_bytes,
    mutate_str,
    rand_bytes,
    rand_double,
    rand_int,
    rand_len,
    rand_text,
)

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
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            self._map(msg, f)
        elif f.is_repeated:
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

    def _map(self, msg: pb_message.Message, f: FieldDescriptor) -> None:
        """A map field (string keys): clear it, or set a few or very many entries to mutated
        keys and values (empty, long or repeated names; NaN, infinities, huge numbers)."""
        rng = self.rng
        entries = getattr(msg, f.name)
        entry = cast(Descriptor, f.message_type)
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        op = rng.choice(["clear", "few", "few", "many"])
        if op == "clear":
            entries.clear()
            return
        keys = list(entries) or [""]
        count = rng.choice([1, 2, 3]) if op == "few" else rng.choice([17, 100, 1000])
        for _ in range(min(count, 2000 - len(entries))):  # bounded however often it is hit
            with contextlib.suppress(ValueError, TypeError):
                entries[self.value(key_field, rng.choice(keys))] = self.value(value_field, 0.0)

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
        if isinstance(v, Sequence):  # lists, tuples, protobuf repeated fields
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
