"""Zero canaries: no decryption the key holder releases carries key material.

A ciphertext ``(c0, c1)`` decrypts to ``c0 + c1*s = m + e`` (``e`` the small encryption
error). If anyone, a client on its own ciphertext or a shard on an aggregate, adds ``t`` to
``c1``, the decryption becomes ``m + e + t*s``: released, it hands out ``t*s`` and, with
``t`` known to the attacker, the secret key ``s``. Commitments cannot stop a client that
commits to the changed bytes itself.

Every block reserves :data:`crypto.params.CANARIES` plaintext coefficients (evenly spaced,
public) that honest clients encode as 0. Coefficient ``j`` of ``t*s`` is
``sum_i +-t_i s_(j-i)``: a linear form in every coefficient of ``s``. The key holder computes
the canaries alone (``K`` coefficients, nothing of the values) and refuses to decrypt a
block if one of them exceeds :func:`canary_bound`, a bound that an honest sum's error
``e`` exceeds with probability below 2^-120.

Why it holds (docs/security.md states it with numbers):

- For any change with a coefficient ``|t_i| > 3b`` (``b`` the bound), each canary alone
  passes with probability at most 1/3 over the ternary ``s`` that the attacker does not know
  (fix every other coefficient of ``s``: the three values of ``s_(j-i)`` move the canary by
  ``|t_i|`` give or take the tiny ``e1`` term, so at most one lands within ``[-b, b]``).
  For a change with one term, or terms ``N/K`` apart, the ``K`` canaries depend on distinct
  coefficients of ``s``: all pass with probability ``3^-K`` = 2^-50.7.
- A change that passes for sure (``sum |t_i| <= b``) moves every coefficient by at most
  ``b``, the size of the honest error itself, which the flooding of released sums
  (:mod:`crypto.release`, ``2^flood_bits`` times the error bound) hides as it hides ``e``.

The bound: ``e = e_pk * u + e0 + e1 * s`` for one fresh encryption (SEAL's ``u`` ternary,
``e0, e1`` centred binomial of 21 + 21 bits, ``e_pk`` the public key's error). Each is a sum of
independent bounded terms, sub-Gaussian with variance proxy ``||e_pk||^2 <= 14 N`` (its mean
is 10.5 N), ``21`` and ``21 * wt(s) <= 21 N``, so ``35 N + 21`` in all; a ciphertext as a
client sends it adds ``r1 * s``, the rounding of ``c1`` on the wire (``|r1| <= 1`` by
default: ``N`` more), and ``rc``, the rounding of ``c0`` at the canaries to ``2^dc``
(:mod:`crypto.compression`; ``4^(dc - 1)`` = 1,024 more by default), so
``36 N + 21 + 4^(dc - 1)`` (:attr:`crypto.params.CkksParams.canary_noise_proxy`); a sum
weighted by integers ``m_i`` has ``sum m_i^2`` times that. Hoeffding:
``P(|e_j| > 13 sigma) <= 2 e^-84.5``.


The canaries of one client's ciphertext can be checked without anything of its values: its
:class:`CanaryOpening` (all of ``c1``, ``c0`` at the canary positions and a digest of the
rest of ``c0``) hashes to the root the client signed (:func:`crypto.signing.chunk_root`),
and ``c0`` at the value positions, the only place the values are, stays hidden. That is how
the key holder finds which client's ciphertext carries a change
(``server.keyholder.blame``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from crypto.params import CANARIES, TAIL_SIGMAS, CkksParams
from fedps.errors import InvalidArgumentError, PolicyError

__all__ = [
    "CANARY_SIGMAS",
    "CanaryError",
    "CanaryOpening",
    "canary_bound",
    "failing_rows",
    "opening_roots",
]

_ROOT_DOMAIN = b"fedps-root-v2"

#: The bound in sub-Gaussian standard deviations of an honest error.
CANARY_SIGMAS = TAIL_SIGMAS


class CanaryError(PolicyError):
    """A canary of a decryption exceeds the noise bound.

    The ciphertext carries a change in ``c1`` (or a client encoded something there). Nothing of it
    is released.

    Parameters
    ----------
    rows
        Indices, in the batch checked, of the ciphertexts that failed.
    message
        What failed, for the error.
    """

    def __init__(self, rows: list[int], message: str) -> None:
        super().__init__(message)
        self.rows = rows


def canary_bound(params: CkksParams, noise_weight: float) -> float:
    """The largest |canary| an honest sum ``sum m_i c_i`` may show.

    ``noise_weight`` = ``sum m_i^2``: 1 for one ciphertext, the contributor count for a synchronous
    round.
    """
    return CANARY_SIGMAS * math.sqrt(params.canary_noise_proxy * max(1.0, noise_weight))


def failing_rows(canaries: np.ndarray, bound: float) -> list[int]:
    """Rows of ``(B, K)`` centred canaries with any |value| above ``bound``."""
    if canaries.size == 0:
        return []
    return [int(r) for r in np.flatnonzero(np.abs(canaries).max(axis=1) > bound)]


@dataclass(frozen=True)
class CanaryOpening:
    """What shows one ciphertext's canaries and nothing of its values.

    A ciphertext's committed root (:meth:`root`) is the SHA-256 of three parts: ``c1``,
    ``c0`` at the canary positions, and ``c0`` elsewhere; the opening carries the first two
    and only the digest of the third, so the key holder can check that the parts are the
    committed ones and compute the canaries, while ``c0`` at the value positions (where the
    values are: ``c0 = m + e - c1*s``) stays hidden.

    Attributes
    ----------
    c1
        The ``N`` coefficients of ``c1`` (uint64).
    c0_canaries
        ``c0`` at the :data:`~crypto.params.CANARIES` canary positions (uint64).
    rest_digest
        SHA-256 of ``c0`` at every other position, in order (little-endian uint64).
    """

    c1: np.ndarray
    c0_canaries: np.ndarray
    rest_digest: bytes

    @classmethod
    def of(cls, row: np.ndarray) -> CanaryOpening:
        """The opening of a ciphertext given by its ``2N`` raw coefficients (uint64)."""
        n = _degree(row)
        step = n // CANARIES
        c0 = np.ascontiguousarray(row[:n], dtype="<u8")
        rest = hashlib.sha256()
        view = c0.data.cast("B")
        for start in range(0, n, step):  # the coefficients between two canaries
            rest.update(view[8 * (start + 1) : 8 * (start + step)])
        return cls(
            np.ascontiguousarray(row[n:], dtype=np.uint64),
            np.ascontiguousarray(row[:n:step], dtype=np.uint64),
            rest.digest(),
        )

    def root(self) -> bytes:
        """The commitment the client signed for this ciphertext."""
        if len(self.c1) % CANARIES or len(self.c0_canaries) != CANARIES:
            raise InvalidArgumentError("an opening has N coefficients of c1 and K canaries")
        if len(self.rest_digest) != 32:
            raise InvalidArgumentError("an opening's digest is 32 bytes")
        out = hashlib.sha256(_ROOT_DOMAIN)
        out.update(hashlib.sha256(self.c1.astype("<u8").tobytes()).digest())
        out.update(hashlib.sha256(self.c0_canaries.astype("<u8").tobytes()).digest())
        out.update(self.rest_digest)
        return out.digest()


def opening_roots(rows: np.ndarray) -> list[bytes]:
    """:meth:`CanaryOpening.root` of each ciphertext of ``rows``, without making the openings.

    ``rows`` are ``(B, 2N)`` raw coefficients (uint64). The same bytes are hashed in the same
    order as :meth:`CanaryOpening.of` and :meth:`CanaryOpening.root` hash them, from views of
    one little-endian copy of ``rows``: four digests per ciphertext.

    Parameters
    ----------
    rows
        The ciphertexts, one per row.

    Returns
    -------
    list of bytes
        The root of each row.
    """
    if rows.ndim != 2:
        raise InvalidArgumentError("ciphertexts are (B, 2N) uint64 coefficients")
    if not len(rows):
        return []
    n = _degree(rows[0])
    step = n // CANARIES
    data = np.ascontiguousarray(rows, dtype="<u8")
    c0 = data[:, :n].reshape(len(data), CANARIES, step)
    canaries = np.ascontiguousarray(c0[:, :, 0])
    rests = np.ascontiguousarray(c0[:, :, 1:]).reshape(len(data), -1)
    roots = []
    for c1, canary, rest in zip(data[:, n:], canaries, rests, strict=True):
        out = hashlib.sha256(_ROOT_DOMAIN)
        for part in (c1, canary, rest):
            out.update(hashlib.sha256(part.data).digest())
        roots.append(out.digest())
    return roots


def _degree(row: np.ndarray) -> int:
    if row.dtype != np.uint64 or row.ndim != 1 or len(row) % (2 * CANARIES):
        raise InvalidArgumentError("a ciphertext is 2N uint64 coefficients, N a multiple of K")
    return len(row) // 2
