"""Tests for the CKKS layer: encrypt -> add -> decrypt, wire sizes, validation and key hygiene.

Error tolerance
---------------
With the default parameters (N = 2048, one 45-bit prime q, scale 2**30) a decrypted fresh
ciphertext differs from its plaintext by the encryption noise divided by the scale. Measured
over 300 fresh blocks (614,400 values) the largest absolute error was 3.8e-5 (mean of the
per-block maxima 2.5e-5), the same for values of magnitude 1e-6, 1 and 16: the noise does not
depend on the message. Noise terms of a sum of K ciphertexts add (in the worst case linearly,
typically as sqrt(K)), so the tests allow ``K * 1e-4``: about 2.5 times the largest error
observed per fresh ciphertext, per ciphertext summed. float64 rounding of sums of at most
8 * 16 = 128 is below 1e-13 and does not matter.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crypto import (
    BlockEncryptor,
    CiphertextSum,
    CkksParams,
    PlainContext,
    PublicContext,
    SecretContext,
    _seal_io,
    bitpack,
    new_sum,
    num_blocks,
    pack_sums,
    unpack_block,
)
from crypto.files import FAULTS_VARIABLE
from crypto.params import CANARIES
from fedps.errors import ConfigError, FedPSError, InvalidArgumentError
from tests.crypto.context_parts import context_parts

N = 2048
V = N - CANARIES  # values per block
ERROR_PER_CIPHERTEXT = 1e-4
_MAGIC = b"FEDPSCTX1"


@pytest.fixture(scope="module")
def keys() -> SecretContext:
    return SecretContext.generate(CkksParams())


@pytest.fixture(scope="module")
def other_keys() -> SecretContext:
    return SecretContext.generate(CkksParams())


@pytest.fixture(scope="module")
def encryptor(keys: SecretContext) -> BlockEncryptor:
    return BlockEncryptor(keys.public)


# --------------------------------------------------------------------------- parameters


def test_default_parameters_and_block_size(keys: SecretContext, encryptor: BlockEncryptor) -> None:
    # Prepare
    public = keys.public
    values = np.linspace(-1.0, 1.0, V)

    # Execute
    block = encryptor.encrypt_block(values)

    # Assert: 2N coefficients of ceil(log2 q) = 45 bits each, no header.
    assert public.modulus.bit_length() == 45
    assert public.coeff_bits == 45
    assert public.coeffs_per_block == 2 * N
    assert public.block_bytes == 2 * N * 45 // 8 == 23040
    assert len(block) == public.block_bytes


@pytest.mark.parametrize(
    "kwargs",
    [
        {"poly_modulus_degree": 3000},
        {"coeff_modulus_bits": 55},  # over the 128-bit security bound at N = 2048
        {"coeff_modulus_bits": 19},
        {"scale_bits": 42},  # > coeff_modulus_bits - 4
        {"scale_bits": 9},
    ],
)
def test_params_reject_insecure_or_inconsistent_values(kwargs: dict[str, int]) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError):
        CkksParams(**kwargs)


# --------------------------------------------------------------------------- correctness


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    num_clients=st.integers(1, 8),
    magnitude=st.sampled_from([1e-6, 1e-3, 1.0, 16.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sum_of_encrypted_blocks_decrypts_to_plaintext_sum(
    keys: SecretContext,
    encryptor: BlockEncryptor,
    num_clients: int,
    magnitude: float,
    seed: int,
) -> None:
    # Prepare
    rng = np.random.default_rng(seed)
    updates = [rng.uniform(-magnitude, magnitude, V) for _ in range(num_clients)]
    total = CiphertextSum(keys.public)

    # Execute: clients encrypt, the shard validates and adds, the key holder decrypts.
    for update in updates:
        total.add_packed(encryptor.encrypt_block(update))
    decrypted = keys.decrypt(unpack_block(keys.public, total.packed()))

    # Assert
    expected = np.sum(updates, axis=0)
    assert decrypted.shape == (V,)
    assert np.max(np.abs(decrypted - expected)) <= num_clients * ERROR_PER_CIPHERTEXT


def test_fresh_ciphertext_error_is_well_within_tolerance(
    keys: SecretContext, encryptor: BlockEncryptor
) -> None:
    # Prepare
    values = np.random.default_rng(3).uniform(-16.0, 16.0, V)

    # Execute
    decrypted = keys.decrypt(unpack_block(keys.public, encryptor.encrypt_block(values)))

    # Assert: not exact (it is CKKS), but within the per-ciphertext budget.
    error = np.max(np.abs(decrypted - values))
    assert 0.0 < error <= ERROR_PER_CIPHERTEXT


def test_encrypt_vector_pads_last_block(keys: SecretContext, encryptor: BlockEncryptor) -> None:
    # Prepare
    vector = np.arange(V + 10, dtype=np.float32) / V

    # Execute
    blocks = encryptor.encrypt(vector)
    only_last = encryptor.encrypt(vector, blocks=[1])

    # Assert
    assert sorted(blocks) == [0, 1] and num_blocks(vector.size, V) == 2
    assert list(only_last) == [1]
    last = keys.decrypt(unpack_block(keys.public, blocks[1]))
    np.testing.assert_allclose(last[:10], vector[V:], atol=ERROR_PER_CIPHERTEXT)
    np.testing.assert_allclose(last[10:], 0.0, atol=ERROR_PER_CIPHERTEXT)


def test_encrypt_many_blocks_across_chunks(keys: SecretContext, encryptor: BlockEncryptor) -> None:
    # Prepare: 130 blocks, more than two of the chunks encryption works in, some chosen
    vector = np.random.default_rng(5).uniform(-1, 1, 130 * V)
    chosen = [0, 63, 64, 65, 127, 128, 129]

    # Execute
    blocks, coefficients = encryptor.encrypt_with_coefficients(vector, chosen)

    # Assert: every chosen block, on either side of a chunk edge, decrypts to its values, and
    # the packed bytes hold exactly the coefficients returned
    assert list(blocks) == chosen
    for row, b in enumerate(chosen):
        coeffs = unpack_block(keys.public, blocks[b])
        np.testing.assert_array_equal(coeffs, coefficients[row])
        np.testing.assert_allclose(
            keys.decrypt(coeffs), vector[b * V : (b + 1) * V], atol=ERROR_PER_CIPHERTEXT
        )


@pytest.mark.parametrize(
    "values", [np.zeros(V - 1), np.zeros(V + 1), np.full(V, np.nan), np.full(V, np.inf)]
)
def test_encrypt_block_rejects_bad_values(encryptor: BlockEncryptor, values: np.ndarray) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(InvalidArgumentError):
        encryptor.encrypt_block(values)


def test_encrypt_rejects_out_of_range_block(encryptor: BlockEncryptor) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(InvalidArgumentError, match="out of range"):
        encryptor.encrypt(np.zeros(10), blocks=[1])


def test_add_with_multiplier_equals_repeated_add(
    keys: SecretContext, encryptor: BlockEncryptor
) -> None:
    # Prepare
    coeffs = unpack_block(keys.public, encryptor.encrypt_block(np.full(V, 0.25)))
    once, thrice = CiphertextSum(keys.public), CiphertextSum(keys.public)

    # Execute
    once.add(coeffs, multiplier=3)
    for _ in range(3):
        thrice.add(coeffs)

    # Assert
    np.testing.assert_array_equal(once.coefficients, thrice.coefficients)
    assert int(once.coefficients.max()) < keys.public.modulus
    np.testing.assert_allclose(keys.decrypt(once.coefficients), 0.75, atol=3 * ERROR_PER_CIPHERTEXT)


@pytest.mark.parametrize("multiplier", [0, -1, 2 ** (64 - 45)])
def test_add_rejects_bad_multiplier(keys: SecretContext, multiplier: int) -> None:
    """Multipliers must keep coefficient * multiplier below 2**64 (q has 45 bits here)."""
    # Prepare
    total = CiphertextSum(keys.public)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="multiplier"):
        total.add(np.zeros(2 * N, dtype=np.uint64), multiplier=multiplier)


def test_sum_stays_reduced_modulo_q(keys: SecretContext) -> None:
    # Prepare: q - 1 plus 2 must wrap to 1.
    q = keys.public.modulus
    total = CiphertextSum(keys.public)
    high = np.full(2 * N, q - 1, dtype=np.uint64)
    two = np.full(2 * N, 2, dtype=np.uint64)

    # Execute
    total.add(high)
    total.add(two)

    # Assert
    assert (total.coefficients == 1).all()


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("delta", [-1, 1, -8, 8])
def test_unpack_block_rejects_wrong_length(keys: SecretContext, delta: int) -> None:
    # Prepare
    data = bytes(keys.public.block_bytes + delta)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="exactly"):
        unpack_block(keys.public, data)


@pytest.mark.parametrize("offset", [0, 1, 2**45 - 1 - 35184372060161])
def test_unpack_block_rejects_coefficient_not_below_q(keys: SecretContext, offset: int) -> None:
    # Prepare: a well-sized block whose one coefficient is q (or larger, still 45 bits).
    q = keys.public.modulus
    assert q + offset < 2**keys.public.coeff_bits
    coeffs = np.zeros(2 * N, dtype=np.uint64)
    coeffs[1234] = q + offset
    data = bitpack.pack(coeffs, keys.public.coeff_bits)
    total = CiphertextSum(keys.public)

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="below q"):
        unpack_block(keys.public, data)
    with pytest.raises(InvalidArgumentError):
        total.add_packed(data)
    assert (total.coefficients == 0).all()


def test_unpack_block_accepts_q_minus_one(keys: SecretContext) -> None:
    # Prepare
    coeffs = np.zeros(2 * N, dtype=np.uint64)
    coeffs[-1] = keys.public.modulus - 1

    # Execute
    out = unpack_block(keys.public, bitpack.pack(coeffs, keys.public.coeff_bits))

    # Assert
    np.testing.assert_array_equal(out, coeffs)


# --------------------------------------------------------------------------- public context


def test_public_context_round_trip(keys: SecretContext, encryptor: BlockEncryptor) -> None:
    # Prepare
    data = keys.public.serialize()

    # Execute
    loaded = PublicContext.from_bytes(data)
    block = BlockEncryptor(loaded).encrypt_block(np.full(V, 2.0))

    # Assert: same key generation, and its ciphertexts decrypt under the original secret key.
    assert loaded.context_id == keys.public.context_id
    assert loaded.params == keys.public.params
    assert loaded.serialize() == data
    np.testing.assert_allclose(
        keys.decrypt(unpack_block(keys.public, block)), 2.0, atol=ERROR_PER_CIPHERTEXT
    )


def test_context_ids_differ_between_key_generations(
    keys: SecretContext, other_keys: SecretContext
) -> None:
    # Prepare / Execute
    ids = {keys.public.context_id, other_keys.public.context_id}

    # Assert
    assert len(ids) == 2
    assert all(len(i) == 64 for i in ids)


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda d: d[:-1], id="truncated-by-one"),
        pytest.param(lambda d: d[: len(d) // 2], id="truncated-half"),
        pytest.param(lambda d: d[:12], id="truncated-in-length"),
        pytest.param(lambda d: d + b"\x00", id="trailing-byte"),
        pytest.param(lambda d: b"", id="empty"),
        pytest.param(lambda d: b"garbage" * 100, id="garbage"),
        pytest.param(lambda d: _MAGIC + b"\xff" * 40, id="huge-length"),
        pytest.param(lambda d: b"X" + d[1:], id="bad-magic"),
        pytest.param(
            lambda d: d[: len(_MAGIC) + 4] + struct.pack("<I", 3000) + d[len(_MAGIC) + 8 :],
            id="bad-degree",
        ),
        pytest.param(
            lambda d: d[: len(_MAGIC) + 8] + struct.pack("<I", 60) + d[len(_MAGIC) + 12 :],
            id="insecure-modulus",
        ),
        pytest.param(
            lambda d: d[: len(_MAGIC) + 4] + struct.pack("<I", 4096) + d[len(_MAGIC) + 8 :],
            id="degree-mismatch",
        ),
        pytest.param(
            lambda d: _MAGIC + struct.pack("<I", 4) + bytes(4) + bytes(8), id="short-header"
        ),
        pytest.param(lambda d: _MAGIC + struct.pack("<III", 0, 0, 0), id="empty-parts"),
    ],
)
def test_from_bytes_rejects_malformed_input(keys: SecretContext, mangle: object) -> None:
    # Prepare
    data = mangle(keys.public.serialize())  # type: ignore[operator]

    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        PublicContext.from_bytes(data)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_from_bytes_fuzz_never_crashes(keys: SecretContext, data: st.DataObject) -> None:
    # Prepare: random bytes, or a valid context with bytes flipped, cut or appended.
    valid = keys.public.serialize()
    kind = data.draw(
        st.sampled_from(["random", "magic+random", "flip", "flip-head", "cut", "append"])
    )
    if kind == "random":
        blob = data.draw(st.binary(max_size=512))
    elif kind == "magic+random":
        blob = _MAGIC + data.draw(st.binary(max_size=512))
    elif kind in ("flip", "flip-head"):
        # flip-head hits the magic, the length fields and the parameter header.
        last = len(valid) - 1 if kind == "flip" else 64
        flipped = bytearray(valid)
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, last))
            flipped[pos] ^= data.draw(st.integers(1, 255))
        blob = bytes(flipped)
    elif kind == "cut":
        blob = valid[: data.draw(st.integers(0, len(valid) - 1))]
    else:
        blob = valid + data.draw(st.binary(min_size=1, max_size=16))

    # Execute
    try:
        loaded = PublicContext.from_bytes(blob)
    except InvalidArgumentError:
        return

    # Assert: anything accepted is a usable context.
    assert kind in ("flip", "flip-head")
    assert len(BlockEncryptor(loaded).encrypt_block(np.zeros(loaded.params.values_per_block))) == (
        loaded.block_bytes
    )


def test_public_context_contains_no_secret_key(keys: SecretContext) -> None:
    # Prepare
    serialized = keys.public.serialize()
    secret_serialized = _seal_io.save_bytes(keys._secret_key)
    secret_raw = _seal_io.uncompressed_body(secret_serialized)
    # The key's coefficient data: N residues of 8 bytes (NTT form), after SEAL's metadata
    # (parms_id, which the public key shares, coefficient count, scale, array header).
    secret_data = secret_raw[-8 * N :]
    assert len(secret_raw) > 8 * N
    haystacks = [
        serialized,
        *(_seal_io.uncompressed_body(p) for p in context_parts(serialized)[1:]),
    ]

    # Execute
    windows = {secret_data[i : i + 32] for i in range(len(secret_data) - 31)}
    found = [
        hay[i : i + 32]
        for hay in haystacks
        for i in range(len(hay) - 31)
        if hay[i : i + 32] in windows
    ]

    # Assert
    assert secret_serialized not in serialized
    assert secret_raw not in serialized
    assert found == []
    # The search itself works: it finds a window of the secret key in the secret key.
    assert secret_data[100:132] in windows


# --------------------------------------------------------------------------- secret context


def test_save_writes_private_files_and_load_restores_keys(
    keys: SecretContext, encryptor: BlockEncryptor, tmp_path: Path
) -> None:
    # Prepare
    directory = tmp_path / "keys"
    block = encryptor.encrypt_block(np.full(V, -3.5))

    # Execute
    keys.save(directory)
    loaded = SecretContext.load(directory)

    # Assert
    assert stat.S_IMODE(os.stat(directory / "secret.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(directory / "public.ctx").st_mode) == 0o600
    assert loaded.public.context_id == keys.public.context_id
    np.testing.assert_allclose(
        loaded.decrypt(unpack_block(loaded.public, block)), -3.5, atol=ERROR_PER_CIPHERTEXT
    )
    assert "secret=<hidden>" in repr(loaded)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_load_refuses_key_readable_by_others(
    keys: SecretContext, tmp_path: Path, mode: int
) -> None:
    # Prepare
    keys.save(tmp_path)
    os.chmod(tmp_path / "secret.key", mode)

    # Execute / Assert
    with pytest.raises(FedPSError, match="chmod 600"):
        SecretContext.load(tmp_path)


def test_load_refuses_missing_key(tmp_path: Path) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(FedPSError, match="no key pair"):
        SecretContext.load(tmp_path)


def test_load_refuses_key_of_another_context(keys: SecretContext, tmp_path: Path) -> None:
    # Prepare: a public context for N = 4096 beside a secret key for N = 2048.
    keys.save(tmp_path)
    wider = SecretContext.generate(CkksParams(poly_modulus_degree=4096))
    (tmp_path / "public.ctx").write_bytes(wider.public.serialize())

    # Execute / Assert
    with pytest.raises(InvalidArgumentError):
        SecretContext.load(tmp_path)


def test_load_or_generate_returns_the_same_keys_twice(tmp_path: Path) -> None:
    # Prepare
    directory = tmp_path / "kh"

    # Execute
    first = SecretContext.load_or_generate(directory, CkksParams())
    key_bytes = (directory / "secret.key").read_bytes()
    second = SecretContext.load_or_generate(directory, CkksParams())

    # Assert
    assert first.public.context_id == second.public.context_id
    assert (directory / "secret.key").read_bytes() == key_bytes
    block = BlockEncryptor(first.public).encrypt_block(np.full(V, 1.25))
    np.testing.assert_allclose(
        second.decrypt(unpack_block(second.public, block)), 1.25, atol=ERROR_PER_CIPHERTEXT
    )


def _opens_its_own_ciphertexts(keys: SecretContext) -> bool:
    """Whether ``keys`` decrypts what its own public context encrypts (a whole pair)."""
    block = BlockEncryptor(keys.public).encrypt_block(np.full(V, 0.75))
    values = keys.decrypt(unpack_block(keys.public, block))
    return bool(np.allclose(values, 0.75, atol=ERROR_PER_CIPHERTEXT))


def test_save_replaces_a_pair_in_one_step_and_the_old_secret_key_is_gone(
    keys: SecretContext, other_keys: SecretContext, tmp_path: Path
) -> None:
    # Prepare: the pair of a key holder before it rotates
    keys.save(tmp_path)
    old_secret = (tmp_path / "secret.key").read_bytes()

    # Execute: it rotates
    other_keys.save(tmp_path)

    # Assert: the new pair, whole, 0600; nothing staged, nothing of the old secret key left
    loaded = SecretContext.load(tmp_path)
    assert loaded.public.context_id == other_keys.public.context_id
    assert _opens_its_own_ciphertexts(loaded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["public.ctx", "secret.key"]
    for name in ("public.ctx", "secret.key"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    assert (tmp_path / "secret.key").read_bytes() != old_secret


@pytest.mark.parametrize(
    ("staged", "committed", "survivor"),
    [
        (["secret.key"], False, "old"),  # died while staging the secret key's twin
        (["secret.key", "public.ctx"], False, "old"),  # both staged, not committed
        (["public.ctx"], True, "new"),  # committed: the new secret key is in place
    ],
)
def test_a_save_cut_short_leaves_one_whole_pair(
    keys: SecretContext,
    other_keys: SecretContext,
    tmp_path: Path,
    staged: list[str],
    committed: bool,
    survivor: str,
) -> None:
    # Prepare: the old pair in place, the new one's files where a crash left them
    folder, new = tmp_path / "keys", tmp_path / "new"
    keys.save(folder)
    other_keys.save(new)
    for name in staged:
        (folder / f"{name}.new").write_bytes((new / name).read_bytes())
    if committed:
        (folder / "secret.key").write_bytes((new / "secret.key").read_bytes())

    # Execute: the key holder starts again
    loaded = SecretContext.load_or_generate(folder, CkksParams())

    # Assert: one pair, whole, and the staging gone
    expected = keys if survivor == "old" else other_keys
    assert loaded.public.context_id == expected.public.context_id
    assert _opens_its_own_ciphertexts(loaded)
    assert sorted(p.name for p in folder.iterdir()) == ["public.ctx", "secret.key"]


@pytest.mark.parametrize("failing", ["secret.key.new", "public.ctx.new"])
def test_a_save_that_fails_keeps_the_pair_in_place(
    keys: SecretContext,
    other_keys: SecretContext,
    tmp_path: Path,
    faults: pytest.MonkeyPatch,
    failing: str,
) -> None:
    # Prepare
    keys.save(tmp_path)
    faults.setenv(FAULTS_VARIABLE, failing)

    # Execute / Assert: a full disk half-way through the new pair
    with pytest.raises(OSError, match="No space left"):
        other_keys.save(tmp_path)
    loaded = SecretContext.load(tmp_path)
    assert loaded.public.context_id == keys.public.context_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["public.ctx", "secret.key"]


def test_other_key_pair_decrypts_to_garbage(keys: SecretContext, other_keys: SecretContext) -> None:
    # Prepare: the same parameters, so the ciphertext is well-formed for both key pairs;
    # only the context id tells them apart.
    values = np.full(V, 1.0)
    block = BlockEncryptor(other_keys.public).encrypt_block(values)

    # Execute
    wrong = keys.decrypt(unpack_block(keys.public, block))
    right = other_keys.decrypt(unpack_block(other_keys.public, block))

    # Assert
    np.testing.assert_allclose(right, values, atol=ERROR_PER_CIPHERTEXT)
    assert np.median(np.abs(wrong - values)) > 1.0


def test_sums_packed_at_once_are_the_sums_packed_one_by_one(keys: SecretContext) -> None:
    # Prepare: three running sums of random coefficients below q
    rng = np.random.default_rng(11)
    sums = [new_sum(keys.public) for _ in range(3)]
    for total in sums:
        total.add(rng.integers(0, keys.public.modulus, size=2 * N, dtype=np.uint64))
    plain = [new_sum(PlainContext(V)) for _ in range(2)]
    # Execute / Assert
    assert pack_sums(sums) == [total.packed() for total in sums]
    assert pack_sums(plain) == [total.packed() for total in plain]
    assert pack_sums([]) == []
