"""The exactness argument behind the RHT kernels' rotation (`nr_rotate` in kernels/nvfp4.cu), checked on CPU.

The kernels compute y_j = sum_i v_i * s_i * (-1)^popc(i & j) / 4 of a 16-element group with a Walsh-Hadamard
butterfly in fp32 (path A) or fp64 (path B) when the group's exponent span proves every partial sum exact, else
with the sequential fp64 sum (path C).  This module replays the path selection and the two butterflies with the
kernel's exact operations (IEEE fp32 / fp64 adds, one rounding of S / 4) and compares them bit for bit with an
independent oracle: the exact sum in integers, rounded fp64 -> fp32 as the reference's fp64 matmul result is.  It
also shows that the span bound matters (an fp32 butterfly beyond it is wrong for some groups) and that the
selection reaches both paths at their bounds.  CPU only, a fraction of a second.
"""

import math

import pytest
import torch

from tedebug.backends.cupy_nvfp4 import rht_sign_mask
from tedebug.quantization.nvfp4 import apply_rht

# kernels/nvfp4.cu: NR_SPAN32 / NR_SPAN64 per dtype (20 - p and 49 - p for p significand bits) and path A's
# overflow guard on the biased exponent of max |v|
SPANS = {torch.bfloat16: (12, 41), torch.float16: (9, 38), torch.float32: (None, 25)}
E_MAX_A = 250
MASK32 = 0xFFFFFFFF


def signs() -> torch.Tensor:
    mask = rht_sign_mask()
    return torch.tensor([-1.0 if (mask >> i) & 1 else 1.0 for i in range(16)])


def select_paths(v: torch.Tensor, dtype: torch.dtype):
    """The kernel's path masks (A, B) of fp32 groups v [N, 16] (nr_rotate's integer arithmetic, mod 2^32)."""
    bits = v.view(torch.int32).to(torch.int64) & MASK32
    am = torch.where(v.isnan(), torch.zeros_like(v), v.abs()).amax(dim=1)  # max |v|, NaN dropped
    mn2 = ((bits * 2 - 1) & MASK32).amin(dim=1)
    e_max = torch.clamp((am.view(torch.int32).to(torch.int64) & MASK32) >> 23, min=1)
    e_min = torch.clamp(((mn2 + 1) & MASK32) >> 24, min=1)
    span = (e_max - e_min) & MASK32
    span32, span64 = SPANS[dtype]
    path_a = (span <= span32) & (e_max <= E_MAX_A) if span32 is not None else torch.zeros_like(span, dtype=torch.bool)
    path_b = ~path_a & (span <= span64)
    return path_a, path_b, span


def butterfly(t: torch.Tensor) -> torch.Tensor:
    """t_j <- sum_i (-1)^popc(i & j) t_i along the last dim, as nr_fwht32 / nr_fwht64 (same dtype, IEEE adds)."""
    t = t.clone()
    h = 1
    while h < 16:
        for a in range(16):
            if a & h:
                continue
            u, w = t[:, a].clone(), t[:, a + h].clone()
            t[:, a], t[:, a + h] = u + w, u - w
        h *= 2
    return t


def rotate_a(v: torch.Tensor) -> torch.Tensor:
    """Path A: fp32 butterfly of s_i v_i, then fma(S, 0.25, +0) (S * 0.25 rounds once; + 0 only turns -0 into +0)."""
    return butterfly(v * signs()) * 0.25 + 0.0


def rotate_b(v: torch.Tensor) -> torch.Tensor:
    """Path B: fp64 butterfly of s_i v_i, then fp32(S * 0.25 + 0)."""
    return (butterfly((v * signs()).double()) * 0.25 + 0.0).float()


def rotate_sequential(v: torch.Tensor) -> torch.Tensor:
    """Path C: fp64, terms v_i * s_i / 4 added in order i = 0..15 from +0, then fp32."""
    t = v.double() * (signs().double() / 4)
    out = torch.empty_like(t)
    for j in range(16):
        acc = torch.zeros(t.shape[0], dtype=torch.float64)
        for i in range(16):
            acc = acc - t[:, i] if bin(i & j).count("1") % 2 else acc + t[:, i]
        out[:, j] = acc
    return out.float()


def exact_oracle(v: torch.Tensor) -> torch.Tensor:
    """fp32(fp64(exact y)) of finite groups: the sum in integers (every value is a multiple of 2^-149), one correctly
    rounded division to fp64, then fp64 -> fp32."""
    s = [int(x) for x in signs().tolist()]
    out = []
    for row in v.double().tolist():
        n = []
        for x in row:
            num, den = float(x).as_integer_ratio()
            n.append(num * (2**149 // den))
        out.append([sum(s[i] * n[i] * (-1) ** bin(i & j).count("1") for i in range(16)) / 2**151 for j in range(16)])
    return torch.tensor(out, dtype=torch.float64).float()


def groups(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Finite groups [n, 16] of `dtype` values as fp32: spans 0 .. 45 binades (full significands, random signs,
    some zeros), the largest exponent near the top of the range for some, subnormal groups for 16-bit types."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    top = math.floor(math.log2(fi.max))
    span = torch.randint(0, 46, (n, 1), generator=g)
    e_hi = torch.randint(-20, 20, (n, 1), generator=g)
    e_hi[: n // 16] = top - torch.randint(0, 8, (n // 16, 1), generator=g)  # near the overflow guard
    e = e_hi - (torch.rand(n, 16, generator=g) * (span + 1)).floor().long()
    e[:, 0], e[:, 1] = e_hi[:, 0], e_hi[:, 0] - span[:, 0]  # the span is attained
    mant = 1 + torch.rand(n, 16, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, 16, generator=g) < 0.5, -1.0, 1.0).double()
    x = (sign * mant * torch.exp2(e.double())).clamp(-fi.max, fi.max)
    x[torch.rand(n, 16, generator=g) < 0.05] = 0.0
    # rows 0 .. 3: spans exactly at and one past each bound (largest |v| 2^hi, smallest 2^(hi - span))
    hi = max(min(top, 10), SPANS[dtype][1] + 1 + math.log2(fi.tiny * fi.eps))  # the smallest one representable
    for row, target in enumerate(b + d for b in SPANS[dtype] if b is not None for d in (0, 1)):
        x[row] = sign[row] * mant[row] * torch.exp2(hi - torch.rand(16, generator=g, dtype=torch.float64) * target)
        x[row, 0], x[row, 1] = 2.0**hi * 1.5, -(2.0 ** (hi - target))
    if dtype != torch.float32:
        sub = torch.randint(-40, 41, (n // 16, 16), generator=g).double() * fi.tiny / 64
        x[n // 16 : n // 8] = sub  # subnormal groups
    return x.to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_butterfly_paths_equal_the_exact_rotation(dtype):
    v = groups(dtype, 384, 7)
    assert torch.isfinite(v).all()
    path_a, path_b, span = select_paths(v, dtype)
    want = exact_oracle(v)
    span32, span64 = SPANS[dtype]
    if span32 is not None:
        assert path_a.sum() > 50 and (span[path_a] == span32).any()  # path A reached, up to its bound
        assert torch.equal(rotate_a(v[path_a]).view(torch.int32), want[path_a].view(torch.int32))
    assert path_b.sum() > 50 and (span[path_b] == span64).any()
    assert torch.equal(rotate_b(v[path_b]).view(torch.int32), want[path_b].view(torch.int32))
    # the reference itself (fp64 matmul, then the dtype) agrees wherever the kernel takes a butterfly
    fast = path_a | path_b
    ref = apply_rht(v[fast].to(dtype), out_dtype=dtype).float()
    assert torch.equal(ref.view(torch.int32), want[fast].to(dtype).float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_span_bound_is_needed(dtype):
    """Beyond path A's span the fp32 butterfly loses bits for some groups (the selection is not vacuous)."""
    v = groups(dtype, 256, 8)
    path_a, _, span = select_paths(v, dtype)
    wide = (~path_a) & (span <= 41) & (v.abs().amax(dim=1) < 2.0**100)
    wrong = rotate_a(v[wide]).view(torch.int32) != exact_oracle(v[wide]).view(torch.int32)
    assert wrong.any()


def test_zero_groups_rotate_to_plus_zero():
    """All-zero groups, whatever the signs of their zeros, give +0 on path A, as the sequential sum from +0 does."""
    g = torch.Generator().manual_seed(9)
    z = torch.where(torch.rand(64, 16, generator=g) < 0.5, -0.0, 0.0)
    z[0] = -0.0 * signs() * -1  # every term s_i * z_i a -0 for y_0
    path_a, _, _ = select_paths(z, torch.bfloat16)
    assert path_a.all()
    assert (rotate_a(z).view(torch.int32) == 0).all()
    assert torch.equal(rotate_a(z).view(torch.int32), rotate_sequential(z).view(torch.int32))


def test_non_finite_groups():
    """An Inf never takes path A; path B gives the sequential sum's Inf / NaN; a NaN makes every output NaN."""
    fi = torch.finfo(torch.bfloat16)
    v = torch.ones(4, 16) * 2.0**120
    v[0, 3] = float("inf")
    v[1, 3], v[1, 9] = float("inf"), -float("inf")
    v[2, 5] = float("nan")
    v[3, 0] = fi.max
    v = v.to(torch.bfloat16).float()
    path_a, path_b, _ = select_paths(v, torch.bfloat16)
    assert not path_a[:2].any() and path_b[:2].all()
    got = rotate_b(v[:2])
    want = rotate_sequential(v[:2])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert got.isinf().any() and got.isnan()[1].any()
    assert rotate_a(v[2:3]).isnan().all() and rotate_sequential(v[2:3]).isnan().all()
