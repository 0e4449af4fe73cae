"""NVFP4 (E2M1 elements, E4M3 block scales, fp32 global scale): `NVFP4Quantizer` -> `NVFP4Tensor`.

Bit-exact TE rule, all in fp32:

- global: S_enc = 2688 / amax (clamped to FLT_MAX; 1 when amax is 0 or S_enc is 0);
- block of 16: S_dec_b = E4M3_RNE_satfinite(min(block_amax · (S_enc · fp32(1/6)), FLT_MAX));
- encode multiplier = min(1 / (fp32(S_dec_b) · fp32(1/S_enc)), FLT_MAX);
- elements: q = E2M1(clamp(x · multiplier, ±6)) with round-to-nearest-even, or TE's software stochastic rounding;
- decode (TE's dequantize kernel): x ≈ q · ((fp32(S_dec_b) · amax) · fp32(1/2688)).

Amaxes ignore NaN (TE reduces with `fmaxf`); E2M1 has no NaN, so a NaN element becomes +6 (code 7).  An Inf
makes the global amax Inf, so (as in TE) every decoded value of that representation is Inf or NaN.

Layouts (uint8, unpadded, unswizzled): rowwise data `[..., K/2]` (1x16 blocks along K; two elements per byte,
even element in the low nibble), scales `[M, K/16]` E4M3 codes, `amax_rowwise` 0-d fp32.  Columnwise holds the
*transposed* 2-D view: data `[K, M/2]` with 1x16 blocks along M, scales `[K, M/16]`, its own `amax_columnwise`.

Options: `with_2d_quantization` (one scale per 16x16 tile of the 2-D view, written for every row of the tile, so
rowwise and columnwise are numerically identical); `with_rht` (columnwise only: random Hadamard transform of each
row of 16 consecutive elements of the transposed tensor, global amax taken after it; `dequantize("columnwise")`
undoes it); `stochastic_rounding` (8 random bits per element from Philox4x32-10 keyed by `seed`: the same bytes
on CPU and GPU).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from tedebug.backends import dispatch
from tedebug.backends.dispatch import KernelChoice
from tedebug.backends.fused_stats import attach_fused, attach_high_precision
from tedebug.format_constants import NVFP4_GLOBAL_MAX, RHT_SIGNS  # 2688 = 448 * 6; TE's RHT signs

from .formats import (
    E2M1_MAX,
    E4M3,
    FLT_MAX,
    abs_ignoring_nan,
    decode_e2m1,
    decode_fp8,
    encode_e2m1,
    encode_fp8,
    fp4_is_zero,
    pack_fp4,
    unpack_fp4,
)
from .gemm_values import GemmValues, nvfp4_values_bf16
from .philox import philox_bytes
from .tensor import USAGES, QuantizedTensor, Quantizer, UnsupportedShapeError, matrix_shape

NVFP4_BLOCK = 16
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)

#: fp32(1/2688) as a Python float (a tensor times it multiplies in fp32, as TE's reference quantizer's `_f32(1/2688)`)
_INV_GLOBAL_MAX = float(torch.tensor(1.0 / NVFP4_GLOBAL_MAX, dtype=torch.float32))


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    """The 0-d fp32 constant `value` on `like`'s device; one copy per (value, device), so that the torch path
    copies no constant from the host per call (callers must not modify it)."""
    key = (value, like.device)
    constant = _CONSTANTS.get(key)
    if constant is None:
        constant = _CONSTANTS[key] = torch.tensor(value, dtype=torch.float32).to(like.device)
    return constant


_CONSTANTS: dict = {}


# ------------------------------------------------------------------------------------------------ scale rule
def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 2688 / amax in fp32, FLT_MAX when that overflows, 1 when amax is 0 or the quotient is 0."""
    amax = amax.float()
    s_enc = _f32(NVFP4_GLOBAL_MAX, amax) / amax
    s_enc = torch.clamp(s_enc, max=FLT_MAX)
    degenerate = (amax == 0) | (s_enc == 0)
    return torch.where(degenerate, torch.ones_like(s_enc), s_enc)


def block_scale_codes(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of the block decode scales: E4M3(min(block_amax · (S_enc · fp32(1/6)), FLT_MAX))."""
    factor = s_enc * _f32(1.0 / E2M1_MAX, s_enc)
    return encode_fp8(torch.clamp(block_amax.float() * factor, max=FLT_MAX), E4M3)


def block_encode_multiplier(scale_codes: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """Per-block element multiplier min(1 / (fp32(S_dec_b) · fp32(1/S_enc)), FLT_MAX) (FLT_MAX for a 0 scale)."""
    s_dec = torch.ones_like(s_enc) / s_enc
    product = decode_fp8(scale_codes, E4M3) * s_dec
    return torch.clamp(torch.ones_like(product) / product, max=FLT_MAX)


def block_decode_scale(scale_codes: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """TE's dequantization factor per block: (fp32(S_dec_b) · amax) · fp32(1/2688)."""
    return (decode_fp8(scale_codes, E4M3) * amax.float()) * _f32(1.0 / NVFP4_GLOBAL_MAX, scale_codes)


# ------------------------------------------------------------------------------------------------ rounding
def _e2m1_step(a: torch.Tensor) -> torch.Tensor:
    """Spacing of the E2M1 grid at magnitude `a`: 0.5 below 2, 1 in [2, 4), 2 from 4 up."""
    return torch.where(a < 2, torch.full_like(a, 0.5), torch.where(a < 4, torch.ones_like(a), torch.full_like(a, 2.0)))


def stochastic_round_e2m1(v: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """TE's software stochastic rounding of fp32 `v` onto the E2M1 grid (returns grid values, fp32).

    u = bits / 256; t = |v| + u · step(|v|); result = floor(t / step(t)) · step(t), at most 6, sign of `v`
    restored (a negative value rounding to 0 gives -0); NaN gives +6.
    """
    a = v.abs()
    u = random_bits.float() * _f32(1.0 / 256.0, v)
    t = a + u * _e2m1_step(a)
    step_t = _e2m1_step(t)
    r = torch.clamp(torch.floor(t / step_t) * step_t, max=E2M1_MAX)
    r = torch.copysign(r, v)
    return torch.where(torch.isnan(v), torch.full_like(v, E2M1_MAX), r)


# ------------------------------------------------------------------------------------------------ RHT
def sylvester_hadamard(n: int = NVFP4_BLOCK) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1, float64); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def rht_matrix(device=None) -> torch.Tensor:
    """TE's 16x16 RHT matrix diag(signs) · H16 / 4 in float64 (orthogonal, so its inverse is its transpose).

    One copy per device is kept (callers must not modify it), so the GPU path copies it to the device once."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    matrix = _RHT_MATRICES.get(device)
    if matrix is None:
        signs = torch.tensor(RHT_SIGNS, dtype=torch.float64)
        matrix = _RHT_MATRICES[device] = (signs.unsqueeze(1) * sylvester_hadamard(NVFP4_BLOCK) / 4.0).to(device)
    return matrix


_RHT_MATRICES: dict = {}


def apply_rht(rows: torch.Tensor, *, inverse: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Right-multiply every run of 16 consecutive elements along the last dim by the RHT matrix (or its inverse).

    Computed in float64, then rounded to fp32 and to `out_dtype` (TE's reference returns the input dtype).
    """
    matrix = rht_matrix(rows.device)
    if inverse:
        matrix = matrix.t()
    shape = rows.shape
    out = rows.double().reshape(*shape[:-1], shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK) @ matrix
    return out.reshape(shape).float().to(out_dtype)


# ------------------------------------------------------------------------------------------------ quantize core
def quantize_rows_1x16(
    rows: torch.Tensor,
    amax: torch.Tensor,
    block_amax: torch.Tensor,
    random_bits: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 `rows` [R, C] with 1x16 blocks along C, global `amax` and per-block amaxes [R, C/16].

    Returns (packed E2M1 bytes [R, C/2], E4M3 block-scale codes [R, C/16]).  `random_bits` (uint8 [R, C])
    switches to stochastic rounding.
    """
    r, c = rows.shape
    s_enc = global_encode_scale(amax)
    scale_codes = block_scale_codes(block_amax, s_enc)
    multiplier = block_encode_multiplier(scale_codes, s_enc)
    scaled = rows.reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK) * multiplier.unsqueeze(-1)
    scaled = torch.clamp(scaled, -E2M1_MAX, E2M1_MAX).reshape(r, c)
    if random_bits is not None:
        scaled = stochastic_round_e2m1(scaled, random_bits)
    return pack_fp4(encode_e2m1(scaled)), scale_codes


def _block_amax_1x16(rows: torch.Tensor) -> torch.Tensor:
    r, c = rows.shape
    return abs_ignoring_nan(rows).reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK).amax(dim=-1)


def _tile_amax_16x16(x2d: torch.Tensor) -> torch.Tensor:
    """Amax of every 16x16 tile of `x2d` [M, K] -> [M/16, K/16]."""
    m, k = x2d.shape
    tiles = abs_ignoring_nan(x2d).reshape(m // NVFP4_BLOCK, NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK)
    return tiles.amax(dim=(1, 3))


def check_nvfp4_shape(shape: Iterable[int], who: str = "NVFP4", *, need_rows: bool = True) -> Tuple[int, int]:
    """Validate an NVFP4 shape and return its 2-D view (M, K); `need_rows` also requires M % 16 == 0."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise UnsupportedShapeError(f"{who}: NVFP4 needs a tensor with at least 2 dims, got shape {shape}")
    k = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    if k % NVFP4_BLOCK:
        raise UnsupportedShapeError(f"{who}: NVFP4 needs the last dim divisible by {NVFP4_BLOCK}; got shape {shape}")
    if need_rows and m % NVFP4_BLOCK:
        raise UnsupportedShapeError(
            f"{who}: NVFP4 columnwise or 2D quantization needs the product of the leading dims divisible by "
            f"{NVFP4_BLOCK}; got shape {shape} (product {m})"
        )
    return m, k


# ------------------------------------------------------------------------------------------------ tensor
class NVFP4Tensor(QuantizedTensor):
    """NVFP4 data: packed E2M1 codes, E4M3 block-scale codes and a global amax per direction."""

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device,
        quantizer: Optional[Quantizer],
        *,
        columnwise_rht: bool = False,
        rowwise_data: Optional[torch.Tensor] = None,
        rowwise_scale_inv: Optional[torch.Tensor] = None,
        amax_rowwise: Optional[torch.Tensor] = None,
        columnwise_data: Optional[torch.Tensor] = None,
        columnwise_scale_inv: Optional[torch.Tensor] = None,
        amax_columnwise: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__(shape, dtype, device, quantizer)
        #: True when the columnwise data holds the RHT-rotated transposed tensor.
        self.columnwise_rht = bool(columnwise_rht)
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.amax_rowwise = amax_rowwise
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.amax_columnwise = amax_columnwise
        #: (amax_rowwise, amax_columnwise, (rowwise factor, columnwise factor)): 0-d fp32 views of both amaxes times
        #: fp32(1/2688) when the kernel path computed the GEMM factors of both directions in one op (`gemm_values`
        #: takes one while its amax is the one stored)
        self._gemm_factors: Optional[Tuple[object, object, Tuple[torch.Tensor, ...]]] = None

    def _fields_of(self, usage: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if usage not in USAGES:
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        data = getattr(self, f"{usage}_data")
        if data is None:
            raise RuntimeError(f"{type(self).__name__}: the {usage} representation is not available")
        return data, getattr(self, f"{usage}_scale_inv"), getattr(self, f"amax_{usage}")

    def _dequantize(self, usage: str) -> torch.Tensor:
        data, scale_codes, amax = self._fields_of(usage)
        m, k = matrix_shape(self.shape)
        r, c = (m, k) if usage == "rowwise" else (k, m)
        codes = unpack_fp4(data.reshape(r, c // 2))
        values = decode_e2m1(codes).reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK)
        values = (values * block_decode_scale(scale_codes, amax).unsqueeze(-1)).reshape(r, c)
        if usage == "rowwise":
            return values.reshape(self.shape)
        if self.columnwise_rht:
            values = apply_rht(values, inverse=True)
        return values.t().reshape(self.shape)

    def gemm_values(self, usage: str) -> GemmValues:
        """E2M1 values x E4M3 block scales in bf16 (exact), the factor amax · fp32(1/2688) as a 0-d device tensor;
        the columnwise values stay rotated when quantized after the RHT.  See `gemm_values`."""
        data, scale_codes, amax = self._fields_of(usage)
        m, k = matrix_shape(self.shape)
        slot = 0 if usage == "rowwise" else 1
        cached = self._gemm_factors
        if cached is not None and cached[slot] is amax:
            factor = cached[2][slot]  # the same fp32 product, computed at quantization for both directions
        else:
            factor = amax.float().reshape(()) * _INV_GLOBAL_MAX
        if usage == "rowwise":
            return GemmValues(nvfp4_values_bf16(data, scale_codes, m, k), factor)
        return GemmValues(nvfp4_values_bf16(data, scale_codes, k, m).t(), factor, rotated=self.columnwise_rht)

    def nonzero_code_count(self, usage: str) -> torch.Tensor:
        """Number of elements whose E2M1 code is not +-0 (nibbles other than 0x0 and 0x8)."""
        data, _, _ = self._fields_of(usage)
        return (~fp4_is_zero(unpack_fp4(data))).sum(dtype=torch.int64)

    def code_domain(self, x: torch.Tensor, usage: str) -> torch.Tensor:
        """`x`, or for an RHT columnwise representation the rotated transposed rows that were quantized (the same
        transform and rounding as `NVFP4Quantizer._quantize`)."""
        if usage == "columnwise" and self.columnwise_rht:
            m, k = matrix_shape(x.shape)
            return apply_rht(x.detach().reshape(m, k).t(), out_dtype=x.dtype)
        return x

    def scale_inv_values(self, usage: str) -> torch.Tensor:
        """The stored E4M3 block decode scales of `usage` as fp32, without the global factor."""
        _, scale_codes, _ = self._fields_of(usage)
        return decode_fp8(scale_codes, E4M3).flatten()

    def _drop(self, usage: str) -> None:
        setattr(self, f"{usage}_data", None)
        setattr(self, f"{usage}_scale_inv", None)
        setattr(self, f"amax_{usage}", None)

    def _tensor_fields(self) -> Tuple[str, ...]:
        return (
            "rowwise_data",
            "rowwise_scale_inv",
            "amax_rowwise",
            "columnwise_data",
            "columnwise_scale_inv",
            "amax_columnwise",
        )


# ------------------------------------------------------------------------------------------------ quantizer
class NVFP4Quantizer(Quantizer):
    """Quantize to NVFP4 with TE's scale rule; optional 16x16 scales, columnwise RHT and stochastic rounding."""

    recipe_name = "nvfp4"

    def __init__(
        self,
        *,
        with_2d_quantization: bool = False,
        with_rht: bool = False,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None,
        rowwise: bool = True,
        columnwise: bool = True,
        kernel: KernelChoice = None,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, kernel=kernel)
        if with_2d_quantization and with_rht:
            raise ValueError(
                "NVFP4Quantizer: with_2d_quantization and with_rht cannot be combined (2D scales are shared "
                "between directions, the RHT changes only the columnwise values)"
            )
        self.with_2d_quantization = bool(with_2d_quantization)
        self.with_rht = bool(with_rht)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = seed
        #: the Philox key of the stochastic-rounding bits: `seed`, or one drawn from torch's default CPU generator
        #: (so `torch.manual_seed` makes it reproducible)
        self.sr_seed: int = int(seed) if seed is not None else int(torch.randint(0, 2**62, ()).item())
        #: Philox offset of the next draw (one per direction quantized with stochastic rounding)
        self.sr_offset = 0

    def next_sr_offset(self) -> int:
        """The Philox offset of the next stochastic-rounding draw (one per direction quantized); advances it."""
        offset, self.sr_offset = self.sr_offset, self.sr_offset + 1
        return offset

    def _random_bits(self, shape: Tuple[int, int], device) -> Optional[torch.Tensor]:
        """8 random bits per element from Philox4x32-10 (`tedebug.quantization.philox`: the same bytes on every
        device, drawn where the tensor lives), or None without SR; each draw advances `sr_offset`.  The GPU
        kernels compute the same bytes in place from (`sr_seed`, offset) instead."""
        if not self.stochastic_rounding:
            return None
        return philox_bytes(self.sr_seed, self.next_sr_offset(), shape[0] * shape[1], device, self.kernel).view(shape)

    def _from_kernel_buffers(self, tensor: torch.Tensor, buffers) -> NVFP4Tensor:
        """The NVFP4Tensor of the kernel path's `cupy_nvfp4.NVFP4Buffers`, carrying the statistics the kernels fused
        into the pass."""
        out = NVFP4Tensor(tensor.shape, tensor.dtype, tensor.device, self, columnwise_rht=self.with_rht)
        # the fused statistics only when someone may read them (`Quantizer.error_stats`; None: the kernel skipped)
        stats = buffers.stats if self.error_stats else (None, None, None, None)
        fused = {}
        amax_rowwise, amax_columnwise = buffers.amax.unbind()  # the 0-d views of both slots in one op
        if self.rowwise_usage:
            data = buffers.rowwise_data  # [M, K/2]: the shape of a 2-D tensor's packed codes already
            out.rowwise_data = data if tensor.dim() == 2 else data.reshape(*tensor.shape[:-1], tensor.shape[-1] // 2)
            out.rowwise_scale_inv = buffers.rowwise_scale_inv
            out.amax_rowwise = amax_rowwise
            if stats[0] is not None:
                fused["rowwise"] = {"underflows_num": stats[0], "sq_err": stats[1]}
        if self.columnwise_usage:
            out.columnwise_data = buffers.columnwise_data
            out.columnwise_scale_inv = buffers.columnwise_scale_inv
            out.amax_columnwise = amax_columnwise
            if stats[2] is not None:
                fused["columnwise"] = {"underflows_num": stats[2], "sq_err": stats[3]}
        attach_fused(out, tensor, fused)
        if buffers.high_precision_stats is not None:
            attach_high_precision(tensor, buffers.high_precision_stats)
        if self.rowwise_usage and self.columnwise_usage:  # both GEMM factors in one op instead of one per GEMM
            out._gemm_factors = (amax_rowwise, amax_columnwise, (buffers.amax * _INV_GLOBAL_MAX).unbind())
        return out

    def _quantize(self, tensor: torch.Tensor) -> NVFP4Tensor:
        # GPU dispatch hook: the CuPy kernel's buffers when it applies, else the torch path below
        buffers = dispatch.quantize_nvfp4(self, tensor, self.kernel)
        if buffers is not None:
            return self._from_kernel_buffers(tensor, buffers)
        who = type(self).__name__
        if tensor.dtype not in _HIGH_PRECISION:
            raise TypeError(f"{who}: expected a float32/bfloat16/float16 tensor, got dtype {tensor.dtype}")
        need_rows = self.columnwise_usage or self.with_2d_quantization
        m, k = check_nvfp4_shape(tensor.shape, who, need_rows=need_rows)
        x_hp = tensor.detach().reshape(m, k)
        x = x_hp.float()
        out = NVFP4Tensor(tensor.shape, tensor.dtype, tensor.device, self, columnwise_rht=self.with_rht)
        amax = abs_ignoring_nan(x).amax() if x.numel() else torch.zeros((), device=x.device)
        tiles = _tile_amax_16x16(x) if self.with_2d_quantization else None
        if self.rowwise_usage:
            block_amax = tiles.repeat_interleave(NVFP4_BLOCK, dim=0) if tiles is not None else _block_amax_1x16(x)
            data, scales = quantize_rows_1x16(x, amax, block_amax, self._random_bits((m, k), x.device))
            out.rowwise_data = data.reshape(*tensor.shape[:-1], k // 2)
            out.rowwise_scale_inv = scales
            out.amax_rowwise = amax.clone()
        if self.columnwise_usage:
            xt = x.t().contiguous()
            col_amax = amax
            if self.with_rht:
                xt = apply_rht(x_hp.t(), out_dtype=tensor.dtype).float()
                col_amax = abs_ignoring_nan(xt).amax() if xt.numel() else torch.zeros((), device=x.device)
            if tiles is not None:
                block_amax = tiles.t().repeat_interleave(NVFP4_BLOCK, dim=0)
            else:
                block_amax = _block_amax_1x16(xt)
            data, scales = quantize_rows_1x16(xt, col_amax, block_amax, self._random_bits((k, m), x.device))
            out.columnwise_data = data
            out.columnwise_scale_inv = scales
            out.amax_columnwise = col_amax.clone()
        return out

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None) -> NVFP4Tensor:
        shape = torch.Size(shape)
        need_rows = self.columnwise_usage or self.with_2d_quantization
        m, k = check_nvfp4_shape(shape, type(self).__name__, need_rows=need_rows)
        device = torch.device(device) if device is not None else torch.device("cpu")
        out = NVFP4Tensor(shape, dtype, device, self, columnwise_rht=self.with_rht)
        if self.rowwise_usage:
            out.rowwise_data = torch.empty(*shape[:-1], k // 2, dtype=torch.uint8, device=device)
            out.rowwise_scale_inv = torch.empty(m, k // NVFP4_BLOCK, dtype=torch.uint8, device=device)
            out.amax_rowwise = torch.zeros((), dtype=torch.float32, device=device)
        if self.columnwise_usage:
            out.columnwise_data = torch.empty(k, m // 2, dtype=torch.uint8, device=device)
            out.columnwise_scale_inv = torch.empty(k, m // NVFP4_BLOCK, dtype=torch.uint8, device=device)
            out.amax_columnwise = torch.zeros((), dtype=torch.float32, device=device)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(with_2d_quantization={self.with_2d_quantization}, with_rht={self.with_rht}, "
            f"stochastic_rounding={self.stochastic_rounding}, rowwise={self.rowwise_usage}, "
            f"columnwise={self.columnwise_usage})"
        )
