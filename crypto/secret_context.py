"""The key holder's keys: the only place a CKKS secret key exists.

``SecretContext.generate`` makes a fresh key pair; ``save`` writes the secret key to a file
created with mode 0600 (never briefly readable by others) and the public context beside it,
replacing a pair already there as one step (a key holder that rotates its keys and dies
half-way finds the old pair or the new one, never a secret key beside another's public
context); ``load`` refuses a secret-key file that group or others can read. Decryption takes
the raw coefficients of ciphertexts: :meth:`SecretContext.open` checks the zero canaries of every
block (:mod:`crypto.canary`) before it decrypts anything, and :meth:`SecretContext.canaries`
computes only the canaries (nothing of the values), which is how a failed block is traced
to the ciphertext that caused it. The decryption policy that decides which aggregates may be
decrypted lives in the key holder (``server.keyholder.keyholder``).

Decryption is ``c0 + c1 * s mod q`` in numpy with ``s`` in coefficient form
(:class:`crypto.rlwe.TernaryProduct`; SEAL's own decryptor where that is not exact).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tenseal.sealapi as seal

from crypto import _seal_io, rlwe
from crypto.canary import CanaryError, CanaryOpening, canary_bound, failing_rows
from crypto.ckks_encoder import CkksEncoder
from crypto.files import fsync_directory, write_private
from crypto.params import CkksParams
from crypto.public_context import PublicContext, make_seal_context
from fedps.errors import FedPSError, InvalidArgumentError

__all__ = ["CanaryError", "SecretContext"]

_log = logging.getLogger("fedps")

SECRET_KEY_FILE = "secret.key"
PUBLIC_CONTEXT_FILE = "public.ctx"
_STAGED = ".new"  # suffix of a pair written by save() and not yet in place


class SecretContext:
    """A key pair: the secret key plus its public context.

    Use :meth:`generate` or :meth:`load`; never send this object anywhere.
    """

    def __init__(self, public: PublicContext, secret_key: Any) -> None:
        self.public = public
        self._secret_key = secret_key
        self._decryptor = seal.Decryptor(public.seal_context, secret_key)
        self._evaluator = seal.Evaluator(public.seal_context)
        self._encoder = CkksEncoder(public.params, public.modulus)
        n, q = public.params.poly_modulus_degree, public.modulus
        secret = self._from_ntt(self._plain_coefficients(secret_key.data()))
        ternary = np.where(secret > q // 2, secret.astype(np.int64) - q, secret.astype(np.int64))
        self._product = rlwe.TernaryProduct(ternary, q) if rlwe.supported(n, q) else None
        # row k: coefficient canary_k of c1 * s is <c1, row k> (negacyclic: -s on wrapping)
        canaries = np.array(public.params.canary_positions)
        shift = (canaries[:, None] - np.arange(n)[None, :]) % n
        sign = np.where(np.arange(n)[None, :] <= canaries[:, None], 1, -1)
        self._canary_rows = (ternary[shift] * sign).astype(np.float64).T  # (N, K)
        self._canary_positions = canaries

    def __repr__(self) -> str:
        return f"SecretContext(context_id={self.public.context_id[:12]}..., secret=<hidden>)"

    @classmethod
    def generate(cls, params: CkksParams) -> SecretContext:
        """Generate a fresh key pair (no relinearisation or Galois keys)."""
        parms, context = make_seal_context(params)
        keygen = seal.KeyGenerator(context)
        public_key = seal.PublicKey()
        keygen.create_public_key(public_key)
        public = PublicContext(params, public_key, _seal=(parms, context))
        return cls(public, keygen.secret_key())

    def save(self, directory: Path) -> None:
        """Write ``secret.key`` (mode 0600) and ``public.ctx`` into ``directory``.

        They replace the pair there (whose secret key is then gone from the folder).

        Both files are staged beside their targets (``secret.key.new``, then
        ``public.ctx.new``), then renamed into place, the secret key first: that rename is
        the commit. :meth:`load` finishes or undoes a save that a crash interrupted, so
        the folder always holds one whole pair.

        Raises
        ------
        OSError
            A write failed (disk full): the pair in place is unchanged.
        """
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        secret, public = directory / SECRET_KEY_FILE, directory / PUBLIC_CONTEXT_FILE
        try:
            write_private(_staged(secret), _seal_io.save_bytes(self._secret_key))
            write_private(_staged(public), self.public.serialize())
        except OSError:
            _undo_staged(directory)
            raise
        os.replace(_staged(secret), secret)  # the commit: the new pair is the pair now
        fsync_directory(directory)
        _finish_staged(directory)

    @classmethod
    def load(cls, directory: Path) -> SecretContext:
        """Load a key pair written by :meth:`save`.

        Raises
        ------
        FedPSError
            If the files are missing, readable by others, or do not belong together.
        """
        _recover(directory)
        key_path = directory / SECRET_KEY_FILE
        ctx_path = directory / PUBLIC_CONTEXT_FILE
        if not key_path.exists() or not ctx_path.exists():
            raise FedPSError(f"no key pair in {directory} (expected {SECRET_KEY_FILE})")
        mode = stat.S_IMODE(key_path.stat().st_mode)
        if mode & 0o077:
            raise FedPSError(
                f"{key_path} is readable by group or others (mode {mode:o}); chmod 600 it"
            )
        public = PublicContext.from_bytes(ctx_path.read_bytes())
        secret_key = seal.SecretKey()
        _seal_io.load_into(secret_key, public.seal_context, key_path.read_bytes())
        return cls(public, secret_key)

    @classmethod
    def load_or_generate(cls, directory: Path, params: CkksParams) -> SecretContext:
        """Load the key pair in ``directory``, or generate and save one on first start."""
        _recover(directory)
        if (directory / SECRET_KEY_FILE).exists():
            keys = cls.load(directory)
            if keys.public.params != params:
                _log.warning(
                    "keys in %s use %s, not the configured %s; keeping the stored keys",
                    directory,
                    keys.public.params,
                    params,
                )
            return keys
        keys = cls.generate(params)
        keys.save(directory)
        _log.info("generated a new CKKS key pair in %s", directory)
        return keys

    def open(self, rows: np.ndarray, *, noise_weight: float) -> np.ndarray:
        """Decrypt ciphertexts ``rows`` after checking every canary of every one of them.

        ``rows`` are ``(B, 2N)`` raw coefficients that sum others with integer weights ``m_i``
        (``noise_weight = sum m_i^2``). Returns ``(B, values_per_block)`` values.

        Raises
        ------
        CanaryError
            If any canary exceeds :func:`crypto.canary.canary_bound`: nothing is decrypted.
        """
        rows = self._rows(rows)
        bound = canary_bound(self.public.params, noise_weight)
        failed = failing_rows(self.canaries(rows), bound)
        if failed:
            raise CanaryError(
                failed,
                f"{len(failed)} of {len(rows)} ciphertexts carry a change in c1 (a zero canary "
                f"exceeds the noise bound); nothing of them is decrypted",
            )
        return self._encoder.decode(self._decrypt_centred(rows))

    def decrypt(self, coeffs: np.ndarray) -> np.ndarray:
        """Decrypt one ciphertext given by its raw coefficients, without the canary check.

        The coefficients are in coefficient form. For tests and benchmarks; the key holder uses
        :meth:`open`.

        Returns its ``values_per_block`` values, float64.
        """
        values = self._encoder.decode(self._decrypt_centred(self._rows(coeffs[None])))
        one: np.ndarray = values[0]
        return one

    def canaries(self, rows: np.ndarray) -> np.ndarray:
        """The canary coefficients of the decryptions of ``rows``, centred, ``(B, K)`` int64.

        No other coefficient is computed.
        """
        rows = self._rows(rows)
        n = self.public.params.poly_modulus_degree
        return self._canaries(rows[:, n:], rows[:, self._canary_positions])

    def opened_canaries(self, openings: Sequence[CanaryOpening]) -> np.ndarray:
        """The canaries, ``(B, K)`` int64, of the ciphertexts whose openings are ``openings``.

        The :class:`~crypto.canary.CanaryOpening` are checked against their roots by the caller.
        This is the key holder's view of one client's ciphertext, which holds nothing of its values.
        """
        n, q = self.public.params.poly_modulus_degree, self.public.modulus
        for o in openings:
            if o.c1.shape != (n,) or o.c0_canaries.shape != (len(self._canary_positions),):
                raise InvalidArgumentError(f"an opening of N = {n} has N + K coefficients")
            if o.c1.dtype != np.uint64 or o.c0_canaries.dtype != np.uint64:
                raise InvalidArgumentError("an opening's coefficients are uint64")
            if int(o.c1.max()) >= q or int(o.c0_canaries.max()) >= q:
                raise InvalidArgumentError("a coefficient is not below the modulus")
        if not openings:
            return np.zeros((0, len(self._canary_positions)), dtype=np.int64)
        return self._canaries(
            np.stack([o.c1 for o in openings]), np.stack([o.c0_canaries for o in openings])
        )

    def _canaries(self, c1: np.ndarray, c0: np.ndarray) -> np.ndarray:
        """Canaries from ``c1`` (B, N) and ``c0`` at the canary positions (B, K), centred."""
        q = self.public.modulus
        limbs = [c1 & np.uint64(0x7FFFFF), c1 >> np.uint64(23)]
        # every limb is below 2^37 and s is ternary: the float64 products are exact integers
        low, high = (np.rint(limb.astype(np.float64) @ self._canary_rows) for limb in limbs)
        # recombined in Python integers: low + high * 2^23 may exceed both int64 and float64
        total = (
            low.astype(np.int64).astype(object)
            + high.astype(np.int64).astype(object) * (1 << 23)
            + c0.astype(object)
        ) % q
        centred = np.where(total > q // 2, total - q, total)
        return np.asarray(centred, dtype=np.int64)

    def _rows(self, rows: np.ndarray) -> np.ndarray:
        width = self.public.coeffs_per_block
        if rows.dtype != np.uint64 or rows.ndim != 2 or rows.shape[1] != width:
            raise InvalidArgumentError(f"expected (B, {width}) uint64 coefficients")
        if rows.size and int(rows.max()) >= self.public.modulus:
            raise InvalidArgumentError("a coefficient is not below the modulus")
        return rows

    def _decrypt_centred(self, rows: np.ndarray) -> np.ndarray:
        """``c0 + c1 * s mod q``, centred in (-q/2, q/2], shape (B, N) int64."""
        n, q = self.public.params.poly_modulus_degree, self.public.modulus
        if self._product is None:
            plain = np.stack([self._seal_decrypt(row) for row in rows]) if len(rows) else rows
        else:
            plain = (self._product.times(rows[:, n:]) + rows[:, :n].astype(np.int64)) % q
        plain = plain.astype(np.int64)
        out: np.ndarray = np.where(plain > q // 2, plain - q, plain)
        return out

    def _seal_decrypt(self, row: np.ndarray) -> np.ndarray:
        """SEAL's decryption of one ciphertext, its plaintext in coefficient form in [0, q)."""
        cipher = self.public.ciphertext_from(row)
        plain = seal.Plaintext()
        try:
            self._evaluator.transform_to_ntt_inplace(cipher)
            self._decryptor.decrypt(cipher, plain)
        except (RuntimeError, ValueError) as exc:  # e.g. a "transparent" ciphertext
            raise InvalidArgumentError(f"SEAL cannot decrypt this ciphertext: {exc}") from exc
        return self._from_ntt(self._plain_coefficients(plain))

    def _plain_coefficients(self, plain: Any) -> np.ndarray:
        """The N coefficients a SEAL plaintext holds (in whatever form it is in)."""
        body = _seal_io.uncompressed_body(_seal_io.save_bytes(plain))
        n = self.public.params.poly_modulus_degree
        return np.frombuffer(body, dtype="<u8", offset=len(body) - 8 * n).astype(np.uint64)

    def _from_ntt(self, poly: np.ndarray) -> np.ndarray:
        """An NTT-form polynomial in coefficient form.

        SEAL's inverse NTT, which it offers for ciphertexts only, applied to the ciphertext
        ``(poly, poly)``.
        """
        prefix = bytearray(self.public.ciphertext_prefix)
        prefix[32] = 1  # is_ntt_form (the prefix layout: crypto.public_context)
        data = bytes(prefix) + np.concatenate([poly, poly]).astype("<u8").tobytes()
        cipher = seal.Ciphertext()
        _seal_io.load_into(cipher, self.public.seal_context, _seal_io.with_header(data))
        self._evaluator.transform_from_ntt_inplace(cipher)
        body = _seal_io.uncompressed_body(_seal_io.save_bytes(cipher))
        n = self.public.params.poly_modulus_degree
        start = len(self.public.ciphertext_prefix)
        return np.frombuffer(body, dtype="<u8", offset=start, count=n).astype(np.uint64)


def _staged(path: Path) -> Path:
    """Where :meth:`SecretContext.save` stages ``path``."""
    return path.with_name(path.name + _STAGED)


def _recover(directory: Path) -> None:
    """Finish or undo a :meth:`SecretContext.save` that a crash interrupted.

    A staged secret key means the save never committed (the staged pair goes, the old pair stays); a
    staged public context alone means it committed (the new public context goes into place).
    """
    if _staged(directory / SECRET_KEY_FILE).exists():
        _log.warning(
            "%s: a key pair was being saved when the process stopped; keeping the pair in place",
            directory,
        )
        _undo_staged(directory)
    elif _staged(directory / PUBLIC_CONTEXT_FILE).exists():
        _log.warning("%s: completing a key pair saved when the process stopped", directory)
        _finish_staged(directory)


def _undo_staged(directory: Path) -> None:
    """Remove a staged pair that was never committed."""
    for name in (SECRET_KEY_FILE, PUBLIC_CONTEXT_FILE):
        _staged(directory / name).unlink(missing_ok=True)
    fsync_directory(directory)


def _finish_staged(directory: Path) -> None:
    """Rename a committed pair's staged public context into place."""
    public = directory / PUBLIC_CONTEXT_FILE
    os.replace(_staged(public), public)
    fsync_directory(directory)
