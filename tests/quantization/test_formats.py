"""Codec tests for tedebug.quantization.formats: hand-derived cast vectors (SATFINITE, round to nearest even, as
TE's CUDA casts) plus independent float64 / bit-field oracles.

The oracles here never use torch's float8 casts: FP8 and E2M1 values are built from their bit fields in Python,
rounding is nearest-with-ties-to-even-code over that table, and E8M0 codes come from `math.frexp`.
"""

import math
import struct

import pytest
import torch

from tedebug.quantization.formats import (
    FLT_MAX,
    abs_ignoring_nan,
    compute_scale_from_amax,
    decode_e2m1,
    decode_fp8,
    e8m0_encode_multiplier,
    e8m0_rceil,
    e8m0_to_float,
    encode_e2m1,
    encode_fp8,
    fp4_is_zero,
    fp8_format_of,
    fp8_is_zero,
    pack_fp4,
    round_down_pow2,
    tensor_amax,
    unpack_fp4,
)

NAN = float("nan")
INF = float("inf")


# ------------------------------------------------------------------------------------------------ oracles
def fp8_value(code: int, fmt: str) -> float:
    """Value of a non-negative FP8 code from its bit fields (NaN / Inf for the special codes)."""
    if fmt == "E4M3":
        e, m = code >> 3 & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            return NAN
        return m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    e, m = code >> 2 & 0x1F, code & 0x3
    if e == 0x1F:
        return INF if m == 0 else NAN
    return m * 2.0**-16 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15)


def positive_table(fmt: str) -> list:
    """Finite non-negative values, indexed by code (monotonic)."""
    if fmt == "E2M1":
        return [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    top = 0x7E if fmt == "E4M3" else 0x7B
    return [fp8_value(c, fmt) for c in range(top + 1)]


def oracle_codes(xs, fmt: str) -> list:
    """Round-to-nearest, ties to the even code, saturating to the largest finite code; sign in the top bit."""
    table = positive_table(fmt)
    sign_bit = 0x8 if fmt == "E2M1" else 0x80
    out = []
    for x in xs:
        if math.isnan(x):
            out.append(0x7 if fmt == "E2M1" else 0x7F)
            continue
        a = min(abs(x), table[-1])
        best = min(range(len(table)), key=lambda c: (abs(table[c] - a), c & 1))
        out.append(best | (sign_bit if math.copysign(1.0, x) < 0 else 0))
    return out


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def probe_values(fmt: str) -> list:
    """Every code value, every midpoint between neighbours, and the fp32 neighbours of each midpoint, both signs."""
    table = positive_table(fmt)
    vals = list(table)
    for lo, hi in zip(table, table[1:]):
        mid = (lo + hi) / 2
        vals += [mid, math.nextafter(f32(mid), 0.0), math.nextafter(f32(mid), INF)]
    vals += [table[-1] * 1.01, table[-1] * 4, 1e30, INF]
    return [f32(v) for v in vals] + [-f32(v) for v in vals]


# ------------------------------------------------------------------------------------------------ FP8
@pytest.mark.parametrize(
    "x, e4m3, e5m2",
    [
        (1.0, 0x38, 0x3C),
        (1.0625, 0x38, 0x3C),
        (1.1875, 0x3A, 0x3D),
        (448.0, 0x7E, 0x5F),
        (449.0, 0x7E, 0x5F),
        (464.0, 0x7E, 0x5F),
        (465.0, 0x7E, 0x5F),
        (500.0, 0x7E, 0x60),
        (1e6, 0x7E, 0x7B),
        (INF, 0x7E, 0x7B),
        (61440.0, 0x7E, 0x7B),
        (-1000.0, 0xFE, 0xE4),
        (NAN, 0x7F, 0x7F),
        (2.0**-9, 0x01, 0x18),
        (2.0**-10, 0x00, 0x14),
        (1.5 * 2.0**-10, 0x01, 0x16),
    ],
)
def test_fp8_spec_vectors(x, e4m3, e5m2):
    t = torch.tensor([x], dtype=torch.float32)
    assert encode_fp8(t, "E4M3").item() == e4m3
    assert encode_fp8(t, "E5M2").item() == e5m2


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_fp8_encode_matches_bitfield_oracle(fmt):
    xs = probe_values(fmt)
    got = encode_fp8(torch.tensor(xs, dtype=torch.float32), fmt)
    assert got.tolist() == oracle_codes(xs, fmt)


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_fp8_decode_all_codes(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = decode_fp8(codes, fmt).tolist()
    for c in range(256):
        want = fp8_value(c & 0x7F, fmt) * (-1.0 if c & 0x80 else 1.0)
        if math.isnan(want):
            assert math.isnan(got[c]), c
        else:
            assert got[c] == want and math.copysign(1.0, got[c]) == math.copysign(1.0, want), c


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_fp8_subnormal_ties_and_round_trip_of_every_code(fmt):
    table = positive_table(fmt)
    codes = torch.arange(len(table), dtype=torch.uint8)
    assert torch.equal(encode_fp8(decode_fp8(codes, fmt), fmt), codes)
    # ties between the two smallest subnormals go to the even code
    min_sub = table[1]
    x = torch.tensor([min_sub / 2, 1.5 * min_sub, 2.5 * min_sub], dtype=torch.float32)
    assert encode_fp8(x, fmt).tolist() == [0, 2, 2]


@pytest.mark.parametrize("fmt, torch_dtype", [("E4M3", torch.float8_e4m3fn), ("E5M2", torch.float8_e5m2)])
def test_fp8_agrees_with_torch_cast_in_range(fmt, torch_dtype):
    """In range our cast equals torch's eager cast bit for bit.

    We differ on purpose out of range: tedebug saturates (|x| > max and +-Inf become +-max, the SATFINITE
    behaviour of TE's CUDA kernels), while torch's eager E5M2 cast produces Inf and torch 2.11's E4M3 cast
    produced NaN.  That case is covered by the hand-derived vectors above, not compared with torch.
    """
    g = torch.Generator().manual_seed(0)
    fmax = positive_table(fmt)[-1]
    mags = torch.exp2(torch.empty(20000).uniform_(-20, math.log2(fmax), generator=g))
    x = (mags * torch.randn(20000, generator=g).sign()).clamp(-fmax, fmax)
    assert torch.equal(encode_fp8(x, fmt), x.to(torch_dtype).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours, theirs = decode_fp8(codes, fmt), codes.view(torch_dtype).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_fp8_input_dtypes_and_zero_detection():
    x = torch.tensor([1.0, -0.0, 0.0, 2.0**-12, -3.0])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert encode_fp8(x.to(dt), "E4M3").tolist() == [0x38, 0x80, 0x00, 0x00, 0xC4]
    codes = torch.tensor([0x00, 0x80, 0x01, 0x81, 0x7F], dtype=torch.uint8)
    assert fp8_is_zero(codes).tolist() == [True, True, False, False, False]


def test_fp8_format_names():
    assert fp8_format_of("e4m3") == "E4M3"
    assert fp8_format_of(torch.float8_e5m2) == "E5M2"
    with pytest.raises(ValueError, match="unknown FP8 format"):
        encode_fp8(torch.zeros(1), "E3M4")
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8_format_of(torch.float16)


# ------------------------------------------------------------------------------------------------ E2M1 / FP4
@pytest.mark.parametrize(
    "x, code",
    [
        (0.25, 0x0),
        (0.26, 0x1),
        (0.75, 0x2),
        (1.25, 0x2),
        (1.75, 0x4),
        (2.5, 0x4),
        (3.5, 0x6),
        (5.0, 0x6),
        (5.1, 0x7),
        (7.0, 0x7),
        (100.0, 0x7),
        (-0.25, 0x8),
        (-0.3, 0x9),
        (-5.0, 0xE),
        (-6.5, 0xF),
        (NAN, 0x7),
        (INF, 0x7),
    ],
)
def test_e2m1_spec_vectors(x, code):
    assert encode_e2m1(torch.tensor([x])).item() == code


def test_e2m1_matches_oracle_and_decodes():
    xs = probe_values("E2M1")
    assert encode_e2m1(torch.tensor(xs)).tolist() == oracle_codes(xs, "E2M1")
    table = positive_table("E2M1")
    assert decode_e2m1(torch.arange(16, dtype=torch.uint8)).tolist() == table + [-v for v in table]
    assert fp4_is_zero(torch.tensor([0, 8, 1, 9], dtype=torch.uint8)).tolist() == [True, True, False, False]


def test_fp4_packing_order():
    codes = encode_e2m1(torch.tensor([1.0, 6.0, -0.5, 3.0]))
    packed = pack_fp4(codes)
    assert packed.tolist() == [0x72, 0x59]  # element 2i low nibble, 2i+1 high nibble
    assert torch.equal(unpack_fp4(packed), codes)
    two_d = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.uint8)
    assert pack_fp4(two_d).tolist() == [[0x21, 0x43], [0x0F, 0x78]]
    assert torch.equal(unpack_fp4(pack_fp4(two_d)), two_d)
    with pytest.raises(ValueError, match="even last dimension"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------------ E8M0
def oracle_rceil(r: float) -> int:
    """TE's RCEIL E8M0 code of a non-negative ratio, from math.frexp (exact in float64)."""
    if math.isnan(r):
        return 255
    if math.isinf(r):
        return 254
    if r <= 2.0**-127:
        return 0
    mant, exp = math.frexp(r)  # r = mant * 2^exp, mant in [0.5, 1)
    e = exp - 1 if mant == 0.5 else exp  # ceil(log2(r))
    return min(e + 127, 254)


def test_e8m0_rceil_spec_table():
    amax = torch.tensor([1.0, 448.0, 449.0, 500.0, 300.0, 0.001, 0.0, 2.0**-130, NAN, INF])
    ratio = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)  # TE multiplies by fp32(1/fp8_max)
    assert e8m0_rceil(ratio).tolist() == [119, 127, 128, 128, 127, 109, 0, 0, 255, 254]


def test_e8m0_rceil_cuda_intrinsic_vectors():
    r = torch.tensor([1.4, 0.75, 449.0 / 448.0, 300.0 / 448.0, INF, NAN, 3 * 2.0**126])
    assert e8m0_rceil(r).tolist() == [128, 127, 128, 127, 254, 255, 254]


def test_e8m0_rceil_matches_frexp_oracle():
    g = torch.Generator().manual_seed(1)
    r = torch.exp2(torch.empty(5000).uniform_(-149, 128, generator=g))
    exact = torch.exp2(torch.arange(-149, 128, dtype=torch.float32))
    edge = torch.tensor([2.0**-127, f32(2.0**-127 + 2.0**-149), 2.0**-126, 2.0**127, FLT_MAX, 0.0])
    r = torch.cat([r, exact, exact * 1.0000001, edge])
    assert e8m0_rceil(r).tolist() == [oracle_rceil(v) for v in r.tolist()]


def test_e8m0_decode_and_multiplier():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dec = e8m0_to_float(codes)
    assert dec[0].item() == 2.0**-127 and dec[127].item() == 1.0 and dec[254].item() == 2.0**127
    assert math.isnan(dec[255].item())
    assert dec[:255].tolist() == [2.0 ** (c - 127) for c in range(255)]
    # torch's own float8_e8m0fnu decode agrees for every code
    theirs = codes.view(torch.float8_e8m0fnu).float()
    assert torch.equal(dec[:255], theirs[:255]) and math.isnan(theirs[255].item())
    mult = e8m0_encode_multiplier(codes)
    assert mult[:255].tolist() == [2.0 ** (127 - c) for c in range(255)]
    assert math.isnan(mult[255].item())


# ------------------------------------------------------------------------------------------------ scales
def test_round_down_pow2_and_scale_rule():
    s = torch.tensor([3.0, 149.33333, 256.0, 0.7, FLT_MAX, 1.0])
    assert round_down_pow2(s).tolist() == [2.0, 128.0, 256.0, 0.5, 2.0**127, 1.0]
    amax = torch.tensor([3.5, 3.0, 1.0, 0.0, 1e-40, INF, NAN])
    got = compute_scale_from_amax(amax, 448.0).tolist()
    assert got == [128.0, f32(448.0 / 3.0), 448.0, 1.0, FLT_MAX, 1.0, 1.0]
    pow2 = compute_scale_from_amax(amax, 448.0, pow2=True).tolist()
    assert pow2 == [128.0, 128.0, 256.0, 1.0, 2.0**127, 1.0, 1.0]
    eps = compute_scale_from_amax(torch.tensor([0.0, 0.5, 4.0]), 448.0, epsilon=1.0).tolist()
    assert eps == [448.0, 448.0, 112.0]
    bf16_max = torch.finfo(torch.bfloat16).max
    assert compute_scale_from_amax(torch.tensor([1e-40]), 448.0, value_for_inf=bf16_max).item() == bf16_max


def test_amax_helpers_ignore_nan():
    x = torch.tensor([[1.0, NAN], [-3.0, 2.0]])
    assert abs_ignoring_nan(x).tolist() == [[1.0, 0.0], [3.0, 2.0]]
    assert tensor_amax(x).item() == 3.0
    assert tensor_amax(torch.tensor([1.0, -INF])).item() == INF
    empty = tensor_amax(torch.empty(0, 3))
    assert empty.shape == () and empty.item() == 0.0


def test_negative_nan_encodes_to_the_canonical_nan_code():
    """torch keeps the sign bit of a NaN in its FP8 cast (0xFF); tedebug stores 0x7F for every NaN, as the CUDA
    SATFINITE conversion does, so CPU and GPU paths write identical bytes."""
    negative_nan = torch.tensor([0xFFC00000 - 2**32], dtype=torch.int32).view(torch.float32)
    assert math.isnan(negative_nan.item()) and torch.signbit(negative_nan).item()
    for fmt in ("E4M3", "E5M2"):
        assert encode_fp8(negative_nan, fmt).item() == 0x7F
        assert encode_fp8(negative_nan.to(torch.bfloat16), fmt).item() == 0x7F
