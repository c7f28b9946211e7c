"""Bounded fuzzing of every fedps RPC and every deserialisation path, run as a subprocess.

Usage (from the repository root)::

    python -m tests.security.fuzz rpc N SEED [--only Service.Method] [...]
    python -m tests.security.fuzz deser N SEED [--only PATH] [...]

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

Counts, not clocks
    Every RPC and path gets exactly N calls (2,000 in the suite's full tests, 10,000 when the
    fuzz was accepted), however long a loaded machine takes. Each call has a deadline
    (``--call-timeout``, 60 s) that is a hang guard only, far above a normal call
    (milliseconds; calls over ``--slow``, 2 s, are reported): a call that reaches it is a
    hang, counted as an unexpected DEADLINE_EXCEEDED, and an RPC stops early (and counts as
    incomplete) after 3 of them or 12 slow failures. Measured on 2 cores, 10,000 calls take
    8-50 s per RPC (PushBlocks and OpenRound are the slowest: 23 KB ciphertexts; a
    public-context refetch per unknown context id), about 5 minutes for all 20 RPCs, and
    1-40 s per deserialisation path (``SecretContext.load`` is the slowest), about 1.5
    minutes in all. The data segment is capped (``FEDPS_FUZZ_MEMORY_MB``, default 4096) so
    that an unbounded allocation in a handler fails with MemoryError instead of taking the
    machine down.

Layout
    ``values`` (random values and byte/string mutations), ``mutator`` (protobuf wire data
    and structured mutations), ``harness`` (the RPC fuzz loop and its verdicts), ``cluster``
    (the running cluster and the genuine material), one module per service with its RPC
    specs and oracles (``shard_rpcs``, ``keyholder_rpcs``, ``coordinator_rpcs``, each a
    ``service_rpcs.ServiceRpcs``), ``rpc_mode``, ``deser`` (the deserialisation paths) and
    this command line.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import resource
import shutil
import sys
import traceback
from collections.abc import Callable
from typing import Any

from tests.security.fuzz.harness import Breadcrumb


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


def _runner(mode: str) -> Callable[[argparse.Namespace, Breadcrumb], dict[str, Any]]:
    """The mode's entry point, imported for that mode only: ``deser`` starts no cluster, so
    it need not import what the cluster's roles do (torch, for the coordinator's model)."""
    if mode == "rpc":
        from tests.security.fuzz.rpc_mode import run_rpc_mode

        return run_rpc_mode
    from tests.security.fuzz.deser import run_deser_mode

    return run_deser_mode


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.security.fuzz")
    parser.add_argument("mode", choices=["rpc", "deser"])
    parser.add_argument("n", type=int, help="calls per RPC, or inputs per path")
    parser.add_argument("seed", type=int)
    parser.add_argument("--only", action="append", help="an RPC (Service.Method) or path name")
    parser.add_argument(
        "--call-timeout", type=float, default=60.0, help="a call's deadline (a hang guard)"
    )
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
    run = _runner(args.mode)  # imported before the memory cap, as a module-level import was
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _limit_memory()
    logging.getLogger("fedps").setLevel(logging.ERROR)
    crumb = Breadcrumb(args.breadcrumb)
    try:
        report = run(args, crumb)
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
