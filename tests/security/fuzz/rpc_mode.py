"""``rpc`` mode: every RPC of the three services fuzzed in turn against one cluster.

The order matters: pushes first (round 1 must be open), read-only calls next, state-changing
ones last. After each RPC every server must still answer; at the end the cluster's state must
equal the baseline snapshot.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from tests.security.fuzz.cluster import FuzzCluster
from tests.security.fuzz.coordinator_rpcs import CoordinatorRpcs
from tests.security.fuzz.harness import (
    FUZZ_CLIENT_MAX_BYTES,
    Breadcrumb,
    RpcSpec,
    fuzz_rpc,
    log,
    make_callable,
)
from tests.security.fuzz.keyholder_rpcs import KeyHolderRpcs
from tests.security.fuzz.shard_rpcs import ShardRpcs

#: Pushes first (round 1 must be open), read-only calls next, state-changing ones last.
ORDER = [
    "Shard.PushBlocks",
    "Shard.GetStatus",
    "Shard.PullBlocks",
    "Shard.FetchAggregate",
    "Shard.TraceBlocks",
    "KeyHolder.GetPublicContext",
    "KeyHolder.GetModelState",
    "KeyHolder.GetChallenge",
    "KeyHolder.CloseCommits",
    "Coordinator.Register",
    "Coordinator.GetTask",
    "Coordinator.ReportUpdate",
    "Coordinator.GetStatus",
    "Coordinator.GetClosedRound",
    "Coordinator.RemoveShard",
    "Coordinator.JoinShard",
    "KeyHolder.Commit",
    "KeyHolder.OpenCommits",
    "KeyHolder.ApplyRound",
    "KeyHolder.InitializeModel",
    "Shard.OpenRound",
    "Shard.CloseRound",
    "Shard.DiscardRound",
    "Shard.Publish",
]


def rpc_specs(cluster: FuzzCluster) -> list[RpcSpec[Any]]:
    """Every RPC's spec, in :data:`ORDER`; fails if an RPC has no spec or a spec no RPC."""
    specs = [
        *ShardRpcs(cluster).checked_specs(),
        *KeyHolderRpcs(cluster).checked_specs(),
        *CoordinatorRpcs(cluster).checked_specs(),
    ]
    unordered = {spec.name for spec in specs} - set(ORDER)
    if unordered:
        raise RuntimeError(f"RPCs with no place in ORDER: {sorted(unordered)}")
    return sorted(specs, key=lambda s: ORDER.index(s.name))


def run_rpc_mode(args: argparse.Namespace, crumb: Breadcrumb) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="fedps-fuzz-"))
    started = time.monotonic()
    fixture = FuzzCluster(tmp)
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
    for spec in rpc_specs(fixture):
        if args.only and spec.name not in args.only:
            continue
        rng = random.Random(f"{args.seed}:{spec.name}")
        log(f"fuzzing {spec.name} ({args.n} calls)")
        stats = fuzz_rpc(
            spec,
            make_callable(channels[spec.service], spec),
            args.n,
            rng,
            timeout=args.call_timeout,
            slow_s=args.slow,
            max_hangs=args.max_hangs,
            crumb=crumb,
        )
        results[spec.name] = stats.as_json()
        log(
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
