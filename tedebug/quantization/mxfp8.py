"""MXFP8 (OCP microscaling FP8 with TE's "RCEIL" scale rule): `MXFP8Quantizer` -> `MXFP8Tensor`.

One E8M0 scale per block of 32 elements:

- rowwise: 1x32 blocks along the last dim of the 2-D view `[M, K]` (M = product of the leading dims);
- columnwise: 32x1 blocks along the first dim of that view, *same* `[M, K]` data layout (not transposed).

Both directions are quantized independently from the high-precision input.  Per block:
ratio = amax · fp32(1/fp8_max) (fp32 product, as TE multiplies by the reciprocal), code = `e8m0_rceil(ratio)`,
elements = RNE-satfinite-FP8(x · 2^(127-code)) computed in fp32, decode x ≈ q · 2^(code-127).  The block amax
ignores NaN (TE reduces with `fmaxf`, which drops NaN): a NaN element is stored as the FP8 NaN code and does not
poison the scale of its block; +-Inf gives amax Inf, scale code 254.

Storage (all uint8): `rowwise_data` / `columnwise_data` are FP8 codes in the logical shape `[..., K]`;
`rowwise_scale_inv` is `[M, K/32]` and `columnwise_scale_inv` is `[M/32, K]` E8M0 codes, *unpadded and
unswizzled*.  The padded (roundup to 128 / 4) and swizzled layout that cuBLAS MX GEMMs consume is not produced:
tedebug only emulates MX GEMMs by dequantizing.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from tedebug.backends import dispatch
from tedebug.backends.dispatch import KernelChoice
from tedebug.backends.fused_stats import COLUMNWISE_STATS, ROWWISE_STATS, FusedStats, attach_fused

from .formats import (
    FP8_MAX,
    abs_ignoring_nan,
    decode_fp8,
    e8m0_encode_multiplier,
    e8m0_rceil,
    e8m0_to_float,
    encode_fp8,
    fp8_format_of,
    fp8_is_zero,
)
from .gemm_values import MXFP8_LIFT, GemmValues, mxfp8_values_bf16
from .tensor import USAGES, QuantizedTensor, Quantizer, UnsupportedShapeError, check_high_precision_input

MXFP8_BLOCK = 32


# ------------------------------------------------------------------------------------------------ block math
def mxfp8_scale_codes(block_amax: torch.Tensor, fp8_format: str) -> torch.Tensor:
    """E8M0 codes (uint8) of fp32 block amaxes: RCEIL of amax · fp32(1/fp8_max)."""
    inv_max = torch.tensor(1.0 / FP8_MAX[fp8_format], dtype=torch.float32, device=block_amax.device)
    return e8m0_rceil(block_amax.float() * inv_max)


def mxfp8_quantize_blocks(blocks: torch.Tensor, fp8_format: str, dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 `blocks` whose size-32 block axis is `dim`.

    Returns (FP8 codes of `blocks`' shape, E8M0 scale codes with `dim` reduced away).
    """
    amax = abs_ignoring_nan(blocks).amax(dim=dim)
    scale_codes = mxfp8_scale_codes(amax, fp8_format)
    multiplier = e8m0_encode_multiplier(scale_codes).unsqueeze(dim)
    return encode_fp8(blocks * multiplier, fp8_format), scale_codes


def check_mxfp8_shape(shape: Iterable[int], who: str = "MXFP8") -> Tuple[int, int]:
    """Validate an MXFP8 shape and return its 2-D view `(M, K)`."""
    if type(shape) is not torch.Size:  # (a torch.Size holds ints already: every quantization and GEMM passes one)
        shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise UnsupportedShapeError(f"{who}: MXFP8 needs a tensor with at least 2 dims, got shape {tuple(shape)}")
    k = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    if k % MXFP8_BLOCK or m % MXFP8_BLOCK:
        raise UnsupportedShapeError(
            f"{who}: MXFP8 needs the last dim and the product of the other dims divisible by {MXFP8_BLOCK}; "
            f"got shape {tuple(shape)} (last dim {k}, product of the others {m})"
        )
    return m, k


# ------------------------------------------------------------------------------------------------ tensor
class MXFP8Tensor(QuantizedTensor):
    """MXFP8 data: FP8 codes in the logical shape plus unpadded E8M0 block-scale codes per direction."""

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device,
        quantizer: Optional[Quantizer],
        *,
        fp8_format: str,
        rowwise_data: Optional[torch.Tensor] = None,
        rowwise_scale_inv: Optional[torch.Tensor] = None,
        columnwise_data: Optional[torch.Tensor] = None,
        columnwise_scale_inv: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__(shape, dtype, device, quantizer)
        self.fp8_format = fp8_format_of(fp8_format)
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv

    def _view2d(self) -> Tuple[int, int]:
        return check_mxfp8_shape(self.shape, type(self).__name__)

    def _dequantize(self, usage: str) -> torch.Tensor:
        m, k = self._view2d()
        data, codes = self._fields_of(usage)
        if usage == "rowwise":
            values = decode_fp8(data.reshape(m, k // MXFP8_BLOCK, MXFP8_BLOCK), self.fp8_format)
            scales = e8m0_to_float(codes).unsqueeze(-1)
        else:
            values = decode_fp8(data.reshape(m // MXFP8_BLOCK, MXFP8_BLOCK, k), self.fp8_format)
            scales = e8m0_to_float(codes).unsqueeze(1)
        return (values * scales).reshape(self.shape)

    def gemm_values(self, usage: str) -> GemmValues:
        """Codes x 2^(E-127+L) in bf16 (exact; L = `MXFP8_LIFT`), scale 2^-L: see `gemm_values`."""
        data, scale_codes = self._fields_of(usage)
        m, k = self._view2d()
        lift = MXFP8_LIFT[self.fp8_format]
        codes = data if data.dim() == 2 else data.reshape(m, k)  # (the codes of a 2-D tensor are [M, K] already)
        values = mxfp8_values_bf16(codes, scale_codes, usage == "rowwise", self.fp8_format, lift)
        return GemmValues(values, 2.0**-lift)

    def _fields_of(self, usage: str) -> Tuple[torch.Tensor, torch.Tensor]:
        if usage not in USAGES:
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        data = getattr(self, f"{usage}_data")
        if data is None:
            raise RuntimeError(f"{type(self).__name__}: the {usage} representation is not available")
        return data, getattr(self, f"{usage}_scale_inv")

    def nonzero_code_count(self, usage: str) -> torch.Tensor:
        """Number of elements whose FP8 code is not +-0 (NaN codes count as nonzero)."""
        data, _ = self._fields_of(usage)
        return (~fp8_is_zero(data)).sum(dtype=torch.int64)

    def scale_inv_values(self, usage: str) -> torch.Tensor:
        """Every block decode scale 2^(code-127) of `usage` as fp32 (no padding is stored)."""
        _, scales = self._fields_of(usage)
        return e8m0_to_float(scales).flatten()

    def _drop(self, usage: str) -> None:
        setattr(self, f"{usage}_data", None)
        setattr(self, f"{usage}_scale_inv", None)

    def _tensor_fields(self) -> Tuple[str, ...]:
        return ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


# ------------------------------------------------------------------------------------------------ quantizer
class MXFP8Quantizer(Quantizer):
    """Quantize to MXFP8 (E4M3 or E5M2 elements, 1x32 / 32x1 blocks, E8M0 RCEIL scales)."""

    recipe_name = "mxfp8"

    def __init__(
        self, fp8_format="E4M3", *, rowwise: bool = True, columnwise: bool = True, kernel: KernelChoice = None
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, kernel=kernel)
        self.fp8_format = fp8_format_of(fp8_format)

    def _quantize(self, tensor: torch.Tensor) -> MXFP8Tensor:
        who = type(self).__name__
        check_high_precision_input(tensor, who)
        m, k = check_mxfp8_shape(tensor.shape, who)
        out = MXFP8Tensor(tensor.shape, tensor.dtype, tensor.device, self, fp8_format=self.fp8_format)
        # GPU dispatch hook: the CuPy kernel's buffers when it applies, else the torch path below
        buffers = dispatch.quantize_mxfp8(
            tensor, self.fp8_format, self.rowwise_usage, self.columnwise_usage, self.kernel
        )
        if buffers is not None:
            fused = {}
            flat = tensor.dim() == 2  # the kernel's [M, K] codes are in the tensor's shape already
            if self.rowwise_usage:
                out.rowwise_data = buffers.rowwise_data if flat else buffers.rowwise_data.reshape(tensor.shape)
                out.rowwise_scale_inv = buffers.rowwise_scale_inv
                fused["rowwise"] = FusedStats(buffers.stats, ROWWISE_STATS)
            if self.columnwise_usage:
                col = buffers.columnwise_data
                out.columnwise_data = col if flat else col.reshape(tensor.shape)
                out.columnwise_scale_inv = buffers.columnwise_scale_inv
                fused["columnwise"] = FusedStats(buffers.stats, COLUMNWISE_STATS)
            attach_fused(out, tensor, fused)  # the statistics the kernel fused into the pass
            return out
        x = tensor.detach().float().reshape(m, k)
        if self.rowwise_usage:
            codes, scales = mxfp8_quantize_blocks(x.reshape(m, k // MXFP8_BLOCK, MXFP8_BLOCK), self.fp8_format, -1)
            out.rowwise_data = codes.reshape(tensor.shape)
            out.rowwise_scale_inv = scales
        if self.columnwise_usage:
            codes, scales = mxfp8_quantize_blocks(x.reshape(m // MXFP8_BLOCK, MXFP8_BLOCK, k), self.fp8_format, 1)
            out.columnwise_data = codes.reshape(tensor.shape)
            out.columnwise_scale_inv = scales
        return out

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None) -> MXFP8Tensor:
        shape = torch.Size(shape)
        m, k = check_mxfp8_shape(shape, type(self).__name__)
        device = torch.device(device) if device is not None else torch.device("cpu")
        out = MXFP8Tensor(shape, dtype, device, self, fp8_format=self.fp8_format)
        if self.rowwise_usage:
            out.rowwise_data = torch.empty(shape, dtype=torch.uint8, device=device)
            out.rowwise_scale_inv = torch.empty(m, k // MXFP8_BLOCK, dtype=torch.uint8, device=device)
        if self.columnwise_usage:
            out.columnwise_data = torch.empty(shape, dtype=torch.uint8, device=device)
            out.columnwise_scale_inv = torch.empty(m // MXFP8_BLOCK, k, dtype=torch.uint8, device=device)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fp8_format={self.fp8_format!r}, rowwise={self.rowwise_usage}, "
            f"columnwise={self.columnwise_usage})"
        )
