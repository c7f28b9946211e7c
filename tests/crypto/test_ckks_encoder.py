"""The numpy CKKS encoder must agree with SEAL's slot order and scale exactly."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal.sealapi as seal
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto import BlockEncryptor, CkksParams, SecretContext, bitpack
from crypto.ckks_encoder import CkksEncoder
from fedps.errors import InvalidArgumentError

N = 2048


@pytest.fixture(scope="module")
def keys() -> SecretContext:
    return SecretContext.generate(
        CkksParams(poly_modulus_degree=N, coeff_modulus_bits=45, scale_bits=30)
    )


@settings(max_examples=30, deadline=None)
@given(
    blocks=st.integers(1, 4),
    magnitude=st.sampled_from([1e-4, 1.0, 8.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_encode_decode_round_trip(blocks: int, magnitude: float, seed: int) -> None:
    # Prepare
    encoder = CkksEncoder(N, 2.0**30, (1 << 45) - 55)
    values = np.random.default_rng(seed).uniform(-magnitude, magnitude, (blocks, N))
    # Execute
    decoded = encoder.decode(encoder.encode(values))
    # Assert: only the rounding to integers is lost (|error| <= N / 2 / scale, far less)
    assert np.abs(decoded - values).max() < 1e-7


def test_seal_decrypts_our_encoding(keys: SecretContext) -> None:
    """Our encoding added to a SEAL encryption of zero decrypts, with SEAL's decoder, to the
    values in the same order: the slot order (generator 3) and the scale match SEAL."""
    # Prepare
    values = np.random.default_rng(0).normal(0, 1, N)
    encryptor = BlockEncryptor(keys.public)
    # Execute
    decrypted = keys.decrypt(bitpack.unpack(encryptor.encrypt_block(values), 2 * N, 45))
    # Assert
    np.testing.assert_allclose(decrypted, values, atol=1e-4)


def test_seal_encoder_gives_the_same_polynomial(keys: SecretContext) -> None:
    # Prepare: SEAL's own encoding of the same slots, brought out of NTT form by decrypting
    # an encryption of it is noisy, so compare decodings of both plaintexts instead.
    values = np.random.default_rng(1).uniform(-1, 1, N)
    context = keys.public.seal_context
    plain = seal.Plaintext()
    seal.CKKSEncoder(context).encode(
        (values[: N // 2] + 1j * values[N // 2 :]).tolist(), 2.0**30, plain
    )
    ours = CkksEncoder(N, 2.0**30, keys.public.modulus)
    # Execute
    seal_slots = np.asarray(seal.CKKSEncoder(context).decode_complex(plain))
    seal_values = np.concatenate([seal_slots.real, seal_slots.imag])
    own = ours.decode(ours.encode(values[None, :]))[0]
    # Assert
    np.testing.assert_allclose(own, seal_values, atol=1e-6)


def test_encode_rejects_bad_input() -> None:
    encoder = CkksEncoder(N, 2.0**30, (1 << 45) - 55)
    with pytest.raises(InvalidArgumentError):
        encoder.encode(np.zeros((1, N - 1)))
    with pytest.raises(InvalidArgumentError):
        encoder.encode(np.full((1, N), np.nan))
    with pytest.raises(InvalidArgumentError, match="magnitude"):
        encoder.encode(np.full((1, N), 1e9))
    with pytest.raises(InvalidArgumentError):
        CkksEncoder(3000, 2.0**30, 97)


def test_zeros_are_used_once(keys: SecretContext) -> None:
    """Each encryption of zero encrypts exactly one block: two encryptions of the same values
    differ (fresh randomness), and the pool shrinks."""
    # Prepare
    encryptor = BlockEncryptor(keys.public)
    encryptor.precompute(3)
    # Execute
    first = encryptor.encrypt_block(np.zeros(N))
    second = encryptor.encrypt_block(np.zeros(N))
    # Assert
    assert first != second
    assert encryptor.pooled == 1
