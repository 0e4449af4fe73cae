"""An independent scalar oracle of FP8 / E8M0 / MXFP8 (pure Python + numpy float32, no tedebug code), shared by
test_mxfp8.py and test_nvfp4.py: FP8 rounding searches the table of representable values built from the bit layout
(nearest, ties to the even code, saturating), E8M0 RCEIL is clamp(ceil(log2 r) + 127, 0, 254) via `math.frexp`."""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

FLT_MAX = float(np.finfo(np.float32).max)
FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}
_LAYOUT = {"E4M3": (4, 3, 7), "E5M2": (5, 2, 15)}


def fp8_value(code: int, fmt: str) -> float:
    """Real value of an FP8 code from its sign / exponent / mantissa fields."""
    ebits, mbits, bias = _LAYOUT[fmt]
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> mbits) & ((1 << ebits) - 1)
    m = code & ((1 << mbits) - 1)
    if fmt == "E4M3" and e == 15 and m == 7:
        return math.nan
    if fmt == "E5M2" and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1.0 + m / 2**mbits) * 2.0 ** (e - bias)


_POSITIVE = {
    fmt: sorted((fp8_value(c, fmt), c) for c in range(0x80) if math.isfinite(fp8_value(c, fmt))) for fmt in _LAYOUT
}


def nearest_code(a: float, table) -> int:
    """Code of the entry of `table` (sorted (value, code)) nearest to a >= 0, saturating, ties to the even code."""
    values = [v for v, _ in table]
    a = min(a, values[-1])
    i = bisect.bisect_left(values, a)
    candidates = [table[j] for j in (i - 1, i) if 0 <= j < len(table)]
    return min(candidates, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))[1]


def fp8_rne(v: float, fmt: str) -> int:
    """SATFINITE round-to-nearest-even FP8 code of a float (NaN -> 0x7F)."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    return sign | nearest_code(abs(v), _POSITIVE[fmt])


def e8m0_rceil(r: float) -> int:
    """clamp(ceil(log2 r) + 127, 0, 254); NaN 255, Inf 254, 0 -> 0."""
    if math.isnan(r):
        return 255
    if math.isinf(r):
        return 254
    if r == 0:
        return 0
    f, e = math.frexp(r)  # r = f * 2^e, f in [0.5, 1)
    ceil_log2 = e - 1 if f == 0.5 else e
    return max(0, min(254, ceil_log2 + 127))


def nan_max_abs(values) -> float:
    return max((abs(v) for v in values if not math.isnan(v)), default=0.0)


def mxfp8_block(values, fmt: str):
    """(scale code, element codes) of one MXFP8 block given as Python floats holding fp32 values."""
    with np.errstate(all="ignore"):
        ratio = np.float32(nan_max_abs(values)) * np.float32(1.0 / FP8_MAX[fmt])
        code = e8m0_rceil(float(ratio))
        mult = np.float32(2.0 ** (127 - code))
        return code, [fp8_rne(float(np.float32(v) * mult), fmt) for v in values]


def mxfp8_oracle(x: torch.Tensor, fmt: str):
    """Rowwise (codes [M,K], scales [M,K/32]) and columnwise (codes [M,K], scales [M/32,K]) of a 2-D tensor."""
    xs = x.float().tolist()
    m, k = x.shape
    row_codes = [[0] * k for _ in range(m)]
    row_scales = [[0] * (k // 32) for _ in range(m)]
    for i in range(m):
        for b in range(k // 32):
            s, c = mxfp8_block(xs[i][32 * b : 32 * b + 32], fmt)
            row_scales[i][b] = s
            row_codes[i][32 * b : 32 * b + 32] = c
    col_codes = [[0] * k for _ in range(m)]
    col_scales = [[0] * k for _ in range(m // 32)]
    for j in range(k):
        for b in range(m // 32):
            s, c = mxfp8_block([xs[32 * b + r][j] for r in range(32)], fmt)
            col_scales[b][j] = s
            for r in range(32):
                col_codes[32 * b + r][j] = c[r]
    u8 = lambda rows: torch.tensor(rows, dtype=torch.uint8)  # noqa: E731
    return u8(row_codes), u8(row_scales), u8(col_codes), u8(col_scales)


def mxfp8_dequant64(codes: torch.Tensor, scales: torch.Tensor, fmt: str, rowwise: bool) -> torch.Tensor:
    """float64 q * 2^(code-127), expanding each scale over its 32 elements."""
    q = torch.tensor([[fp8_value(c, fmt) for c in row] for row in codes.tolist()], dtype=torch.float64)
    s = torch.tensor([[2.0 ** (c - 127) for c in row] for row in scales.tolist()], dtype=torch.float64)
    s = s.repeat_interleave(32, dim=1 if rowwise else 0)
    return q * s


def spread_tensor(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random normal values with magnitudes spread over ~2^-40..2^40 (per 8 columns), signs and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x = x * torch.exp2(torch.randint(-40, 41, (m, k // 8), generator=g).float()).repeat_interleave(8, dim=1)
    x[torch.rand(m, k, generator=g) < 0.05] = 0.0
    return x.to(dtype)
