"""Client side: encrypt a flat update vector into packed ciphertext blocks.

A vector of P values is cut into ``ceil(P / V)`` blocks of ``V = N - CANARIES`` values (the
last one padded with zeros). Block ``b`` places its values one per plaintext coefficient,
leaving the zero canaries (:mod:`crypto.ckks_encoder`). Encryption is SEAL's public-key encryption
split in two, as SEAL itself computes it: ``Enc(m) = Enc(0) + (m, 0)``.

- Offline: fresh encryptions of zero are drawn in bulk (:meth:`precompute`,
  :meth:`crypto.public_context.PublicContext.encrypt_zeros`, optionally on several processes)
  and kept in memory as raw coefficients; each is used exactly once.
- Online: blocks are encoded 64 at a time in numpy (:class:`crypto.ckks_encoder.CkksEncoder`),
  added to the first polynomial of their zero modulo q, rounded to the compressed wire form
  and bit-packed (:class:`crypto.compression.Compression`; the full form, ``ceil(log2 q)``
  bits per coefficient, where the parameters drop no bits).

Ciphertexts travel in coefficient (non-NTT) form; the key holder moves the sum back to NTT
form before decrypting. The shard adds blocks as integer arrays modulo q either way.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from crypto import bitpack
from crypto.blinding import Blinding
from crypto.ckks_encoder import CkksEncoder
from crypto.public_context import PublicContext
from crypto.zero_worker import ZeroWorker
from fedps.errors import InvalidArgumentError

__all__ = ["BlockEncryptor", "num_blocks"]

_ONLINE_CHUNK = 64  # blocks encoded, added and packed together


def num_blocks(num_values: int, values_per_block: int) -> int:
    """Blocks needed for ``num_values`` values."""
    return max(1, -(-num_values // values_per_block))


class BlockEncryptor:
    """Encrypts blocks of real values under a :class:`PublicContext`.

    Parameters
    ----------
    public
        The key holder's public context.
    workers
        Processes used to draw encryptions of zero (1: in this process).
    """

    def __init__(self, public: PublicContext, *, workers: int = 1) -> None:
        self.public = public
        self.workers = max(1, workers)
        self._encoder = CkksEncoder(public.params, public.modulus)
        self._compression = public.compression
        self._blinding = Blinding(public.params, public.modulus)
        self._q = np.uint64(public.modulus)
        self._pool: list[np.ndarray] = []
        self._pooled = 0
        self._lock = threading.Lock()
        self._workers: list[ZeroWorker] = []
        self._background: ZeroWorker | None = None
        self._pending: Future[np.ndarray] | None = None

    @property
    def pooled(self) -> int:
        """Encryptions of zero ready for use."""
        return self._pooled

    def precompute(self, blocks: int) -> None:
        """Draw encryptions of zero until at least ``blocks`` are ready.

        A background draw that is done counts.
        """
        self._collect_background(wait=False)
        missing = blocks - self._pooled
        if missing <= 0:
            return
        fresh = self._draw(missing)
        with self._lock:
            self._pool.append(fresh)
            self._pooled += len(fresh)

    def precompute_in_background(self, blocks: int) -> None:
        """Start drawing zeros for ``blocks`` blocks in a low-priority process; returns at once.

        The next :meth:`encrypt` uses them if they are ready (and draws any missing zeros
        itself), so the offline half of encryption overlaps with waiting and training instead
        of adding to a round.
        """
        self._collect_background(wait=False)
        missing = blocks - self._pooled
        if missing <= 0 or self._pending is not None:
            return
        if self._background is None:
            self._background = ZeroWorker(self.public.serialize(), low_priority=True)
        self._pending = self._background.submit(missing)

    def _collect_background(self, *, wait: bool = True) -> None:
        """Add the background draw to the pool (``wait=False``: only if it is already done)."""
        pending = self._pending
        if pending is None or (not wait and not pending.done()):
            return
        self._pending = None
        fresh = pending.result()
        with self._lock:
            self._pool.append(fresh)
            self._pooled += len(fresh)

    def _draw(self, count: int) -> np.ndarray:
        if self.workers == 1 or count < 2 * self.workers:
            return self.public.encrypt_zeros(count)
        if not self._workers:
            # processes of their own (python -m), not forks of this one with its gRPC threads
            context = self.public.serialize()
            self._workers = [ZeroWorker(context) for _ in range(self.workers)]
        shares = [count // self.workers + (i < count % self.workers) for i in range(self.workers)]
        draws = [w.submit(share) for w, share in zip(self._workers, shares, strict=True)]
        return np.concatenate([draw.result() for draw in draws])

    def close(self) -> None:
        """Stop the worker processes, if any."""
        for worker in [*self._workers, self._background]:
            if worker is not None:
                worker.close()
        self._workers, self._background = [], None
        self._pending = None

    def _take_zeros(self, count: int) -> np.ndarray:
        # Never wait on the low-priority worker: on a busy machine it may be starved. Draw
        # what is missing here instead; a late background draw joins the pool next time.
        self._collect_background(wait=False)
        self.precompute(count)
        with self._lock:
            stacked = np.concatenate(self._pool) if len(self._pool) > 1 else self._pool[0]
            taken, rest = stacked[:count], stacked[count:]
            self._pool = [rest] if len(rest) else []
            self._pooled = len(rest)
        return taken

    def encrypt_block(self, values: np.ndarray) -> bytes:
        """Encrypt exactly ``values_per_block`` values into one packed block."""
        n = self.public.params.values_per_block
        if values.shape != (n,):
            raise InvalidArgumentError(f"a block holds exactly {n} values, got {values.shape}")
        return self.encrypt(values)[0]

    def encrypt(
        self, vector: np.ndarray, blocks: list[int] | None = None, *, pad_seed: bytes = b""
    ) -> dict[int, bytes]:
        """Encrypt a flat vector; returns ``{block index: packed ciphertext}``."""
        return self.encrypt_with_coefficients(vector, blocks, pad_seed=pad_seed)[0]

    def encrypt_with_coefficients(
        self, vector: np.ndarray, blocks: list[int] | None = None, *, pad_seed: bytes = b""
    ) -> tuple[dict[int, bytes], np.ndarray]:
        """Encrypt a flat vector; returns the packed blocks and their coefficients.

        The coefficients are what the blocks expand to: the ciphertexts the client commits to
        and sketches.

        Parameters
        ----------
        vector
            The values (any float dtype), 1-D.
        blocks
            Only these block indices (default: all).
        pad_seed
            The round's pad seed the key holder gave this client (:mod:`crypto.blinding`):
            each block's pad is added to its ``c0`` before it is rounded. Empty: no pad (the
            key holder then cannot decrypt a sum of it; for tests and benchmarks).

        Raises
        ------
        InvalidArgumentError
            If a value is not finite, too large to encode, or a block index is out of range.
        """
        n = self.public.params.values_per_block
        flat = np.asarray(vector, dtype=np.float64).reshape(-1)
        total = num_blocks(flat.size, n)
        chosen = list(range(total)) if blocks is None else list(blocks)
        if any(not 0 <= b < total for b in chosen):
            raise InvalidArgumentError(f"block index out of range [0, {total})")
        padded = np.zeros(total * n, dtype=np.float64)
        padded[: flat.size] = flat
        values = padded.reshape(total, n)
        cipher = self._take_zeros(len(chosen))
        packed: list[bytes] = []
        # A chunk at a time: the temporaries of encoding and packing stay in cache.
        for start in range(0, len(chosen), _ONLINE_CHUNK):
            rows = chosen[start : start + _ONLINE_CHUNK]
            plain = self._encoder.encode(values[rows])
            c0 = cipher[start : start + len(rows), : self._encoder.n]
            np.add(c0, plain, out=c0)
            np.subtract(c0, self._q, out=c0, where=c0 >= self._q)
            if pad_seed:
                self._blinding.add(c0, pad_seed, rows)
            chunk = cipher[start : start + len(rows)]
            if self._compression.enabled:
                packed += self._compression.compress(chunk)  # rounds the chunk in place
            else:
                packed += bitpack.pack_rows(chunk, self.public.coeff_bits)
        return dict(zip(chosen, packed, strict=True)), cipher
