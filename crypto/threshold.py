"""Threshold CKKS: no single party holds the secret key (Mouchet et al., PETS 2021).

P key-holder parties replace the one key holder. Everything here is a pure function over the
raw RLWE representation fedps already computes on (:mod:`crypto.rlwe`: coefficient form,
one prime q); the parties exchange only what these functions return.

**Collective key generation from a common random string.** The parties agree on a seed; the
common polynomial ``a`` is expanded from it (:func:`common_polynomial`, SHAKE-256, uniform
modulo q by rejection). Party ``i`` draws its secret ``s_i`` uniform ternary, as SEAL draws
a secret key, and an error ``e_i`` from SEAL's centred binomial distribution, and publishes
``b_i = -a s_i + e_i`` (:func:`draw_party_key`). The joint public key ``(sum b_i, a)`` is an
RLWE public key for ``s = sum s_i`` with error ``sum e_i``: written in SEAL's format
(:func:`joint_public_context`), clients encrypt under it with the unchanged client code.

**T-of-P sharing.** Party ``i`` deals Shamir shares of ``s_i`` modulo q
(:func:`deal`): a random polynomial ``f_i`` of degree ``T - 1`` over ``R_q`` with
``f_i(0) = s_i``, ``f_i(j)`` to party ``j``; party ``j`` keeps ``sh_j = sum_i f_i(j)``
(:func:`gather`) and forgets ``s_i``. Any ``T`` shares interpolate ``s`` at 0, fewer say
nothing of it (each is uniform modulo q). ``T = P`` is P-of-P: every party is needed.

**Distributed decryption with flooding.** For a set ``S`` of ``T`` parties, party ``j``
returns ``d_j = c1 (lambda_j sh_j) + e'_j`` (:func:`partial_decryption`), ``lambda_j`` its
Lagrange coefficient at 0 for ``S`` (:func:`lagrange_coefficients`) and ``e'_j`` a rounded
Gaussian of std :func:`flooding_std`, drawn from the CSPRNG *after* the weighting: weighted
afterwards, ``lambda_j e'_j`` would be uniform modulo q (``lambda_j`` is as large as q). The
combiner computes ``c0 + sum d_j = m + e + sum e'_j`` (:func:`combine`) and decodes it as
the single key holder does. The flooding of each party alone hides the aggregate's error
``e`` (a coalition knows its own ``e'``): docs/crypto.md derives its size.
"""

from __future__ import annotations

import hashlib
import math
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tenseal.sealapi as seal

from crypto import _seal_io, rlwe
from crypto.files import write_private
from crypto.params import TAIL_SIGMAS, CkksParams, fresh_noise_proxy, rounding_proxy
from crypto.public_context import PublicContext, make_seal_context
from crypto.randomness import SecureRandom
from fedps.errors import FedPSError, InvalidArgumentError

__all__ = [
    "KeyShare",
    "PartyKey",
    "aggregate_digest",
    "combine",
    "common_polynomial",
    "deal",
    "draw_party_key",
    "flood",
    "flooding_std",
    "gather",
    "joint_public_context",
    "joint_public_key",
    "joint_value_bound",
    "lagrange_coefficients",
    "partial_decryption",
    "prepare_digest",
    "request_digest",
    "weighted_share",
]

_CRS_DOMAIN = b"fedps-threshold-crs-v1"
_AGGREGATE_DOMAIN = b"fedps-threshold-aggregate-v1"
_REQUEST_DOMAIN = b"fedps-threshold-request-v1"
_PREPARE_DOMAIN = b"fedps-threshold-prepare-v1"
_SHARE_MAGIC = b"FEDPSKSH1"
_SHARE_HEADER = struct.Struct("<IIIQ")  # party index, threshold T, parties P, N; then q
_NTT_FLAG = 32  # offset of is_ntt_form in a serialised ciphertext (crypto.public_context)


# --------------------------------------------------------------------------- key generation


def common_polynomial(seed: bytes, n: int, modulus: int) -> np.ndarray:
    """The common random polynomial ``a`` of ``seed``: ``(N,)`` uint64 uniform in ``[0, q)``.

    SHAKE-256 in counter mode, each 8-byte word masked to ``ceil(log2 q)`` bits and kept when
    below q: every party that knows the seed derives the same ``a``.
    """
    if len(seed) < 16:
        raise InvalidArgumentError("a common seed has at least 16 bytes")
    counter = 0

    def stream(size: int) -> bytes:
        nonlocal counter
        counter += 1
        block = hashlib.shake_256(_CRS_DOMAIN + seed + counter.to_bytes(8, "little"))
        return block.digest(size)

    out: np.ndarray = rlwe.uniform(1, n, modulus, stream)[0]
    return out


@dataclass(frozen=True)
class PartyKey:
    """What one party draws in the collective key generation.

    Attributes
    ----------
    secret
        ``s_i``, uniform ternary, ``(N,)`` int64: dealt with :func:`deal`, then forgotten.
    public_share
        ``b_i = -a s_i + e_i mod q``, ``(N,)`` uint64: published to the other parties.
    """

    secret: np.ndarray
    public_share: np.ndarray


def draw_party_key(common: np.ndarray, modulus: int) -> PartyKey:
    """Draw ``s_i`` and ``e_i`` (SEAL's distributions) and the public share ``b_i``."""
    n = common.shape[-1]
    secret = rlwe.ternary(1, n)[0]
    product = rlwe.TernaryProduct(secret, modulus).times(common[None])[0]
    share = (rlwe.cbd21((n,)) - product) % modulus
    return PartyKey(secret.astype(np.int64), share.astype(np.uint64))


def joint_public_key(common: np.ndarray, shares: Sequence[np.ndarray], modulus: int) -> np.ndarray:
    """``(sum b_i, a)``, shape ``(2, N)`` uint64: the public key of ``s = sum s_i``."""
    if not shares:
        raise InvalidArgumentError("a joint key needs at least one public share")
    total = np.zeros_like(common, dtype=np.uint64)
    for share in shares:
        _check_poly(share, common.shape[-1], modulus)
        total = (total + share) % np.uint64(modulus)
    return np.stack([total, common])


def joint_public_context(params: CkksParams, public_key: np.ndarray) -> PublicContext:
    """The public context of a joint key ``(b, a)`` in coefficient form, in SEAL's format.

    Its :meth:`~crypto.PublicContext.serialize` bytes are those of a key SEAL made: the key's
    metadata come from a throwaway SEAL key of the same parameters, its polynomials are moved
    into NTT form by SEAL, and SEAL's ``load`` validates the result.
    """
    parms, context = make_seal_context(params)
    n = params.poly_modulus_degree
    modulus = int(parms.coeff_modulus()[0].value())
    for poly in public_key:
        _check_poly(poly, n, modulus)
    template = seal.PublicKey()
    seal.KeyGenerator(context).create_public_key(template)
    body = _seal_io.uncompressed_body(_seal_io.save_bytes(template))
    prefix = bytearray(body[: len(body) - 8 * 2 * n])
    prefix[_NTT_FLAG] = 0  # the coefficients below are in coefficient form
    cipher = seal.Ciphertext()
    data = bytes(prefix) + public_key.astype("<u8").tobytes()
    _seal_io.load_into(cipher, context, _seal_io.with_header(data))
    seal.Evaluator(context).transform_to_ntt_inplace(cipher)
    key = seal.PublicKey()
    _seal_io.load_into(key, context, _seal_io.save_bytes(cipher))
    return PublicContext(params, key, _seal=(parms, context))


# --------------------------------------------------------------------------- sharing


def deal(
    secret: np.ndarray, modulus: int, *, threshold: int, parties: int
) -> dict[int, np.ndarray]:
    """Shamir shares ``f(j)``, ``j = 1..P``, of ``secret`` (``(N,)``, ints) modulo q.

    ``f(x) = secret + sum_k r_k x^k`` with ``T - 1`` polynomials ``r_k`` uniform modulo q from
    the CSPRNG: any ``T`` shares interpolate ``secret``, any ``T - 1`` are uniform.
    """
    _check_threshold(threshold, parties, modulus)
    n = secret.shape[-1]
    base = (secret.astype(np.int64) % modulus).astype(np.uint64)
    coefficients = [base, *rlwe.uniform(threshold - 1, n, modulus)]
    shares = {}
    q = np.uint64(modulus)
    for j in range(1, parties + 1):
        value = np.zeros(n, dtype=np.uint64)
        for coefficient in reversed(coefficients):  # Horner: value * j stays below 2^63
            value = (value * np.uint64(j) + coefficient) % q
        shares[j] = value
    return shares


def gather(dealt: Sequence[np.ndarray], modulus: int) -> np.ndarray:
    """Party ``j``'s share ``sh_j = sum_i f_i(j) mod q`` of the ``f_i(j)`` it was dealt."""
    if not dealt:
        raise InvalidArgumentError("a share gathers at least one dealt value")
    total = np.zeros(dealt[0].shape, dtype=np.uint64)
    for value in dealt:
        _check_poly(value, dealt[0].shape[-1], modulus)
        total = (total + value) % np.uint64(modulus)
    return total


def lagrange_coefficients(indices: Sequence[int], modulus: int) -> dict[int, int]:
    """``lambda_j = prod_{k != j} k / (k - j) mod q`` for the parties ``indices``.

    So that ``sum_j lambda_j f(j) = f(0)`` for any polynomial ``f`` of degree below
    ``len(indices)``.
    """
    if len(set(indices)) != len(indices) or any(not 0 < j < modulus for j in indices):
        raise InvalidArgumentError(f"party indices are distinct and in [1, q): {list(indices)}")
    out = {}
    for j in indices:
        num, den = 1, 1
        for k in indices:
            if k != j:
                num, den = num * k % modulus, den * (k - j) % modulus
        out[j] = num * pow(den, -1, modulus) % modulus
    return out


@dataclass(frozen=True)
class KeyShare:
    """One party's share of the joint secret key: all it keeps, nothing that decrypts alone.

    Attributes
    ----------
    index
        The party's index ``j`` in ``1..P``.
    threshold
        T: how many parties decrypt together.
    parties
        P: how many hold shares.
    modulus
        The prime q.
    share
        ``sh_j``, ``(N,)`` uint64 in ``[0, q)``.
    """

    index: int
    threshold: int
    parties: int
    modulus: int
    share: np.ndarray

    def __post_init__(self) -> None:
        _check_threshold(self.threshold, self.parties, self.modulus)
        if not 1 <= self.index <= self.parties:
            raise InvalidArgumentError(f"party index {self.index} is not in [1, {self.parties}]")
        _check_poly(self.share, self.share.shape[-1], self.modulus)

    def __repr__(self) -> str:
        return f"KeyShare(party={self.index}, {self.threshold}-of-{self.parties}, share=<hidden>)"

    def save(self, path: Path) -> None:
        """Write the share to ``path``, mode 0600 from its creation, atomically."""
        header = _SHARE_HEADER.pack(self.index, self.threshold, self.parties, self.share.size)
        modulus = self.modulus.to_bytes(8, "little")
        payload = _SHARE_MAGIC + header + modulus + self.share.astype("<u8").tobytes()
        write_private(path, payload + hashlib.sha256(payload).digest())

    @classmethod
    def load(cls, path: Path) -> KeyShare:
        """Read a share written by :meth:`save`.

        Raises
        ------
        FedPSError
            The file is readable by group or others, damaged, or not a share.
        """
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise FedPSError(f"{path} is readable by group or others (mode {mode:o}); chmod 600 it")
        data = path.read_bytes()
        payload, digest = data[:-32], data[-32:]
        start = len(_SHARE_MAGIC)
        fixed = start + _SHARE_HEADER.size + 8
        if not payload.startswith(_SHARE_MAGIC) or hashlib.sha256(payload).digest() != digest:
            raise FedPSError(f"{path} is not a key share, or it is damaged")
        index, threshold, parties, n = _SHARE_HEADER.unpack_from(payload, start)
        if len(payload) != fixed + 8 * n:
            raise FedPSError(f"{path} is not a key share, or it is damaged")
        modulus = int.from_bytes(payload[fixed - 8 : fixed], "little")
        share = np.frombuffer(payload, dtype="<u8", offset=fixed).astype(np.uint64)
        try:
            return cls(index, threshold, parties, modulus, share)
        except InvalidArgumentError as exc:
            raise FedPSError(f"{path}: {exc}") from exc


# --------------------------------------------------------------------------- decryption


def joint_value_bound(params: CkksParams, noise_weight: float, parties: int) -> float:
    """Proven bound on ``|e|`` of one coefficient of a sum under a joint key, in coefficients.

    As :meth:`crypto.params.CkksParams.error_bound` (``sum m_i^2 = noise_weight``, tail
    2^-120), with each further party's key error (``||e_i||^2 <= 14 N``) and share of the
    secret (``||s||^2 <= P N``: ``e1 s`` and ``r1 s`` grow with it) in the proxy:
    ``value_noise_proxy + (P - 1) (35 N + N 4^(d1 - 1))``.
    """
    proxy = params.value_noise_proxy + _joint_extra(params, parties)
    return TAIL_SIGMAS * math.sqrt(proxy * max(1.0, noise_weight))


def joint_canary_bound(params: CkksParams, noise_weight: float, parties: int) -> float:
    """The largest ``|canary|`` of an honest sum under a joint key, in coefficients.

    :func:`crypto.canary.canary_bound` with the joint key's extra proxy (as
    :func:`joint_value_bound`); ``noise_weight`` is ``sum m_i^2`` of the sum's integer weights.
    """
    proxy = params.canary_noise_proxy + _joint_extra(params, parties)
    return TAIL_SIGMAS * math.sqrt(proxy * max(1.0, noise_weight))


def _joint_extra(params: CkksParams, parties: int) -> float:
    """The proxy each party beyond the first adds: its key error and its share of ``s``."""
    n = params.poly_modulus_degree
    return (parties - 1) * (fresh_noise_proxy(n) - 21.0 + n * rounding_proxy(params.c1_drop_bits))


def flooding_std(
    params: CkksParams, noise_weight: float, *, parties: int, lambda_bits: int
) -> float:
    """Each party's flooding std, in coefficients: ``2^(lambda - 1)`` times the error bound.

    Against the honest party's partial, a coalition's view differs from a simulation that
    knows only the released sum by the aggregate's error ``e``, ``|e| <= B``
    (:func:`joint_value_bound`). Shifted by at most ``B``, a Gaussian of std ``sigma`` is
    within KL divergence ``B^2 / (2 sigma^2)`` of itself, statistical distance
    ``B / (2 sigma)`` (Pinsker): ``2^-lambda`` per released coefficient at
    ``sigma = 2^(lambda - 1) B``; over ``M`` coefficients the divergences add,
    ``sqrt(M) 2^-lambda`` (docs/crypto.md, *Threshold decryption*).
    """
    if lambda_bits < 1:
        raise InvalidArgumentError(f"lambda_bits is at least 1, got {lambda_bits}")
    return 2.0 ** (lambda_bits - 1) * joint_value_bound(params, noise_weight, parties)


def partial_decryption(
    share: KeyShare, c1: np.ndarray, *, participants: Sequence[int], sigma: float
) -> np.ndarray:
    """``d_j = c1 (lambda_j sh_j) + e'_j mod q`` for ``c1`` of shape ``(B, N)``, uint64.

    ``participants`` are the ``T`` parties that decrypt together (``share``'s among them);
    ``e'_j`` is a rounded Gaussian of std ``sigma`` (:func:`flooding_std`) from the CSPRNG,
    added after the Lagrange weighting. The reference computation (numpy's FFT, the noise
    drawn now); a party computes the same with :class:`crypto.partial_decryptor.PartialDecryptor`.

    Raises
    ------
    InvalidArgumentError
        The participants are not ``T`` distinct parties including this one, or ``c1`` is not
        ``(B, N)`` below q.
    """
    weighted = weighted_share(share, participants)
    n, q = share.share.size, share.modulus
    if c1.dtype != np.uint64 or c1.ndim != 2 or c1.shape[1] != n:
        raise InvalidArgumentError(f"expected (B, {n}) uint64 coefficients of c1")
    if c1.size and int(c1.max()) >= q:
        raise InvalidArgumentError("a coefficient is not below the modulus")
    product = rlwe.RingProduct(weighted, q).times(c1)
    return flood(product, SecureRandom().normal(sigma, c1.shape), q)


def weighted_share(share: KeyShare, participants: Sequence[int]) -> np.ndarray:
    """``lambda_j sh_j mod q``, ``(N,)`` uint64: party ``j``'s share for ``participants``.

    Raises
    ------
    InvalidArgumentError
        The participants are not ``T`` distinct parties including this one.
    """
    if len(participants) != share.threshold or share.index not in participants:
        raise InvalidArgumentError(
            f"a {share.threshold}-of-{share.parties} decryption takes {share.threshold} "
            f"parties, party {share.index} among them; got {sorted(participants)}"
        )
    if any(not 1 <= j <= share.parties for j in participants):
        raise InvalidArgumentError(f"party indices are in [1, {share.parties}]")
    q = share.modulus
    weight = lagrange_coefficients(participants, q)[share.index]
    out: np.ndarray = (share.share.astype(object) * weight % q).astype(np.uint64)
    return out


def flood(product: np.ndarray, noise: np.ndarray, modulus: int) -> np.ndarray:
    """``product + round(noise) mod q``, uint64: a partial decryption's flooding added."""
    rounded = np.rint(noise).astype(np.int64) % modulus
    out: np.ndarray = (product + rounded.astype(np.uint64)) % np.uint64(modulus)
    return out


def combine(c0: np.ndarray, partials: Sequence[np.ndarray], modulus: int) -> np.ndarray:
    """``c0 + sum d_j mod q``, centred in (-q/2, q/2], ``(B, N)`` int64: the plaintexts.

    Decode with :class:`crypto.ckks_encoder.CkksEncoder` as a single key holder's decryption.
    """
    q = np.uint64(modulus)
    total = c0.astype(np.uint64) % q
    for partial in partials:
        if partial.shape != c0.shape:
            raise InvalidArgumentError(f"a partial has shape {partial.shape}, not {c0.shape}")
        total = (total + partial.astype(np.uint64) % q) % q
    plain = total.astype(np.int64)
    out: np.ndarray = np.where(plain > modulus // 2, plain - modulus, plain)
    return out


def aggregate_digest(blocks: Sequence[int], rows: np.ndarray) -> bytes:
    """SHA-256 of an aggregate: its block indices and every coefficient of each block, in order.

    ``rows`` are ``(B, 2N)`` uint64, one per block of ``blocks``. A party decrypts only an
    aggregate whose digest the combiner signed and the shards' own sums have.
    """
    if rows.ndim != 2 or len(rows) != len(blocks) or rows.dtype != np.uint64:
        raise InvalidArgumentError("an aggregate is (B, 2N) uint64, one row per block")
    out = hashlib.sha256(_AGGREGATE_DOMAIN)
    out.update(struct.pack(f"<{len(blocks)}I", *blocks))
    out.update(np.ascontiguousarray(rows, dtype="<u8").tobytes())
    return out.digest()


def request_digest(
    round_: int, contributors: Sequence[str], participants: Sequence[int], aggregate: bytes
) -> bytes:
    """What the combiner signs to ask for partial decryptions of one round's aggregate.

    The round, its sorted contributor set, the decrypting parties and :func:`aggregate_digest`.
    """
    return _signed_round(_REQUEST_DOMAIN, round_, contributors, participants, aggregate)


def prepare_digest(round_: int, contributors: Sequence[str], participants: Sequence[int]) -> bytes:
    """What the combiner signs to have ``participants`` prepare a round before it is verified.

    A prepared party fetches and hashes the round's aggregate and computes its products ahead
    (:meth:`server.keyholder.keyholder_party.KeyHolderParty.prepare`); it releases nothing of
    them. Another domain than :func:`request_digest`: no prepare signature is a request's.
    """
    return _signed_round(_PREPARE_DOMAIN, round_, contributors, participants, b"")


def _signed_round(
    domain: bytes,
    round_: int,
    contributors: Sequence[str],
    participants: Sequence[int],
    aggregate: bytes,
) -> bytes:
    """SHA-256 of ``domain``, the round, its sorted contributors, the parties and ``aggregate``."""
    out = hashlib.sha256(domain + struct.pack("<Q", round_))
    for client in sorted(contributors):
        name = client.encode()
        out.update(struct.pack("<I", len(name)) + name)
    out.update(struct.pack(f"<I{len(participants)}I", len(participants), *sorted(participants)))
    out.update(aggregate)
    return out.digest()


# --------------------------------------------------------------------------- checks


def _check_poly(poly: np.ndarray, n: int, modulus: int) -> None:
    if poly.shape != (n,) or poly.dtype != np.uint64:
        raise InvalidArgumentError(f"expected a uint64 polynomial of shape ({n},)")
    if int(poly.max(initial=0)) >= modulus:
        raise InvalidArgumentError("a coefficient is not below the modulus")


def _check_threshold(threshold: int, parties: int, modulus: int) -> None:
    if not 1 <= threshold <= parties < min(modulus, 1 << 16):
        raise InvalidArgumentError(
            f"a threshold T and P parties need 1 <= T <= P < 2^16, got T={threshold}, P={parties}"
        )
