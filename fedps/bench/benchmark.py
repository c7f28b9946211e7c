"""``fedps bench``: what encryption costs, measured in one run against its baselines.

- Crypto micro-benchmarks (:mod:`crypto.benchmark`) on 100k, 1M and 10M parameters: fedps's
  packed format, TenSEAL's default CKKS vectors (the NVIDIA FLARE path) and plaintext.
- DP noise: the hardened CSPRNG Gaussian against ``torch.normal``, and one client's DP-SGD
  round on the 1M-parameter model with its noise drawn ahead against drawn on demand
  (:mod:`fedps.bench.noise_ahead`).
- DP-SGD clipping: the same client's round with ghost clipping against Opacus's per-sample
  gradients (:mod:`fedps.bench.clipping_modes`).
- End to end: the same rounds (same clients, same DP) with encryption on and off, as separate
  processes on loopback, for the demo model and a 1M-parameter model, with where their rounds
  go, phase by phase (:func:`fedps.bench.round_profile.phase_profile`).
- Shard memory: peak RSS of a shard process after 10 and after 200 clients pushed a
  1M-parameter update.
- The key holder's whole-aggregate verification on the 1M-parameter model: what each client
  and the key holder compute (sketches of every block under the round's challenge) and send
  (the commitment), against that model's secure round time and push bytes in the same run.
- Key rotation on the 1M-parameter model: the key holder's new key pair, the signed public
  context every client fetches again and adopts (with the encryptions of zero it draws anew),
  and the secure rounds right after a rotation against the others of a run that rotates every
  other round.

Speeds are reported as ratios against a baseline measured in the same run; the machines are
shared and noisy, so absolute figures are indicative only.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from crypto import BlockEncryptor, PublicContext, SecretContext
from crypto.benchmark import (
    decryption_error,
    measure_noise,
    measure_packed,
    measure_plain,
    measure_tenseal,
    timed,
    wire_error,
)
from crypto.params import CANARIES
from crypto.signed_update import SignedUpdate
from crypto.signing import BlockSigner, context_digest, verify_block
from crypto.sketch import Challenge
from fedps.bench.clipping_modes import measure_clipping
from fedps.bench.noise_ahead import measure_noise_ahead
from fedps.bench.round_profile import phase_profile
from fedps.ckks_params import ckks_params
from fedps.config import load_config
from fedps.proto import common_pb2, keyholder_pb2, keyholder_pb2_grpc, shard_pb2, shard_pb2_grpc
from fedps.provisioning import setup_tls
from fedps.rpc.keyholder_messages import PublicContextInfo
from fedps.rpc.transport import batched, call, create_channel
from fedps.runtime.demo import run_demo
from fedps.runtime.demo_summary import DemoSummary
from fedps.runtime.deployment import Deployment, local_cluster, write_config

__all__ = ["machine_description", "run_bench", "status_mib", "time_to_accuracy"]

_log = logging.getLogger("fedps")


def machine_description() -> dict[str, Any]:
    """CPU model, core count and memory of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem_kb = 0
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
    }


def run_bench(
    *,
    sizes: list[int],
    e2e_models: list[str],
    memory_clients: list[int],
    rounds: int,
    console: Console,
) -> dict[str, Any]:
    """Run every benchmark; returns the results (also what ``--json`` writes)."""
    params = ckks_params(load_config())
    keys = SecretContext.generate(params)
    results: dict[str, Any] = {"machine": machine_description(), "params": params.__dict__}
    console.print(f"scheme: {params}")
    error = decryption_error(keys, updates=100)
    results["sum_of_100_error_relative"] = error
    console.print(f"decryption error after summing 100 updates: {error:.2e} (relative)")
    wire = wire_error(keys)
    results["wire_error"] = wire
    console.print(
        f"error of one value, in units of the scale: {wire['fresh_value_max']:,.0f} fresh, "
        f"{wire['sent_value_max']:,.0f} as sent (bound {wire['value_bound']:,.0f}); canaries "
        f"{wire['sent_canary_max']:,.0f} (bound {wire['canary_bound']:,.0f})"
    )
    crypto: dict[str, Any] = {}
    for size in sizes:
        console.print(f"crypto paths at {size:,} parameters ...")
        crypto[str(size)] = {
            "packed": measure_packed(size, keys=keys),
            "tenseal": measure_tenseal(size),
            "plain": measure_plain(size),
        }
    results["crypto"] = crypto
    console.print("DP noise: CSPRNG (hardened) vs torch.normal ...")
    results["noise"] = measure_noise(max(sizes))
    console.print("DP noise drawn ahead vs on demand, one client's DP-SGD round of mlp1m ...")
    results["noise_ahead"] = measure_noise_ahead("mlp1m")
    console.print("DP-SGD clipping, ghost vs per-sample, one client's round of mlp1m ...")
    results["clipping"] = measure_clipping("mlp1m")
    e2e: dict[str, Any] = {}
    for model in e2e_models:
        console.print(f"end-to-end rounds, model {model} ...")
        e2e[model] = _round_times(model, rounds)
    results["e2e"] = e2e
    memory: dict[str, Any] = {}
    for clients in memory_clients:
        console.print(f"shard peak RSS, {clients} clients x 1M parameters ...")
        memory[str(clients)] = _shard_peak_rss(clients, 1_000_000, keys)
    results["shard_memory"] = memory
    if "mlp1m" in e2e:
        console.print("verification of the aggregate, 1M-parameter model ...")
        secure = e2e["mlp1m"]["secure"]
        results["verification"] = measure_verification(
            _num_params("mlp1m"), keys=keys, round_s=secure["median_round_s"]
        )
        push_s = secure["median_push_phase_s"]
        results["verification"]["push_phase_s"] = push_s
        results["verification"]["push_phase_fraction"] = push_s / secure["median_round_s"]
        console.print(f"key rotation every {_ROTATION_BENCH_EVERY} rounds, 1M-parameter model ...")
        results["rotation"] = measure_rotation(
            _num_params("mlp1m"),
            keys=keys,
            round_seconds=_demo_rounds(
                "mlp1m", rounds, security={"rotate_every_rounds": _ROTATION_BENCH_EVERY}
            ).round_seconds,
            every=_ROTATION_BENCH_EVERY,
        )
    return results


def _num_params(model: str) -> int:
    from fedps.learning.models import create_model

    net = create_model(model, num_features=64, num_classes=10)
    return sum(p.numel() for p in net.parameters())


def measure_verification(
    num_params: int, *, keys: SecretContext, round_s: float, clients: int = 4
) -> dict[str, float]:
    """What the whole-aggregate check costs one round of ``clients`` clients.

    Each client sketches its own blocks (in parallel with the others: one client's time is
    on the round's critical path) and sends one commitment; the key holder sketches every
    aggregate block and combines the clients' sketches, then computes every block's zero
    canaries (the coefficients that carry no value are bytes too). Compared with ``round_s``, the
    median secure round of the same model measured in the same run, and with the bytes of
    one client's encrypted update.
    """
    public = keys.public
    rng = np.random.default_rng(0)
    encryptor = BlockEncryptor(public)
    coefficients = [
        encryptor.encrypt_with_coefficients(rng.normal(0, 0.01, num_params))[1]
        for _ in range(clients)
    ]
    push_bytes = sum(len(b) for b in encryptor.encrypt(rng.normal(0, 0.01, num_params)).values())
    seed = os.urandom(32)

    def client_side(own: np.ndarray) -> np.ndarray:
        challenge = Challenge(
            seed, modulus=public.modulus, coeffs_per_block=public.coeffs_per_block
        )
        sketches: np.ndarray = challenge.sketch(own)
        return sketches

    mine, client_s = timed(lambda: client_side(coefficients[0]))
    sketches = [mine] + [client_side(c) for c in coefficients[1:]]
    q = np.uint64(public.modulus)  # below 2^62: a sum of two residues fits in uint64
    aggregate = coefficients[0].copy()
    for c in coefficients[1:]:
        aggregate = (aggregate + c) % q

    def keyholder_side() -> bool:
        challenge = Challenge(
            seed, modulus=public.modulus, coeffs_per_block=public.coeffs_per_block
        )
        expected = challenge.combine([(s, 1) for s in sketches])
        return bool(np.array_equal(challenge.sketch(aggregate), expected))

    ok, keyholder_s = timed(keyholder_side)
    if not ok:
        raise AssertionError("the honest aggregate failed its own check")
    # the zero canaries of every block, computed before anything is decrypted
    _, canary_s = timed(lambda: keys.canaries(aggregate))
    # the canaries' coefficients of both polynomials as sent: c0's high part and low bits, c1's
    blocks = -(-num_params // public.params.values_per_block)
    canary_bytes = blocks * CANARIES * public.compression.canary_bits / 8
    roots = SignedUpdate.sign(
        BlockSigner(),
        coefficients[0],
        run_id="bench",
        round_=1,
        client_id="client-0",
        context_id=public.context_id,
        weight=1.0,
    ).roots
    commit = keyholder_pb2.CommitRequest(
        round=1,
        update=common_pb2.SignedUpdate(
            client_id="client-0", weight=1.0, nonce=b"\0" * 16, signature=b"\0" * 64, roots=roots
        ),
        sketches=mine.astype("<u8").tobytes(),
    )
    commit_bytes = commit.ByteSize() + 64  # and the challenge request and reply
    return {
        "num_params": float(num_params),
        "clients": float(clients),
        "client_sketch_s": client_s,
        "keyholder_check_s": keyholder_s,
        "round_s": round_s,
        "canary_check_s": canary_s,
        "time_fraction": (client_s + keyholder_s + canary_s) / round_s,
        "commit_bytes": float(commit_bytes),
        "canary_bytes": canary_bytes,
        "sketch_bytes": float(mine.nbytes),
        "push_bytes": float(push_bytes),
        "bytes_fraction": (commit_bytes + canary_bytes) / push_bytes,
    }


#: The rotation period of the run that measures the rounds after a rotation.
_ROTATION_BENCH_EVERY = 2


def measure_rotation(
    num_params: int, *, keys: SecretContext, round_seconds: Sequence[float], every: int
) -> dict[str, float]:
    """What one key rotation costs (docs/security.md, key rotation).

    The key holder generates a key pair and writes it (the old pair replaced in one step),
    then serialises and signs the public context once; each client fetches those bytes,
    verifies the signature, loads the context and draws the encryptions of zero of every
    block of the model under the new key, which it would otherwise have drawn in the
    background while it waited for the round. ``round_seconds`` are the secure rounds of a
    run that rotates every ``every`` rounds: the rounds right after a rotation against the
    others, the first two left out (imports and warm-up).
    """
    params = keys.public.params
    blocks = -(-num_params // params.values_per_block)
    signer = BlockSigner()
    with tempfile.TemporaryDirectory(prefix="fedps-rotation-") as tmp:

        def rotate() -> SecretContext:
            fresh = SecretContext.generate(params)
            fresh.save(Path(tmp))
            return fresh

        rotations = [timed(rotate) for _ in range(5)]
    fresh = rotations[-1][0]

    def publish() -> bytes:
        context = fresh.public.serialize()
        context_id = fresh.public.context_id
        signature = signer.sign(context_digest(context, context_id))
        info = PublicContextInfo(context, context_id, signer.public_key, signature)
        return info.to_proto().SerializeToString()

    reply, publish_s = timed(publish)

    def adopt() -> BlockEncryptor:
        info = PublicContextInfo.from_proto(keyholder_pb2.PublicContextReply.FromString(reply))
        digest = context_digest(info.context, info.context_id)
        if not verify_block(info.signing_key, digest, info.signature):
            raise AssertionError("the signed public context does not verify")
        encryptor = BlockEncryptor(PublicContext.from_bytes(info.context))
        encryptor.precompute(blocks)
        return encryptor

    adoptions = [timed(adopt) for _ in range(3)]
    for encryptor, _ in adoptions:
        encryptor.close()
    push_bytes = blocks * fresh.public.block_bytes
    steady = list(enumerate(round_seconds, start=1))[2:]
    after = [s for r, s in steady if (r - 1) % every == 0]
    others = [s for r, s in steady if (r - 1) % every != 0]
    after_s = statistics.median(after) if after else float("nan")
    others_s = statistics.median(others) if others else float("nan")
    return {
        "num_params": float(num_params),
        "blocks": float(blocks),
        "keyholder_rotate_s": statistics.median(s for _, s in rotations),
        "keyholder_publish_s": publish_s,
        "context_bytes": float(len(reply)),
        "push_bytes": float(push_bytes),
        "bytes_fraction": len(reply) / push_bytes,
        "client_adopt_s": statistics.median(s for _, s in adoptions),
        "every": float(every),
        "round_after_rotation_s": after_s,
        "round_other_s": others_s,
        "round_after_rotation_extra": after_s / others_s - 1,
    }


def _demo_rounds(model: str, rounds: int, **sections: Mapping[str, object]) -> DemoSummary:
    """A demo run of ``model`` for ``rounds`` rounds, with ``sections`` overridden."""
    with tempfile.TemporaryDirectory(prefix="fedps-bench-") as tmp:
        return run_demo(
            None,
            Path(tmp),
            {"training": {"model": model, "rounds": rounds}, **sections},
            quiet=True,
        )


def _round_times(model: str, rounds: int) -> dict[str, Any]:
    """Median round time with encryption on and off, and where the rounds' time goes.

    Same clients, same DP, same seed; each phase's median over rounds 2..R.
    """
    out: dict[str, Any] = {}
    profiles: dict[str, Any] = {}
    for label, enabled in (("secure", True), ("plaintext", False)):
        summary = _demo_rounds(model, rounds, he={"enabled": enabled})
        times, pushes = list(summary.round_seconds), list(summary.push_seconds)
        # The first rounds pay for imports, warm-up and the first draw of encryptions of zero.
        steady = times[2:] or times
        out[label] = {
            "median_round_s": statistics.median(steady),
            "median_push_phase_s": statistics.median(pushes[2:] or pushes),
            "round_seconds": times,
            "bytes_pushed": summary.bytes_pushed,
            "final_accuracy": summary.final_accuracy,
        }
        profiles[label] = phase_profile([summary])
    out["ratio"] = out["secure"]["median_round_s"] / out["plaintext"]["median_round_s"]
    out["profile"] = profiles
    return out


def _shard_peak_rss(clients: int, num_params: int, keys: SecretContext) -> dict[str, Any]:
    """Start a key holder and one shard as processes, and push ``clients`` real encrypted updates.

    The updates have ``num_params`` values each; then read the shard's peak resident memory (VmHWM).
    """
    with tempfile.TemporaryDirectory(prefix="fedps-mem-") as tmp:
        work = Path(tmp)
        # This process pushes as every client: one process holds one certificate, so this
        # measurement runs without TLS, explicitly (plaintext on loopback, no coordinator).
        config = load_config(
            None,
            cluster=local_cluster(work / "state", shards=1),
            training={"clients": min(clients, 100), "min_quorum": 1},
            tls={"insecure": True, "directory": str(work / "certs")},
        )
        setup_tls(config.tls, "bench")
        path = work / "fedps.toml"
        write_config(config, path)
        deployment = Deployment(path, config)
        try:
            deployment.start("keyholder", "keyholder")
            deployment.start("shard-0", "shard", "--index", "0")
            deployment.wait_ready([config.cluster.keyholder, config.cluster.shards[0]])
            _push_updates(config.cluster.keyholder, config.cluster.shards[0], clients, num_params)
            return {"peak_rss_mib": _vm_hwm_mib(deployment.processes["shard-0"].pid)}
        finally:
            deployment.stop()


def _push_updates(keyholder: str, shard: str, clients: int, num_params: int) -> None:
    kh = keyholder_pb2_grpc.KeyHolderStub(create_channel(keyholder))
    ctx = call(lambda: kh.GetPublicContext(common_pb2.Empty()), "context")
    public = PublicContext.from_bytes(ctx.context)
    n = public.params.values_per_block
    blocks = [
        common_pb2.ParameterBlock(block=b, version=0, values=np.zeros(n, "<f4").tobytes())
        for b in range(-(-num_params // n))
    ]
    init = keyholder_pb2.InitializeRequest(num_params=num_params, blocks=blocks, force=True)
    call(lambda: kh.InitializeModel(iter([init])), "initialise")
    stub = shard_pb2_grpc.ShardStub(create_channel(shard))
    signers = {f"bench-{i}": BlockSigner() for i in range(clients)}
    request = shard_pb2.OpenRoundRequest(
        round=1,
        version=0,
        members=[
            common_pb2.CohortMember(client_id=c, signing_key=s.public_key)
            for c, s in signers.items()
        ],
        context_id=ctx.context_id,
        run_id="bench",
    )
    call(lambda: stub.OpenRound(request), "open round")
    encryptor = BlockEncryptor(public)
    distinct = [
        encryptor.encrypt_with_coefficients(np.full(num_params, 0.001 * (i + 1))) for i in range(4)
    ]
    for i, (client, signer) in enumerate(signers.items()):
        update, coefficients = distinct[i % len(distinct)]
        signed = SignedUpdate.sign(
            signer,
            coefficients,
            run_id="bench",
            round_=1,
            client_id=client,
            context_id=ctx.context_id,
            weight=1.0,
        )
        nonce, signature, roots = signed.nonce, signed.signature, signed.roots
        items = [shard_pb2.EncryptedBlock(block=b, ciphertext=c) for b, c in sorted(update.items())]
        messages = [
            shard_pb2.PushRequest(
                client_id=client,
                round=1,
                version=0,
                weight=1.0,
                context_id=ctx.context_id,
                blocks=batch,
                nonce=nonce,
                signature=signature,
                roots=roots,
            )
            for batch in batched(items, lambda e: len(e.ciphertext))
        ]
        call(lambda: stub.PushBlocks(iter(messages)), f"push {client}")  # noqa: B023


def _vm_hwm_mib(pid: int) -> float:
    return status_mib(pid, "VmHWM") or float("nan")


def status_mib(pid: int, key: str) -> float:
    """A memory line of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``) in MiB; 0 if none (gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def time_to_accuracy(
    *, target: float, slow_fraction: float, slow_factor: float, rounds: int
) -> dict[str, Any]:
    """Wall-clock seconds until the evaluated accuracy first reaches ``target``.

    For sync rounds and async buffers on the same clients (some slowed down), same DP and seed.
    """
    out: dict[str, Any] = {}
    base = {
        "clients": 4,
        "min_quorum": 2,
        "slow_fraction": slow_fraction,
        "slow_factor": slow_factor,
        "eval_every": 1,
    }
    runs = {
        "sync": {**base, "mode": "sync", "rounds": rounds},
        "async": {**base, "mode": "async", "buffer_size": 2, "rounds": 2 * rounds},
    }
    for label, training in runs.items():
        with tempfile.TemporaryDirectory(prefix="fedps-async-") as tmp:
            summary = run_demo(
                None,
                Path(tmp),
                {"training": training, "privacy": {"noise_multiplier": 1.0}},
                quiet=True,
            )
        history = summary.round_accuracy
        elapsed = 0.0
        reached: float | None = None
        for seconds, accuracy in history:
            elapsed += seconds
            if reached is None and accuracy is not None and accuracy >= target:
                reached = elapsed
        out[label] = {
            "seconds_to_target": reached,
            "final_accuracy": summary.final_accuracy,
            "updates_applied": len(history),
        }
    sync_t, async_t = out["sync"]["seconds_to_target"], out["async"]["seconds_to_target"]
    out["target"] = target
    out["speedup"] = sync_t / async_t if sync_t and async_t else None
    return out
