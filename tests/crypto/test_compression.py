"""The compressed wire form: round trips, exact validation, the error it adds and its bound.

Real SEAL keys throughout: encryptions are public-key encryptions under the key holder's
public context, sums are the shard's modular additions and decryptions the key holder's.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto import BlockEncryptor, CiphertextSum, CkksParams, SecretContext, bitpack
from crypto.canary import canary_bound
from crypto.ciphertext_sum import unpack_blocks
from crypto.params import (
    C1_DROP_BITS,
    CANARY_ROUNDING_SHARE,
    MAX_COEFF_BITS_128,
    NOISE_AT_N2048,
    TAIL_SIGMAS,
    fresh_noise_proxy,
    rounding_proxy,
)
from crypto.public_context import _WIRE_MAGIC, PublicContext
from crypto.release import decryption_error_bound
from fedps.ckks_params import ckks_params_from
from fedps.config import load_config
from fedps.errors import ConfigError, InvalidArgumentError
from tests.crypto.context_parts import context_parts

#: The default workload (K = 100, B = 1, eps = 1e-5) and four other ways to drop bits.
DEFAULT = ckks_params_from(load_config().he)
SHAPES = {
    "default": DEFAULT,
    "c0 only": CkksParams(2048, 46, 37, c0_drop_bits=7),
    "c1 only": CkksParams(2048, 46, 37, c1_drop_bits=3),
    "both, N = 4096": CkksParams(4096, 50, 38, c0_drop_bits=14, c1_drop_bits=1),
    "canaries as c0": CkksParams(2048, 46, 37, c0_drop_bits=5, canary_drop_bits=5),
}


@functools.cache
def _keys(name: str) -> SecretContext:
    return SecretContext.generate(SHAPES[name])


def _centred(a: np.ndarray, b: np.ndarray, q: int) -> np.ndarray:
    """``a - b`` modulo q, centred in (-q/2, q/2]."""
    diff = (a.astype(object) - b.astype(object)) % q
    return np.array(np.where(diff > q // 2, diff - q, diff), dtype=np.int64)


def _reference_round(c: int, drop: int, q: int) -> int:
    """The multiple of ``2^drop`` nearest ``c`` (ties to an even multiple), modulo q."""
    if drop == 0:
        return c
    below = c >> drop
    # the nearer of below and below + 1 (ties: the even one); M_d 2^d stands for q, i.e. 0
    pick = min((below, below + 1), key=lambda v: (abs(c - (v << drop)), v % 2))
    return 0 if pick == -(-q // (1 << drop)) else pick << drop


@st.composite
def _ciphertexts(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    """A context and a few rows of coefficients below q, with values at the edges."""
    name = draw(st.sampled_from(sorted(SHAPES)))
    public = _keys(name).public
    q, params = public.modulus, public.params
    edges = [0, 1, q - 1]
    for d in {max(params.c0_drop_bits, 1), max(params.canary_drop_bits, 1)}:
        edges += [q - (1 << (d - 1)), q - (1 << (d - 1)) - 1, 1 << (d - 1), 3 << (d - 1)]
    rows = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    coeffs = rng.integers(0, q, (rows, public.coeffs_per_block), dtype=np.uint64)
    for _ in range(draw(st.integers(0, 40))):
        r, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, public.coeffs_per_block - 1))
        coeffs[r, j] = draw(st.sampled_from(edges))
    return name, coeffs


# ------------------------------------------------------------------------------ the sizes
def test_the_default_workload_sends_at_most_ten_bytes_per_value() -> None:
    # Prepare
    public = _keys("default").public
    params = public.params
    # Execute
    per_value = public.block_bytes / params.values_per_block
    million = -(-1_000_000 // params.values_per_block) * public.block_bytes / 1_000_000
    # Assert: N = 2048, q of 46 bits, scale 2^37 as before; c0 drops 13 bits (6 at its
    # canaries), c1 one
    assert (params.poly_modulus_degree, params.coeff_modulus_bits, params.scale_bits) == (
        2048,
        46,
        37,
    )
    assert (params.c0_drop_bits, params.c1_drop_bits) == (13, C1_DROP_BITS) == (13, 1)
    assert params.canary_drop_bits == 6
    assert public.block_bytes == (2048 * 33 + 2048 * 45 + 32 * (13 - 6)) // 8 == 19996
    # a canary position: c0's high part and its 7 low bits, and c1
    assert public.compression.canary_bits == 33 + 7 + 45
    assert public.full_block_bytes == 2 * 2048 * 46 // 8
    assert per_value <= 10 and million <= 10


@pytest.mark.parametrize(
    ("clients", "bound", "precision"),
    [(100, 1.0, 1e-5), (1000, 1.0, 1e-5), (10, 1.0, 1e-5), (100, 16.0, 1e-5), (4, 0.1, 1e-6)],
)
def test_derived_compression_keeps_the_error_bound_within_its_budget(
    clients: int, bound: float, precision: float
) -> None:
    # Execute
    params = CkksParams.for_workload(max_clients=clients, max_abs_value=bound, precision=precision)
    n = params.poly_modulus_degree
    # Assert: the proven error of one ciphertext as sent stays within the budget c that the
    # scale was chosen for, so a sum of K errs by no more than before, and within eps * B
    assert TAIL_SIGMAS * math.sqrt(params.value_noise_proxy) <= NOISE_AT_N2048 * math.sqrt(n / 2048)
    assert params.error_bound(clients) <= decryption_error_bound(params, clients)
    assert decryption_error_bound(params, clients) <= precision * bound
    # the canaries grow by c1's rounding (N more in a proxy of 35 N + 21) and by their own
    # rounding in c0, at most 1/64 of that (the canary bound grows by at most 0.8%), with
    # the most bits that allows
    dc = params.canary_drop_bits
    shared = fresh_noise_proxy(n) + n
    assert params.canary_noise_proxy == shared + rounding_proxy(dc)
    assert rounding_proxy(dc) <= CANARY_ROUNDING_SHARE * shared < rounding_proxy(dc + 1)
    assert 6 <= dc <= params.c0_drop_bits
    assert params.c0_drop_bits >= 13 and params.coeff_modulus_bits <= MAX_COEFF_BITS_128[n]


# ------------------------------------------------------------------------ the round trips
@settings(max_examples=60, deadline=None)
@given(_ciphertexts())
def test_compress_rounds_to_nearest_and_expands_back_exactly(case: tuple[str, np.ndarray]) -> None:
    # Prepare
    name, original = case
    public = _keys(name).public
    params, q, n = public.params, public.modulus, public.params.poly_modulus_degree
    rows = original.copy()
    # Execute
    packed = public.compression.compress(rows)
    expanded = unpack_blocks(public, packed)
    # Assert: the bytes expand to exactly the rounded rows, every coefficient below q
    assert all(len(p) == public.block_bytes for p in packed)
    np.testing.assert_array_equal(expanded, rows)
    assert int(rows.max()) < q
    # each coefficient is the reference rounding; the canaries of c0 are rounded to 2^dc
    canaries = list(params.canary_positions)
    dc = params.canary_drop_bits
    drops = [params.c0_drop_bits] * n + [params.c1_drop_bits] * n
    for j in canaries:
        drops[j] = dc
    for r in range(len(rows)):
        # a spread of positions (the reference is slow), and every canary
        for j in sorted({*range(0, 2 * n, 61), *canaries}):
            assert int(rows[r, j]) == _reference_round(int(original[r, j]), drops[j], q)
    error = _centred(rows, original, q)
    values = list(params.value_positions)
    assert np.abs(error[:, values]).max() <= 1 << max(params.c0_drop_bits - 1, 0)
    assert np.abs(error[:, n:]).max() <= 1 << max(params.c1_drop_bits - 1, 0)
    assert np.abs(error[:, canaries]).max() <= (1 << dc) // 2  # 0: untouched
    assert not (rows[:, canaries] % np.uint64(1 << dc)).any()
    # and compressing again changes nothing: one encoding per ciphertext
    again = rows.copy()
    assert public.compression.compress(again) == packed
    np.testing.assert_array_equal(again, rows)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(SHAPES)), data=st.data())
def test_any_bytes_expand_below_q_or_are_refused(name: str, data: st.DataObject) -> None:
    # Prepare: random bytes of the compressed length, some or most of them 0xFF (values at
    # the top of their bits, where the range ends)
    public = _keys(name).public
    size = public.block_bytes
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, size, dtype=np.uint8)
    raw[rng.random(size) < data.draw(st.sampled_from([0.0, 0.5, 0.95, 1.0]))] = 0xFF
    blob = raw.tobytes()
    # Execute
    try:
        rows = unpack_blocks(public, [blob])
    except InvalidArgumentError as exc:
        assert "out of range" in str(exc)
        return
    # Assert: what is accepted is below q, and is the one encoding of its coefficients
    assert int(rows.max()) < public.modulus
    assert public.compression.compress(rows.copy()) == [blob]


def _segments(public: PublicContext, rows: np.ndarray) -> list[np.ndarray]:
    """The three segments of compressed rows (on the grid): the high parts of ``c0`` and
    ``c1``, the canaries' low bits from ``2^dc`` to ``2^d0``."""
    compression = public.compression
    n, (d0, d1), dc = compression.n, compression.drops, compression.canary_drop
    canaries = list(public.params.canary_positions)
    return [
        rows[0, :n] >> np.uint64(d0),
        rows[0, n:] >> np.uint64(d1),
        (rows[0, canaries] >> np.uint64(dc)) & np.uint64((1 << (d0 - dc)) - 1),
    ]


def _pack_by_hand(public: PublicContext, segments: list[np.ndarray]) -> bytes:
    """The documented layout, segment by segment."""
    compression = public.compression
    (w0, w1), bits = compression.widths, compression.drops[0] - compression.canary_drop
    c0, c1, low = segments
    padded = np.zeros(64, dtype=np.uint64)
    padded[:32] = low
    third = bitpack.pack(padded, bits)[: 32 * bits // 8] if bits else b""
    return bitpack.pack(c0, w0) + bitpack.pack(c1, w1) + third


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_layout_is_the_documented_one(name: str) -> None:
    # Prepare: an honest block
    public = _keys(name).public
    rows = public.encrypt_zeros(1)
    # Execute
    packed = public.compression.compress(rows)[0]
    # Assert: the same three segments packed by hand (the third 4 (d0 - dc) bytes)
    assert packed == _pack_by_hand(public, _segments(public, rows))
    compression = public.compression
    (w0, w1), n = compression.widths, compression.n
    third = 4 * (compression.drops[0] - compression.canary_drop)
    size = bitpack.packed_size(n, w0) + bitpack.packed_size(n, w1) + third
    assert len(packed) == compression.block_bytes == size


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("c0", "a compressed value not below"),
        ("c1", "a compressed value not below"),
        ("canary", "not below q"),
        ("canary low bits", "not below q"),
    ],
)
def test_an_out_of_range_compressed_value_is_refused(where: str, why: str) -> None:
    # Prepare: the attack: a value that expands to q or more (the bits fit, the range not),
    # which would enter the shard's sum unreduced and hash to a second encoding of its
    # coefficients
    public = _keys("default").public
    compression = public.compression
    (m0, m1), (w0, w1) = compression.limits, compression.widths
    assert m0 < 1 << w0 and m1 < 1 << w1  # the forged values fit the bits
    rows = public.encrypt_zeros(1)
    compression.compress(rows)
    honest = _pack_by_hand(public, _segments(public, rows))
    c0, c1, low = _segments(public, rows)
    if where == "c0":
        c0[5] = m0
    elif where == "c1":
        c1[7] = m1
    else:  # a canary: its high part at the top, its low bits (above 2^dc) reaching q: the
        # least that does, or all ones
        d0, dc = compression.drops[0], compression.canary_drop
        k = 3 if where == "canary" else 30
        c0[public.params.canary_positions[k]] = m0 - 1
        rest = public.modulus - ((m0 - 1) << d0)  # what the low bits may not reach
        low[k] = -(-rest // (1 << dc)) if where == "canary" else (1 << (d0 - dc)) - 1
        assert 0 < dc < d0 and rest <= int(low[k]) << dc < 1 << d0  # it fits the bits
    forged = _pack_by_hand(public, [c0, c1, low])
    # Execute / Assert: refused, naming its place in the batch
    with pytest.raises(InvalidArgumentError, match=f"#1: coefficient out of range.*{why}"):
        unpack_blocks(public, [honest, forged])


def test_every_reader_takes_both_forms_of_one_ciphertext() -> None:
    # Prepare: one encrypted block, sent compressed, and the same ciphertext in full
    keys = _keys("default")
    public = keys.public
    packed, coefficients = BlockEncryptor(public).encrypt_with_coefficients(np.ones(10))
    full = bitpack.pack(coefficients[0], public.coeff_bits)
    # Execute
    rows = unpack_blocks(public, [packed[0], full, packed[0]])
    # Assert: the same coefficients, the ones the client committed to; the sum is full
    for row in rows:
        np.testing.assert_array_equal(row, coefficients[0])
    total = CiphertextSum(public)
    total.add_packed(packed[0])
    assert len(total.packed()) == public.full_block_bytes
    assert public.block_sizes == {public.block_bytes, public.full_block_bytes}
    with pytest.raises(InvalidArgumentError, match="exactly"):
        unpack_blocks(public, [packed[0][:-1]])


# --------------------------------------------------------------------- the error it adds
@settings(max_examples=8, deadline=None)
@given(
    clients=st.sampled_from([1, 2, 37, 100]),
    sign=st.sampled_from(["+B", "-B", "alternating", "uniform"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_sum_of_k_compressed_updates_at_the_bound_meets_the_precision(
    clients: int, sign: str, seed: int
) -> None:
    # Prepare: K clients (up to max_clients = 100) each at |x| = B = 1 (or below it)
    keys = _keys("default")
    params = keys.public.params
    encryptor = BlockEncryptor(keys.public)
    n = params.values_per_block
    rng = np.random.default_rng(seed)
    values = {
        "+B": np.ones((clients, n)),
        "-B": -np.ones((clients, n)),
        "alternating": np.resize([1.0, -1.0], (clients, n)),
        "uniform": rng.uniform(-1, 1, (clients, n)),
    }[sign]
    total = CiphertextSum(keys.public)
    # Execute
    for row in values:
        total.add_packed(encryptor.encrypt_block(row))
    decrypted = keys.open(total.coefficients[None], noise_weight=clients)[0]
    # Assert: within the proven bound (plus K / 2 of the encoding's own rounding), which is
    # within the budget E and within eps * B
    error = np.abs(decrypted - values.sum(axis=0)).max()
    assert error <= params.error_bound(clients) + clients / 2 / params.scale
    assert params.error_bound(clients) <= decryption_error_bound(params, clients) <= 1e-5


def test_weighted_sums_pass_the_canaries_and_meet_their_bound() -> None:
    # Prepare: async staleness multipliers up to 2^6 on compressed ciphertexts
    keys = _keys("default")
    params = keys.public.params
    encryptor = BlockEncryptor(keys.public)
    multipliers = [64, 64, 17, 1, 3]
    values = np.random.default_rng(3).uniform(-1, 1, (len(multipliers), params.values_per_block))
    total = CiphertextSum(keys.public)
    # Execute
    for m, row in zip(multipliers, values, strict=True):
        total.add(unpack_blocks(keys.public, [encryptor.encrypt_block(row)])[0], multiplier=m)
    weight = float(sum(m * m for m in multipliers))
    decrypted = keys.open(total.coefficients[None], noise_weight=weight)[0]
    # Assert: within the bound of sum m_i^2 (plus the encoding's rounding, m_i / 2 each)
    expected = (np.array(multipliers)[:, None] * values).sum(axis=0)
    rounding = sum(multipliers) / 2 / params.scale
    assert np.abs(decrypted - expected).max() <= params.error_bound(weight) + rounding


def test_honest_canaries_stay_well_below_the_bound() -> None:
    # Prepare: 400 compressed encryptions of zero, one by one and summed by 100
    keys = _keys("default")
    public, params = keys.public, keys.public.params
    rows = public.encrypt_zeros(400)
    public.compression.compress(rows)
    # Execute
    one = np.abs(keys.canaries(rows)).max()
    sums = rows.reshape(4, 100, -1).astype(object).sum(axis=1) % public.modulus
    hundred = np.abs(keys.canaries(sums.astype(np.uint64))).max()
    # Assert: the measured tails are a fraction of the 13-sigma bounds
    assert one < canary_bound(params, 1) / 3
    assert hundred < canary_bound(params, 100) / 3


def test_the_rounding_is_unbiased_with_the_documented_spread() -> None:
    # Prepare
    public = _keys("default").public
    params, q, n = public.params, public.modulus, public.params.poly_modulus_degree
    fresh = public.encrypt_zeros(300)
    sent = fresh.copy()
    # Execute
    public.compression.compress(sent)
    error = _centred(sent, fresh, q).astype(np.float64)
    r0, r1 = error[:, list(params.value_positions)], error[:, n:]
    rc = error[:, list(params.canary_positions)]
    # Assert: r0 uniform on [-2^12, 2^12] (variance 4^13 / 12), r1 in {-1, 0, 1} with
    # variance 1/2, the canaries' rc on [-2^5, 2^5] (dc = 6: variance (4^6 + 2) / 12 for
    # integers), all of mean 0 within 5 standard errors
    var0 = 4.0**13 / 12
    assert abs(r0.var() / var0 - 1) < 0.02
    assert abs(r0.mean()) < 5 * math.sqrt(var0 / r0.size)
    assert set(np.unique(r1)) <= {-1.0, 0.0, 1.0}
    assert abs(r1.var() - 0.5) < 0.01
    assert abs(r1.mean()) < 5 * math.sqrt(0.5 / r1.size)
    assert params.canary_drop_bits == 6 and np.abs(rc).max() <= 32
    var_c = (4.0**6 + 2) / 12
    assert abs(rc.var() / var_c - 1) < 0.05  # 5 standard errors of 9,600 draws
    assert abs(rc.mean()) < 5 * math.sqrt(var_c / rc.size)


# --------------------------------------------------------------------- the public context
def test_the_public_context_carries_the_compression() -> None:
    # Prepare
    public = _keys("default").public
    plain = SecretContext.generate(CkksParams(2048, 46, 37)).public
    # Execute
    loaded = PublicContext.from_bytes(public.serialize())
    header, plain_header = context_parts(public.serialize())[0], context_parts(plain.serialize())[0]
    # Assert: a compressed context names its drops; one without keeps the older header
    assert loaded.params == public.params and loaded.context_id == public.context_id
    assert loaded.block_bytes == public.block_bytes
    assert struct.unpack("<IIIIII", header) == (2048, 46, 37, 13, 1, 6)
    assert struct.unpack("<III", plain_header) == (2048, 46, 37)
    assert plain.block_bytes == plain.full_block_bytes == 23552


def test_a_context_whose_canaries_travel_whole_keeps_its_header() -> None:
    # Prepare: compression without canary rounding, as contexts were written before it
    public = _keys("c0 only").public
    # Execute
    header = context_parts(public.serialize())[0]
    loaded = PublicContext.from_bytes(public.serialize())
    # Assert: five fields, dc = 0 read back, the same id
    assert struct.unpack("<IIIII", header) == (2048, 46, 37, 7, 0)
    assert loaded.params == public.params and loaded.params.canary_drop_bits == 0
    assert loaded.context_id == public.context_id


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("plain", (2048, 46, 37, 0, 0)),
        ("plain", (2048, 46, 37, 0, 0, 0)),
        ("c0 only", (2048, 46, 37, 7, 0, 0)),
    ],
)
def test_a_second_encoding_of_a_context_is_refused(name: str, fields: tuple[int, ...]) -> None:
    # Prepare: a context's header written in a longer form, its trailing fields 0
    params = CkksParams(2048, 46, 37) if name == "plain" else SHAPES[name]
    serialized = SecretContext.generate(params).public.serialize()
    parts = [struct.pack(f"<{len(fields)}I", *fields), *context_parts(serialized)[1:]]
    forged = _WIRE_MAGIC + b"".join(struct.pack("<I", len(p)) + p for p in parts)
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="canonical"):
        PublicContext.from_bytes(forged)


def test_a_header_with_canaries_rounded_past_c0_is_refused() -> None:
    # Prepare: the default context's header claiming dc = 14 > d0 = 13
    parts = context_parts(_keys("default").public.serialize())
    parts[0] = struct.pack("<IIIIII", 2048, 46, 37, 13, 1, 14)
    forged = _WIRE_MAGIC + b"".join(struct.pack("<I", len(p)) + p for p in parts)
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="canary_drop_bits"):
        PublicContext.from_bytes(forged)


def test_drops_are_checked() -> None:
    with pytest.raises(ConfigError, match="c0_drop_bits"):
        CkksParams(2048, 46, 37, c0_drop_bits=37)
    with pytest.raises(ConfigError, match="c1_drop_bits"):
        CkksParams(2048, 46, 37, c1_drop_bits=-1)
    with pytest.raises(ConfigError, match="canary_drop_bits"):
        CkksParams(2048, 46, 37, c0_drop_bits=13, canary_drop_bits=14)
    with pytest.raises(ConfigError, match="canary_drop_bits"):
        CkksParams(2048, 46, 37, c0_drop_bits=13, canary_drop_bits=-1)
