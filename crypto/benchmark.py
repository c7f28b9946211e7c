"""Micro-benchmarks of the encryption paths, all measured in one run on the same sizes.

Three schemes, each from the client's encryption to the key holder's decryption:

- ``packed``: fedps's wire format (raw SEAL coefficients of N=2048, one 45-bit prime,
  bit-packed; numpy encoding and modular addition).
- ``tenseal``: TenSEAL's default CKKS vectors (N=8192, [60, 40, 40, 60], scale 2^40),
  serialised with ``serialize()``, summed after ``ckks_vector_from``: the path NVIDIA FLARE
  takes.
- ``plain``: no encryption (float64 on the wire), the floor.

Throughputs are values per second on one core unless the name says otherwise.

:func:`measure_noise` times the DP noise: the CSPRNG's hardened Gaussian
(:class:`crypto.randomness.SecureRandom`, four standard Gaussians per value, in float64 and
rounded to float32) against the draw it replaced (``torch.normal`` from torch's Mersenne
Twister, what Opacus uses outside ``secure_mode``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tenseal as ts

from crypto.block_encryptor import BlockEncryptor
from crypto.ciphertext_sum import CiphertextSum, unpack_blocks
from crypto.params import TAIL_SIGMAS, CkksParams
from crypto.plain_context import PlainContext
from crypto.randomness import SecureRandom
from crypto.secret_context import SecretContext

__all__ = [
    "decryption_error",
    "measure_noise",
    "measure_packed",
    "measure_plain",
    "measure_tenseal",
    "timed",
    "wire_error",
]

_MESSAGE_BLOCKS = 90  # blocks per push message (about 2 MB)


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence TenSEAL's C++ warnings (printed to file descriptor 1) while measuring."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure_packed(
    num_params: int, *, keys: SecretContext, workers: int = 0, clients: int = 2
) -> dict[str, float]:
    """Client encrypt (offline + online), bytes, shard ingest and decrypt for ``packed``."""
    rng = np.random.default_rng(0)
    public = keys.public
    n = public.params.values_per_block
    blocks = -(-num_params // n)
    updates = [rng.normal(0, 0.01, num_params) for _ in range(clients)]
    enc = BlockEncryptor(public)
    _, offline = timed(lambda: enc.precompute(blocks))
    packed, online = timed(lambda: enc.encrypt(updates[0]))
    result = {
        "encrypt_offline_values_per_s": num_params / offline,
        "encrypt_online_values_per_s": num_params / online,
        "encrypt_values_per_s": num_params / (offline + online),
        "bytes_per_param": sum(len(b) for b in packed.values()) / num_params,
    }
    cores = workers or os.cpu_count() or 1
    if cores > 1:
        multi = BlockEncryptor(public, workers=cores)
        multi.precompute(4 * cores)  # start the worker processes outside the timing
        multi.encrypt(np.zeros(4 * cores * n))
        _, offline_all = timed(lambda: multi.precompute(blocks))
        _, online_all = timed(lambda: multi.encrypt(updates[0]))
        multi.close()
        result["encrypt_all_cores_values_per_s"] = num_params / (offline_all + online_all)
        result["cores"] = float(cores)
    pushes = [packed] + [enc.encrypt(u) for u in updates[1:]]
    sums = {b: CiphertextSum(public) for b in range(blocks)}

    def ingest() -> None:
        for push in pushes:
            items = sorted(push.items())
            for start in range(0, len(items), _MESSAGE_BLOCKS):
                batch = items[start : start + _MESSAGE_BLOCKS]
                rows = unpack_blocks(public, [data for _, data in batch])
                for (b, _), row in zip(batch, rows, strict=True):
                    sums[b].add(row)

    _, ingest_s = timed(ingest)
    result["shard_ingest_values_per_s"] = clients * num_params / ingest_s
    decrypted, decrypt_s = timed(
        lambda: np.concatenate([keys.decrypt(sums[b].coefficients) for b in range(blocks)])
    )
    result["decrypt_values_per_s"] = num_params / decrypt_s
    expected = np.sum(updates, axis=0)
    result["sum_max_abs_error"] = float(np.abs(decrypted[:num_params] - expected).max())
    return result


def measure_tenseal(num_params: int, *, clients: int = 2) -> dict[str, float]:
    """The same measurements for TenSEAL's default CKKS vectors (one thread)."""
    with _quiet_stdout():
        return _measure_tenseal(num_params, clients)


def _measure_tenseal(num_params: int, clients: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    ctx = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree=8192,
        coeff_mod_bit_sizes=[60, 40, 40, 60],
        n_threads=1,
    )
    ctx.global_scale = 2**40
    public = ts.context_from(ctx.serialize(save_secret_key=False))
    updates = [rng.normal(0, 0.01, num_params) for _ in range(clients)]
    first, encrypt_s = timed(lambda: ts.ckks_vector(public, updates[0].tolist()).serialize())
    wires = [first] + [ts.ckks_vector(public, u.tolist()).serialize() for u in updates[1:]]

    def ingest() -> Any:
        total = ts.ckks_vector_from(public, wires[0])
        for wire in wires[1:]:
            total = total + ts.ckks_vector_from(public, wire)
        return total.serialize()

    summed, ingest_s = timed(ingest)
    decrypted, decrypt_s = timed(lambda: np.array(ts.ckks_vector_from(ctx, summed).decrypt()))
    expected = np.sum(updates, axis=0)
    return {
        "encrypt_values_per_s": num_params / encrypt_s,
        "bytes_per_param": len(first) / num_params,
        "shard_ingest_values_per_s": clients * num_params / ingest_s,
        "decrypt_values_per_s": num_params / decrypt_s,
        "sum_max_abs_error": float(np.abs(decrypted[:num_params] - expected).max()),
    }


def measure_plain(num_params: int, *, clients: int = 2) -> dict[str, float]:
    """The plaintext floor: float64 blocks, summed in numpy."""
    rng = np.random.default_rng(0)
    context = PlainContext(CkksParams().values_per_block)
    updates = [rng.normal(0, 0.01, num_params) for _ in range(clients)]
    packed, encode_s = timed(lambda: context.encrypt(updates[0]))
    pushes = [packed] + [context.encrypt(u) for u in updates[1:]]

    def ingest() -> None:
        acc = np.zeros((len(packed), context.values_per_block))
        for push in pushes:
            acc += context.unpack_blocks([push[b] for b in range(len(packed))])

    _, ingest_s = timed(ingest)
    return {
        "encrypt_values_per_s": num_params / encode_s,
        "bytes_per_param": sum(len(b) for b in packed.values()) / num_params,
        "shard_ingest_values_per_s": clients * num_params / ingest_s,
    }


def decryption_error(keys: SecretContext, *, updates: int = 100, scale: float = 1.0) -> float:
    """Max |decrypted sum - exact sum| over one block after summing ``updates`` updates.

    Relative to the update scale (the largest |value| of one update).
    """
    rng = np.random.default_rng(1)
    public = keys.public
    n = public.params.values_per_block
    enc = BlockEncryptor(public)
    values = rng.uniform(-scale, scale, (updates, n))
    total = CiphertextSum(public)
    for row in values:
        total.add_packed(enc.encrypt_block(row))
    error = np.abs(keys.decrypt(total.coefficients) - values.sum(axis=0)).max()
    return float(error / scale)


def wire_error(keys: SecretContext, *, ciphertexts: int = 2000, sums: int = 20) -> dict[str, float]:
    """The decryption error before and after the wire compression, against its bounds.

    In units of the scale, on the same encryptions of zero before and after compression.

    Over ``ciphertexts`` fresh encryptions of zero: the largest |error| of a value
    coefficient and of a canary, fresh (as drawn) and sent (compressed and expanded), and
    their standard deviations; over ``sums`` sums of ``max_clients = 100`` compressed
    encryptions, the largest |error| of a value. ``*_bound``: ``13 sigma`` of the
    sub-Gaussian proxies (:class:`crypto.params.CkksParams`) that the canary check and the
    precision rest on.
    """
    public, params = keys.public, keys.public.params
    contributors = 100

    def sent(rows: np.ndarray) -> np.ndarray:
        if public.compression.enabled:
            public.compression.compress(rows)  # in place
        return rows

    def errors(rows: np.ndarray) -> np.ndarray:
        """Value and canary coefficients of encryptions of zero: their errors."""
        values = keys.open(rows, noise_weight=1.0) * params.scale
        return np.concatenate([values, keys.canaries(rows).astype(np.float64)], axis=1)

    fresh = public.encrypt_zeros(ciphertexts)
    before, after = errors(fresh), errors(sent(fresh.copy()))
    sums_of = np.stack(
        [errors(sent(public.encrypt_zeros(contributors))).sum(axis=0) for _ in range(sums)]
    )
    v = params.values_per_block
    return {
        "fresh_value_max": float(np.abs(before[:, :v]).max()),
        "fresh_std": float(before[:, :v].std()),
        "sent_value_max": float(np.abs(after[:, :v]).max()),
        "sent_std": float(after[:, :v].std()),
        "sent_canary_max": float(np.abs(after[:, v:]).max()),
        "sent_canary_std": float(after[:, v:].std()),
        "sum_of_100_value_max": float(np.abs(sums_of[:, :v]).max()),
        "value_bound": params.error_bound(1) * params.scale,
        "canary_bound": float(TAIL_SIGMAS * np.sqrt(params.canary_noise_proxy)),
        "sum_of_100_bound": params.error_bound(contributors) * params.scale,
    }


def measure_noise(size: int, *, repeats: int = 7) -> dict[str, float]:
    """Gaussian values per second: the secure hardened draw against ``torch.normal``.

    The draw in float64 and in the float32 that DP-SGD adds to its gradients; medians of
    ``repeats`` alternating runs, so all three see the same machine load.
    """
    import torch

    source = SecureRandom()
    draws: dict[str, Callable[[], Any]] = {
        "secure": lambda: source.normal(1.0, size),
        "secure_float32": lambda: source.normal(1.0, size, dtype=np.float32),
        "torch": lambda: torch.normal(0.0, 1.0, size=(size,)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(repeats):
        for name, draw in draws.items():
            seconds[name].append(timed(draw)[1])
    median = {name: float(np.median(times)) for name, times in seconds.items()}
    return {
        "size": float(size),
        **{f"{name}_values_per_s": size / median[name] for name in draws},
        "slowdown": median["secure"] / median["torch"],
        "slowdown_float32": median["secure_float32"] / median["torch"],
    }
