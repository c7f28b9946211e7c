"""``deser`` mode: generated inputs fed to every deserialisation path directly.

Each path must return a validated object or raise :class:`fedps.errors.FedPSError`; any other
exception, or a result its check refuses, is a failure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import stat
import struct
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from crypto import (
    BlockEncryptor,
    CiphertextSum,
    CkksParams,
    PlainContext,
    PublicContext,
    SecretContext,
    _seal_io,
    bitpack,
)
from crypto.ciphertext_sum import unpack_block, unpack_blocks
from crypto.public_context import _WIRE_MAGIC
from crypto.signing import update_digest, verify_block
from fedps.errors import FedPSError
from tests.crypto.context_parts import context_parts
from tests.security.fuzz.harness import MAX_EXAMPLES, Breadcrumb, log
from tests.security.fuzz.values import (
    U32,
    U64,
    flip_bits,
    mutate_bytes,
    rand_bytes,
    rand_double,
    rand_int,
    rand_len,
    rand_text,
)


@dataclass
class PathSpec:
    name: str
    generate: Callable[[random.Random], Any]
    call: Callable[[Any], Any]
    check: Callable[[Any, Any], str | None]  # (input, result) -> problem or None


class DeserFixture:
    """Genuine serialised objects of two key generations, and one spec per path."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.secret = SecretContext.generate(CkksParams(2048, 46, 37))
        self.other = SecretContext.generate(CkksParams(4096, 60, 40))
        self.public = self.secret.public
        self.plain = PlainContext(self.public.params.values_per_block)
        self.magic = _WIRE_MAGIC
        self.ctx_bytes = self.public.serialize()
        self.other_ctx = self.other.public.serialize()
        self.ctx_parts = context_parts(self.ctx_bytes)
        self.other_parts = context_parts(self.other_ctx)
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

    # ------------------------------------------------------------------ inputs
    def seal_object(self, rng: random.Random, data: bytes) -> bytes:
        """Mutate a SEAL-serialised object: header fields, compressed body, or raw bytes."""

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

        public, q, count = self.public, self.q, self.count

        def check_coeffs(_: Any, out: Any) -> str | None:
            if not isinstance(out, np.ndarray) or out.dtype != np.uint64:
                return _returned(out)
            if out.shape[-1:] != (count,):
                return f"returned shape {out.shape}"
            if out.size and int(out.max()) >= q:
                return "returned a coefficient >= q"
            return None

        def check_values(_: Any, out: Any) -> str | None:
            n = public.params.values_per_block
            if not isinstance(out, np.ndarray) or out.dtype != np.float64 or out.shape != (n,):
                return _returned(out)
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
                return f"{_returned(out)} for {len(data)} blocks"
            return check_coeffs(None, out) if len(data) else None

        def check_plain(data: list[bytes], out: Any) -> str | None:
            n = self.plain.values_per_block
            if not isinstance(out, np.ndarray) or out.shape != (len(data), n):
                return _returned(out)
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
                return _returned(out)
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
                return _returned(out)
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

    tmp = Path(tempfile.mkdtemp(prefix="fedps-fuzz-deser-"))
    started = time.monotonic()
    fixture = DeserFixture(tmp)
    results: dict[str, Any] = {}
    for path in fixture.paths():
        if args.only and path.name not in args.only:
            continue
        log(f"fuzzing {path.name} ({args.n} inputs)")
        rng = random.Random(f"{args.seed}:{path.name}")
        outcome: Counter[str] = Counter()
        refusals: Counter[str] = Counter()
        examples: list[dict[str, Any]] = []
        slow: list[dict[str, Any]] = []
        t0 = time.monotonic()
        done = 0
        for i in range(args.n):
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
            "top_refusals": dict(refusals.most_common(6)),
            "examples": examples,
            "slow": slow,
        }
        log(f"  {done} inputs in {seconds:.1f} s: {dict(outcome)}")
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


def _returned(out: object) -> str:
    """What a path returned, for a failure message."""
    if isinstance(out, np.ndarray):
        return f"returned a {out.dtype} array of shape {out.shape}"
    return f"returned {type(out).__name__}"


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
