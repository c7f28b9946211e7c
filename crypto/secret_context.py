"""The key holder's keys: the only place a CKKS secret key exists.

``SecretContext.generate`` makes a fresh key pair; ``save`` writes the secret key to a file
created with mode 0600 (never briefly readable by others) and the public context beside it;
``load`` refuses a secret-key file that group or others can read. Decryption takes the raw
coefficients of an *aggregate* ciphertext; the decryption policy that decides which
aggregates may be decrypted lives in the key holder (``server.keyholder.keyholder``).
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Any

import numpy as np
import tenseal.sealapi as seal

from crypto import _seal_io
from crypto.files import write_private
from crypto.params import CkksParams
from crypto.public_context import PublicContext, make_seal_context
from fedps.errors import FedPSError, InvalidArgumentError

__all__ = ["SecretContext"]

_log = logging.getLogger("fedps")

SECRET_KEY_FILE = "secret.key"
PUBLIC_CONTEXT_FILE = "public.ctx"


class SecretContext:
    """A key pair: the secret key plus its public context.

    Use :meth:`generate` or :meth:`load`; never send this object anywhere.
    """

    def __init__(self, public: PublicContext, secret_key: Any) -> None:
        self.public = public
        self._secret_key = secret_key
        self._decryptor = seal.Decryptor(public.seal_context, secret_key)
        self._encoder = seal.CKKSEncoder(public.seal_context)
        self._evaluator = seal.Evaluator(public.seal_context)

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
        """Write ``secret.key`` (mode 0600) and ``public.ctx`` into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(directory / SECRET_KEY_FILE, _seal_io.save_bytes(self._secret_key))
        write_private(directory / PUBLIC_CONTEXT_FILE, self.public.serialize())

    @classmethod
    def load(cls, directory: Path) -> SecretContext:
        """Load a key pair written by :meth:`save`.

        Raises
        ------
        FedPSError
            If the files are missing, readable by others, or do not belong together.
        """
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

    def decrypt(self, coeffs: np.ndarray) -> np.ndarray:
        """Decrypt one aggregate ciphertext given by its raw (coefficient-form) coefficients.

        Returns the N real values (real parts of the slots, then imaginary parts), float64.
        """
        cipher = self.public.ciphertext_from(coeffs)
        plain = seal.Plaintext()
        try:
            self._evaluator.transform_to_ntt_inplace(cipher)
            self._decryptor.decrypt(cipher, plain)
        except (RuntimeError, ValueError) as exc:  # e.g. a "transparent" ciphertext
            raise InvalidArgumentError(f"SEAL cannot decrypt this ciphertext: {exc}") from exc
        slots = np.asarray(self._encoder.decode_complex(plain), dtype=np.complex128)
        if slots.shape != (self.public.params.poly_modulus_degree // 2,):
            raise InvalidArgumentError("decoded slot count does not match the parameters")
        return np.concatenate([slots.real, slots.imag])
