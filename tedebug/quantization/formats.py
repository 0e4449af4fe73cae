"""Element and scale encodings on raw uint8 codes: FP8 E4M3 / E5M2, FP4 E2M1 (packed two per byte), E8M0.

Every function works on CPU and CUDA tensors and never relies on torch's out-of-range cast behaviour (which differs
between torch versions): FP8 casts clamp to the format maximum first (SATFINITE semantics, NaN kept), E2M1 uses
explicit round-to-nearest-even thresholds, E8M0 codes are computed with fp32 bit arithmetic (never with
``.to(torch.float8_e8m0fnu)``).  The scale rule shared by the per-tensor and blockwise FP8 recipes is
`compute_scale_from_amax`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

# the format constants live on the ground floor (tedebug.format_constants), shared with tedebug.backends
from tedebug.format_constants import E2M1_MAX as E2M1_MAX  # re-exported
from tedebug.format_constants import E4M3, E5M2, FP8_FORMATS, FP8_MAX

FLT_MAX = torch.finfo(torch.float32).max

TORCH_FP8_DTYPE = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}

#: magnitudes of the E2M1 codes 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def check_fp8_format(fmt: str) -> str:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {FP8_FORMATS}")
    return fmt


def fp8_format_of(dtype) -> str:
    """Map a torch float8 dtype or a format string to ``"E4M3"`` / ``"E5M2"``."""
    if isinstance(dtype, str):
        return check_fp8_format(dtype.upper())
    for fmt, tdt in TORCH_FP8_DTYPE.items():
        if dtype == tdt:
            return fmt
    raise ValueError(f"not an FP8 dtype: {dtype!r}")


# ------------------------------------------------------------------------------------------------ FP8
def encode_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round-to-nearest-even, saturating cast of fp32 values to FP8 codes (uint8).

    Finite overflow and +-Inf saturate to +-max normal; every NaN, whatever its sign bit, becomes the canonical
    code 0x7F (as the CUDA SATFINITE conversion does), so CPU and GPU paths store identical bytes.
    """
    fmt = check_fp8_format(fmt)
    x = x.float()
    fmax = FP8_MAX[fmt]
    clamped = torch.clamp(x, -fmax, fmax)  # clamp keeps NaN
    codes = clamped.to(TORCH_FP8_DTYPE[fmt]).view(torch.uint8)
    return torch.where(torch.isnan(x), torch.full_like(codes, 0x7F), codes)


def decode_fp8(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 codes (uint8) to fp32 values."""
    fmt = check_fp8_format(fmt)
    return codes.view(TORCH_FP8_DTYPE[fmt]).float()


def fp8_decode_table(fmt: str) -> np.ndarray:
    """The 256 fp32 values of the FP8 codes of `fmt` (numpy, read-only), as `decode_fp8` gives them: a CPU decode
    is one `numpy.take` with it (the CPU host paths of `tedebug.quantization.float8`)."""
    table = _FP8_DECODE_TABLES.get(fmt)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = decode_fp8(codes, fmt).numpy()
        table.flags.writeable = False
        table = _FP8_DECODE_TABLES[check_fp8_format(fmt)] = table
    return table


_FP8_DECODE_TABLES: dict = {}


def host_amax_ignoring_nan(values: np.ndarray) -> np.float32:
    """`tensor_amax` of fp32 values held by numpy (non-empty): max|x| with NaN ignored, 0 when every element is
    NaN, +Inf if any element is infinite.  The maximum does not depend on the order of the elements."""
    return host_amax_and_nan(values)[0]


def host_amax_and_nan(values: np.ndarray, scratch: Optional[np.ndarray] = None) -> Tuple[np.float32, bool]:
    """(`host_amax_ignoring_nan` of `values`, whether any element is NaN) from one pass over |x| (a NaN element
    makes the plain maximum NaN, which is how the second answer comes for free).  `scratch`: an fp32 array of
    the shape of `values` that receives |x| (none is allocated then)."""
    magnitudes = np.abs(values, out=scratch)
    amax = np.maximum.reduce(magnitudes, axis=None)
    if amax == amax:
        return amax, False
    # a NaN: take the maximum over the others (fmax drops NaN; NaN only when all are NaN)
    amax = np.fmax.reduce(magnitudes, axis=None)
    return (amax if amax == amax else np.float32(0.0)), True


def fp8_is_zero(codes: torch.Tensor) -> torch.Tensor:
    """True where an FP8 code is +0 (0x00) or -0 (0x80)."""
    return (codes & 0x7F) == 0


# ------------------------------------------------------------------------------------------------ E2M1 (FP4)
def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even, saturating cast of fp32 values to E2M1 codes 0..15 (one code per uint8).

    Ties go to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0);
    |x| > 5 (and +-Inf) saturate to 6; NaN becomes +6 (code 7), as the CUDA conversion does; -0 is code 8.
    """
    x = x.float()
    a = x.abs()
    code = torch.zeros_like(x, dtype=torch.uint8)
    # Each threshold adds one to the magnitude code; `<=`/`<` alternate to send ties to the even code.
    code += (a > 0.25).to(torch.uint8)
    code += (a >= 0.75).to(torch.uint8)
    code += (a > 1.25).to(torch.uint8)
    code += (a >= 1.75).to(torch.uint8)
    code += (a > 2.5).to(torch.uint8)
    code += (a >= 3.5).to(torch.uint8)
    code += (a > 5.0).to(torch.uint8)
    nan = torch.isnan(x)
    code = torch.where(nan, torch.full_like(code, 7), code)
    negative = torch.signbit(x) & ~nan
    return code | (negative.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0..15 (uint8, unpacked) to fp32 values."""
    table = _E2M1_FP32.get(codes.device)
    if table is None:  # one host-to-device copy per device, not one per call
        values = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
        table = _E2M1_FP32[codes.device] = torch.tensor(values, dtype=torch.float32).to(codes.device)
    return table[codes.long()]


_E2M1_FP32: dict = {}


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes along the last dim: element 2i in the low nibble, element 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: [..., K/2] bytes to [..., K] codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def fp4_is_zero(codes: torch.Tensor) -> torch.Tensor:
    """True where an unpacked E2M1 code is +0 (0) or -0 (8)."""
    return (codes & 0x7) == 0


# ------------------------------------------------------------------------------------------------ E8M0
def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def e8m0_rceil(ratio: torch.Tensor) -> torch.Tensor:
    """E8M0 code of a non-negative fp32 ratio, rounded toward +Inf to a power of two (TE / NVIDIA "RCEIL").

    code = biased exponent of `ratio`, plus one when the mantissa is non-zero (no increment at 254);
    NaN -> 255, +Inf -> 254, 0 -> 0; an fp32-subnormal ratio gives 1 if it exceeds 2^-127, else 0.
    """
    bits = _bits(ratio)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    code = exp + ((mant != 0) & (exp < 254) & (exp > 0)).to(torch.int32)
    subnormal = exp == 0
    code = torch.where(subnormal, ((bits & 0x7FFFFFFF) > 0x00400000).to(torch.int32), code)
    is_inf = (exp == 255) & (mant == 0)
    is_nan = (exp == 255) & (mant != 0)
    code = torch.where(is_inf, torch.full_like(code, 254), code)
    code = torch.where(is_nan, torch.full_like(code, 255), code)
    return code.to(torch.uint8)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 codes: 2^(code-127); code 0 is 2^-127 (an fp32 subnormal), 255 is NaN."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
    bits = torch.where(c == 255, torch.full_like(c, 0x7FC00000), bits)
    return _from_bits(bits)


def e8m0_encode_multiplier(codes: torch.Tensor) -> torch.Tensor:
    """The element encode multiplier 2^(127-code): code 254 gives 2^-127, code 0 gives 2^127, 255 gives NaN."""
    c = codes.to(torch.int32)
    e = 254 - c
    bits = torch.where(e >= 1, e << 23, torch.full_like(c, 0x00400000))
    bits = torch.where(c == 255, torch.full_like(c, 0x7FC00000), bits)
    return _from_bits(bits)


# ------------------------------------------------------------------------------------------------ scales
def abs_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    """fp32 |x| with NaN replaced by 0: a max over it drops NaN like CUDA's `fmaxf` amax reductions in TE."""
    a = x.float().abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """0-d fp32 max|x| over the whole tensor, NaN ignored, 0 for an empty tensor (+Inf if any element is +-Inf)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return abs_ignoring_nan(x).amax()


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Keep only sign and exponent bits of fp32 values (round a positive scale down to a power of two)."""
    return _from_bits(_bits(scale) & torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32, device=scale.device))


def compute_scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    *,
    epsilon: float = 0.0,
    pow2: bool = False,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """TE's `compute_scale_from_amax`, element-wise over fp32 amaxes (per tensor or per block).

    amax < epsilon -> epsilon; amax 0, Inf or NaN -> scale 1; else fp8_max / amax (fp32, round to nearest);
    an infinite quotient becomes `value_for_inf`; `pow2` then rounds the scale down to a power of two.
    """
    if amax.dim() == 0 and amax.device.type == "cpu":  # one CPU value: the same fp32 arithmetic, without 10 ops
        return torch.tensor(_scale_of(amax.item(), fp8_max, epsilon, pow2, value_for_inf), dtype=torch.float32)
    amax = amax.float()
    if epsilon > 0:
        amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    degenerate = (amax == 0) | ~torch.isfinite(amax)
    safe = torch.where(degenerate, torch.ones_like(amax), amax)
    scale = torch.full_like(amax, fp8_max) / safe
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    scale = torch.where(degenerate, torch.ones_like(scale), scale)
    if pow2:
        scale = round_down_pow2(scale)
    return scale


#: the largest double that rounds to a finite fp32 value is below FLT_MAX + half its ulp (2^103); doubles up to
#: FLT_MAX itself round to fp32 without overflow
_FLT_MAX_DOUBLE = float(FLT_MAX)


def _scale_of(amax: float, fp8_max: float, epsilon: float, pow2: bool, value_for_inf: float) -> np.float32:
    """`compute_scale_from_amax` of one value in fp32 arithmetic (comparisons against fp32(epsilon), IEEE fp32
    division), as the tensor path computes it.

    The division runs in double and is rounded once to fp32: fp8_max and the amax are fp32 values, and a quotient
    of two 24-bit values computed with 53 bits then rounded to 24 is the correctly rounded fp32 quotient (double
    rounding is harmless for division when 53 >= 2·24 + 2).  A quotient beyond FLT_MAX (a tiny amax) is left to
    numpy's fp32 division, which decides between FLT_MAX and Inf."""
    f32 = np.float32
    a = float(f32(amax))
    if epsilon > 0:
        eps = float(f32(epsilon))
        if a < eps:
            a = eps
    if a == 0.0 or a - a != 0.0:  # zero, Inf or NaN
        return f32(1.0)
    quotient = float(fp8_max) / a
    if quotient <= _FLT_MAX_DOUBLE:
        scale = f32(quotient)
    else:
        with np.errstate(over="ignore"):
            scale = f32(fp8_max) / f32(a)
        if np.isinf(scale):
            scale = f32(value_for_inf)
    if pow2:
        scale = (np.array(scale, dtype=np.float32).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)[()]
    return scale
