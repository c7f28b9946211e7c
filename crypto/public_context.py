"""The public half of the key holder's CKKS keys: what clients and shards may hold.

A ``PublicContext`` carries the encryption parameters and the public key, never the secret
key, relinearisation keys or Galois keys: addition-only aggregation needs none of them. Its
``serialize()`` bytes are what the key holder serves; ``PublicContext.from_bytes`` validates
them with SEAL before use. They carry the parameters, the wire compression included, so a
client and a shard of one run agree on the size and form of every block. ``context_id``
(SHA-256 of those bytes) names the key generation, so a shard can refuse blocks encrypted
under any other key.
"""

from __future__ import annotations

import hashlib
import struct
from functools import cached_property
from typing import Any

import numpy as np
import tenseal.sealapi as seal

from crypto import _seal_io, rlwe
from crypto.compression import Compression
from crypto.params import CkksParams
from crypto.rlwe import ZeroEncryptor
from fedps.errors import ConfigError, InvalidArgumentError

__all__ = ["PublicContext"]

_WIRE_MAGIC = b"FEDPSCTX1"
_LEN = struct.Struct("<I")
# parms_id (4 x u64), is_ntt_form (u8), size, N, coeff count, scale (f64), correction factor,
# then the coefficient array's own SEAL header and element count.
_CT_PREFIX_SIZE = 32 + 1 + 8 * 5 + _seal_io.HEADER_SIZE + 8
_MAX_PARAM_BYTES = 1 << 12
# N, log2 q and the scale's bits; then the dropped bits of c0 and c1, only when some are
# dropped; then those of c0's canaries, only when some are (a context keeps the shortest
# header that holds its parameters: one without compression the older one, and its id).
_HEADER_FIELDS = (3, 5, 6)
_FIELD = struct.Struct("<I")
_MAX_KEY_BYTES = 1 << 24


def make_seal_context(params: CkksParams) -> tuple[Any, Any]:
    """Build SEAL encryption parameters and a validated SEAL context for ``params``."""
    parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(params.poly_modulus_degree)
    parms.set_coeff_modulus(
        seal.CoeffModulus.Create(params.poly_modulus_degree, [params.coeff_modulus_bits])
    )
    context = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
    if not context.parameters_set():
        raise InvalidArgumentError(
            f"SEAL refused the parameters: {context.parameters_error_message()}"
        )
    return parms, context


class PublicContext:
    """Encryption parameters and public key of one key generation.

    Parameters
    ----------
    params
        The scheme parameters.
    public_key
        A SEAL ``PublicKey`` valid for ``params``.
    _seal
        SEAL's parameters and context for ``params`` (:func:`make_seal_context`), made by
        whoever builds the public context.
    """

    def __init__(self, params: CkksParams, public_key: Any, *, _seal: tuple[Any, Any]) -> None:
        self.params = params
        self._parms, self._context = _seal
        self._public_key = public_key

    @property
    def seal_context(self) -> Any:
        """The SEAL context (parameters only, no keys)."""
        return self._context

    @property
    def public_key(self) -> Any:
        """The SEAL public key."""
        return self._public_key

    @cached_property
    def modulus(self) -> int:
        """The coefficient modulus q."""
        return int(self._parms.coeff_modulus()[0].value())

    @property
    def coeff_bits(self) -> int:
        """Bits per coefficient on the wire: ``ceil(log2 q)``."""
        return self.modulus.bit_length()

    @property
    def coeffs_per_block(self) -> int:
        """Coefficients of one ciphertext: two polynomials of N coefficients."""
        return 2 * self.params.poly_modulus_degree

    @cached_property
    def compression(self) -> Compression:
        """The compressed wire form of a fresh ciphertext (:mod:`crypto.compression`)."""
        return Compression(self.params, self.modulus)

    @property
    def full_block_bytes(self) -> int:
        """Exact size of a block in the full form, ``ceil(log2 q)`` bits per coefficient.

        How any ciphertext can travel, a sum in particular (a shard's aggregate).
        """
        return self.coeffs_per_block * self.coeff_bits // 8

    @property
    def block_bytes(self) -> int:
        """Exact size of one fresh ciphertext block as a client sends it.

        Compressed where the parameters drop bits; otherwise the full form.
        """
        compression = self.compression
        return compression.block_bytes if compression.enabled else self.full_block_bytes

    @property
    def block_sizes(self) -> frozenset[int]:
        """The sizes a packed block may have: the full form and the compressed one."""
        return frozenset({self.full_block_bytes, self.block_bytes})

    @cached_property
    def ciphertext_prefix(self) -> bytes:
        """SEAL's serialised metadata of a fresh coefficient-form ciphertext of this context."""
        cipher = seal.Ciphertext()
        self._fresh_zero(cipher)
        body = _seal_io.uncompressed_body(_seal_io.save_bytes(cipher))
        if len(body) != _CT_PREFIX_SIZE + 8 * self.coeffs_per_block:
            raise InvalidArgumentError("unexpected SEAL ciphertext layout")
        return body[:_CT_PREFIX_SIZE]

    @cached_property
    def _zero_tools(self) -> tuple[Any, Any]:
        return seal.Encryptor(self._context, self._public_key), seal.Evaluator(self._context)

    def _fresh_zero(self, cipher: Any) -> None:
        """Fill ``cipher`` with a fresh public-key encryption of zero.

        Out of NTT form, at our scale.
        """
        encryptor, evaluator = self._zero_tools
        encryptor.encrypt_zero(cipher)
        evaluator.transform_from_ntt_inplace(cipher)
        cipher.scale = self.params.scale

    @cached_property
    def public_key_coefficients(self) -> np.ndarray:
        """The public key's two polynomials in coefficient form, shape (2, N), uint64."""
        key = seal.Ciphertext()
        _seal_io.load_into(key, self._context, _seal_io.save_bytes(self._public_key.data()))
        _, evaluator = self._zero_tools
        evaluator.transform_from_ntt_inplace(key)
        body = _seal_io.uncompressed_body(_seal_io.save_bytes(key))
        n = self.params.poly_modulus_degree
        coeffs = np.frombuffer(body, dtype="<u8", offset=len(body) - 8 * 2 * n)
        return coeffs.astype(np.uint64).reshape(2, n)

    @cached_property
    def _zero_encryptor(self) -> ZeroEncryptor | None:
        if not rlwe.supported(self.params.poly_modulus_degree, self.modulus):
            return None
        return ZeroEncryptor(self.public_key_coefficients, self.modulus)

    def encrypt_zeros(self, count: int) -> np.ndarray:
        """``count`` fresh encryptions of zero as raw coefficients, shape (count, 2N).

        SEAL's public-key encryption is ``Enc(m) = Enc(0) + (m, 0)``: adding an encoded
        plaintext to the first polynomial of a fresh ``Enc(0)`` *is* encryption. Each zero
        must be used for exactly one block. The zeros are SEAL's ``encrypt_zero`` computed in
        bulk (:class:`crypto.rlwe.ZeroEncryptor`) where that is exact (``N * q < 2^62``, the
        derived parameters), and by SEAL itself, one ciphertext at a time, otherwise.
        """
        bulk = self._zero_encryptor
        if bulk is not None:
            return bulk.draw(count)
        return self._encrypt_zeros_with_seal(count)

    def _encrypt_zeros_with_seal(self, count: int) -> np.ndarray:
        """Like :meth:`encrypt_zeros`, one SEAL ``encrypt_zero`` per ciphertext."""
        prefix = self.ciphertext_prefix
        out = np.empty((count, self.coeffs_per_block), dtype=np.uint64)
        cipher = seal.Ciphertext()
        for i in range(count):
            self._fresh_zero(cipher)
            body = _seal_io.uncompressed_body(_seal_io.save_bytes(cipher))
            if body[: len(prefix)] != prefix:
                raise InvalidArgumentError("ciphertext does not match the public context")
            out[i] = np.frombuffer(body, dtype="<u8", offset=len(prefix))
        return out

    def ciphertext_from(self, coeffs: np.ndarray) -> Any:
        """Rebuild a SEAL ciphertext from raw coefficients; SEAL validates it on load."""
        if coeffs.dtype != np.uint64 or coeffs.shape != (self.coeffs_per_block,):
            raise InvalidArgumentError("coefficient array has the wrong shape or type")
        data = _seal_io.with_header(self.ciphertext_prefix + coeffs.astype("<u8").tobytes())
        cipher = seal.Ciphertext()
        _seal_io.load_into(cipher, self._context, data)
        return cipher

    def serialize(self) -> bytes:
        """Serialise parameters and public key (never a secret key)."""
        parts = [
            _pack_header(_params_tuple(self.params)),
            _seal_io.save_bytes(self._parms),
            _seal_io.save_bytes(self._public_key),
        ]
        out = bytearray(_WIRE_MAGIC)
        for part in parts:
            out += _LEN.pack(len(part)) + part
        return bytes(out)

    @cached_property
    def context_id(self) -> str:
        """SHA-256 of the serialised public context: names this key generation."""
        return hashlib.sha256(self.serialize()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes) -> PublicContext:
        """Load and validate a serialised public context.

        Raises
        ------
        InvalidArgumentError
            If the bytes are not a valid public context.
        """
        if not data.startswith(_WIRE_MAGIC):
            raise InvalidArgumentError("not a fedps public context")
        parts: list[bytes] = []
        pos = len(_WIRE_MAGIC)
        for limit in (_FIELD.size * _HEADER_FIELDS[-1], _MAX_PARAM_BYTES, _MAX_KEY_BYTES):
            if pos + _LEN.size > len(data):
                raise InvalidArgumentError("public context is truncated")
            (size,) = _LEN.unpack_from(data, pos)
            pos += _LEN.size
            if size > limit or pos + size > len(data):
                raise InvalidArgumentError("public context has an invalid field size")
            parts.append(data[pos : pos + size])
            pos += size
        if pos != len(data):
            raise InvalidArgumentError("public context has trailing bytes")
        if len(parts[0]) not in [_FIELD.size * k for k in _HEADER_FIELDS]:
            raise InvalidArgumentError("public context header has the wrong size")
        read = [value for (value,) in _FIELD.iter_unpack(parts[0])]
        fields = (*read, *[0] * (_HEADER_FIELDS[-1] - len(read)))
        if _pack_header(fields) != parts[0]:  # one encoding per context: its id names it
            raise InvalidArgumentError("public context header is not canonical")
        try:
            params = CkksParams(*fields)
        except ConfigError as exc:
            raise InvalidArgumentError(f"public context has invalid parameters: {exc}") from exc
        parms, context = make_seal_context(params)
        sent = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
        _seal_io.load_plain(sent, parts[1])
        if [m.value() for m in sent.coeff_modulus()] != [m.value() for m in parms.coeff_modulus()]:
            raise InvalidArgumentError("public context parameters do not match its header")
        public_key = seal.PublicKey()
        _seal_io.load_into(public_key, context, parts[2])
        return cls(params, public_key, _seal=(parms, context))


def _params_tuple(params: CkksParams) -> tuple[int, ...]:
    return (
        params.poly_modulus_degree,
        params.coeff_modulus_bits,
        params.scale_bits,
        params.c0_drop_bits,
        params.c1_drop_bits,
        params.canary_drop_bits,
    )


def _pack_header(fields: tuple[int, ...]) -> bytes:
    """The shortest header of :data:`_HEADER_FIELDS` fields that leaves out only zeros."""
    count = next(k for k in _HEADER_FIELDS if not any(fields[k:]))
    return b"".join(_FIELD.pack(value) for value in fields[:count])
