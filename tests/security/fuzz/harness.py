"""The RPC fuzz loop: requests generated for one RPC (:class:`CaseGenerator`), sent through a
real channel, and every outcome classified against the RPC's oracle (:class:`RpcStats`).

An :class:`RpcSpec` names one RPC (its method descriptor), a valid request to start from and
the oracle (``judge``) that classifies every request as *genuine* (must succeed), *legit*
(success allowed), *malformed* (must be refused) or *skip* (valid and state-changing: never
sent). The oracles are typed with the RPC's request class, so that mypy sees a renamed field;
a spec whose valid request is not of the RPC's request type fails when it is built, and the
``rpc`` mode fails before fuzzing when an RPC has no spec (:func:`~.rpc_mode.rpc_specs`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor

from fedps.proto import common_pb2
from tests.security.fuzz.mutator import Mutator, describe, random_wire
from tests.security.fuzz.values import rand_bytes, rand_len

GENUINE, LEGIT, MALFORMED, SKIP = "genuine", "legit", "malformed", "skip"
#: The metadata a call carries (a credential), if any.
Metadata = list[tuple[str, str]] | None


def bad(reason: str) -> str:
    """A MALFORMED verdict with its reason."""
    return f"{MALFORMED}: {reason}"


def legit(msgs: list[Any], metadata: Metadata) -> str:
    """The oracle of an RPC that any request may call successfully (a read)."""
    return LEGIT


def empty(rng: random.Random) -> common_pb2.Empty:
    """The request of an RPC that takes none."""
    return common_pb2.Empty()


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

Req = TypeVar("Req", bound=pb_message.Message)
#: An oracle: the verdict on the messages of one call (with its metadata).
Judge = Callable[[list[Req], Metadata], str]


@dataclass
class Case(Generic[Req]):
    items: list[Req | bytes]  # messages, or raw bytes that do not parse
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
class RpcSpec(Generic[Req]):
    method: MethodDescriptor
    #: A valid request to mutate; its type must be the RPC's request type.
    base: Callable[[random.Random], Req]
    judge: Judge[Req] = legit
    #: Meaningful alternative values per field name, for the mutator (required: every RPC's
    #: mutations draw from the cluster's ids, keys and ciphertexts).
    pools: dict[str, list[Any]] = field(kw_only=True)
    metadata: Callable[[random.Random], Metadata] | None = None
    #: Cumulative shares of unparseable bytes, uniform random bytes and random wire data;
    #: the rest are mutations of a valid request.
    mix: tuple[float, float, float] = (0.05, 0.12, 0.45)
    #: A protocol-aware mutation used for half of the mutated requests, if given.
    custom: Callable[[random.Random], Req] | None = None
    focus: dict[str, float] = field(default_factory=dict)
    concurrency: int = 4
    #: An oracle for the reply of a unary call that succeeded.
    check_reply: Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        # An RPC whose messages changed must fail here, not fuzz the wrong message type.
        request = message_factory.GetMessageClass(self.method.input_type)
        sample = self.base(random.Random(0))
        if type(sample) is not request:
            raise TypeError(
                f"{self.name} takes {self.method.input_type.full_name}, "
                f"not {sample.DESCRIPTOR.full_name}"
            )
        self.request: type[Req] = type(sample)
        if self.check_reply is not None and self.method.server_streaming:
            raise TypeError(f"{self.name} streams its replies: check_reply takes one reply")

    @property
    def service(self) -> str:
        return self.method.containing_service.name

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
        """The RPC's entry in the report: every count, the histograms and the examples."""
        out = dataclasses.asdict(self)
        for internal in ("slow_unexpected", "refusals", "accepted_reasons"):
            del out[internal]
        return {
            **out,
            "complete": self.calls >= self.target,
            "kinds": dict(self.kinds),
            "codes": dict(self.codes),
            "max_call_s": round(self.max_call_s, 3),
            "seconds": round(self.seconds, 2),
            "top_refusals": dict(self.refusals.most_common(20)),
            "accepted_malformed_reasons": dict(self.accepted_reasons.most_common(12)),
        }


class CaseGenerator(Generic[Req]):
    """Produces the requests of one RPC: random wire data, mutations, unparseable bytes."""

    def __init__(self, spec: RpcSpec[Req], rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.cls = spec.request
        self.desc = spec.method.input_type
        self.mutator = Mutator(rng, spec.pools, spec.focus)
        self.skipped = 0

    def next(self) -> Case[Req] | None:
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

    def _items(self) -> tuple[list[Req | bytes], str]:
        rng = self.rng
        count = 1
        if self.spec.method.client_streaming:
            count = rng.choice([0, *[1] * 14, 2, 2, 3, 4])
        items: list[Req | bytes] = []
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

    def _parse(self, data: bytes) -> Req | None:
        try:
            return self.cls.FromString(data)
        except Exception:  # DecodeError, or anything upb raises on garbage
            return None

    def _uniform(self) -> Req:
        for _ in range(20):
            msg = self._parse(rand_bytes(self.rng, rand_len(self.rng) % 80))
            if msg is not None:
                return msg
        return self._wire()

    def _wire(self) -> Req:
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

    def _mutated(self) -> Req:
        if self.spec.custom is not None and self.rng.random() < 0.5:
            return self.spec.custom(self.rng)
        msg = self.spec.base(self.rng)
        self.mutator.mutate(msg, self.rng.choice([1, 1, 1, 2, 2, 3, 5]))
        return msg


def _serialize(item: pb_message.Message | bytes) -> bytes:
    return item if isinstance(item, bytes) else item.SerializeToString()


def make_callable(channel: grpc.Channel, spec: RpcSpec[Any]) -> Callable[..., Any]:
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
    fn: Callable[..., Any], spec: RpcSpec[Req], case: Case[Req], timeout: float
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
    spec: RpcSpec[Req],
    fn: Callable[..., Any],
    n: int,
    rng: random.Random,
    *,
    timeout: float,
    slow_s: float,
    max_hangs: int,
    crumb: Breadcrumb,
) -> RpcStats:
    stats = RpcStats(target=n)
    gen = CaseGenerator(spec, rng)
    start = time.monotonic()
    submitted = 0
    pending: dict[Future[tuple[str, str, float, str | None]], Case[Req]] = {}
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
            if not stats.stopped and stats.hangs >= max_hangs:
                stats.stopped = f"{stats.hangs} calls hit the {timeout:g} s deadline"
            if not stats.stopped and stats.slow_unexpected >= 4 * max_hangs:
                stats.stopped = f"{stats.slow_unexpected} slow calls (> {slow_s:g} s) failed"
    stats.skipped_valid = gen.skipped
    stats.seconds = time.monotonic() - start
    return stats


def _record(
    stats: RpcStats,
    case: Case[Any],
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


def log(text: str) -> None:
    """A progress line on stderr (stdout carries only the report)."""
    print(text, file=sys.stderr, flush=True)


class Breadcrumb:
    """The current RPC or path and iteration, in a file the parent reads after a crash."""

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if path else None

    def mark(self, text: str) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, text.encode()[:200].ljust(200), 0)
