"""FP8 blockwise scaling (DeepSeek-V3 style): `Float8BlockQuantizer` -> `Float8BlockwiseTensor`.

One fp32 scale per block of the 2-D view `[M, K]` (M = product of the leading dims): 1x128 blocks along the last dim
(`block_scaling_dim=1`) or 128x128 tiles (`block_scaling_dim=2`).  Per block: amax over the block's valid elements
(NaN ignored, like TE's `fmaxf` reductions; trailing partial blocks are allowed), scale = `compute_scale_from_amax`
with epsilon, power-of-two rounding (on by default) and the *input dtype's* max substituted for an infinite
quotient; elements = RNE-FP8(clamp(fp32(x) · scale, ±fp8_max)); `scale_inv = fp32(1 / scale)`.

Directions follow TE: the columnwise representation is the rowwise representation of the transposed 2-D view
`[K, M]` (blocks of 128 along M).  With 1x128 blocks it is quantized independently from the high-precision input;
with 128x128 tiles it is exactly the transpose of the rowwise one (so either can be derived from the other).

Storage: `rowwise_data` uint8 codes in the logical shape `[..., K]`; `columnwise_data` uint8 codes of the transposed
view `[K, M]`.  `rowwise_scale_inv` / `columnwise_scale_inv` are plain fp32 `[row_blocks, col_blocks]` tensors of
the stored data's orientation (rowwise 1D: `[M, ceil(K/128)]`, 2D: `[ceil(M/128), ceil(K/128)]`; columnwise
1D: `[K, ceil(M/128)]`, 2D: `[ceil(K/128), ceil(M/128)]`), unpadded.  TE's transposed, padded "GEMM format" scale
layout is not produced: tedebug emulates blockwise GEMMs by dequantizing.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
import torch.nn.functional as F

from tedebug.backends import dispatch
from tedebug.backends.dispatch import KernelChoice
from tedebug.backends.fused_stats import attach_fused

from .formats import (
    FP8_MAX,
    abs_ignoring_nan,
    compute_scale_from_amax,
    decode_fp8,
    encode_fp8,
    fp8_format_of,
    fp8_is_zero,
)
from .gemm_values import MXFP8_LIFT, GemmValues, fp8_block_values_bf16
from .tensor import QuantizedTensor, Quantizer, check_high_precision_input, matrix_shape

BLOCK = 128
#: (codes, scale_inv) of a direction that is not quantized
_ABSENT: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_rows_of(block_scaling_dim: int) -> int:
    """Rows per block: 1 for 1x128 blocks, 128 for 128x128 tiles."""
    if block_scaling_dim not in (1, 2):
        raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
    return 1 if block_scaling_dim == 1 else BLOCK


def scale_grid(rows: int, cols: int, block_rows: int) -> Tuple[int, int]:
    """Shape `[row_blocks, col_blocks]` of the scales of a `[rows, cols]` matrix (block width 128)."""
    return _ceil_div(rows, block_rows), _ceil_div(cols, BLOCK)


# ------------------------------------------------------------------------------------------------ block math
def quantize_blocks(
    x2d: torch.Tensor,
    block_rows: int,
    fp8_format: str,
    *,
    epsilon: float = 0.0,
    pow2: bool = True,
    value_for_inf: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor with one scale per `block_rows x 128` block along its last dim.

    Returns (uint8 codes of `x2d`'s shape, fp32 scale_inv `[row_blocks, col_blocks]`).  Partial blocks are
    zero-padded for the amax, which leaves it unchanged.
    """
    rows, cols = x2d.shape
    rb, cb = scale_grid(rows, cols, block_rows)
    padded = F.pad(x2d.float(), (0, cb * BLOCK - cols, 0, rb * block_rows - rows))
    tiles = padded.reshape(rb, block_rows, cb, BLOCK)
    amax = abs_ignoring_nan(tiles).amax(dim=(1, 3))
    scale = compute_scale_from_amax(amax, FP8_MAX[fp8_format], epsilon=epsilon, pow2=pow2, value_for_inf=value_for_inf)
    codes = encode_fp8(tiles * scale[:, None, :, None], fp8_format)
    codes = codes.reshape(rb * block_rows, cb * BLOCK)[:rows, :cols].contiguous()
    return codes, torch.ones_like(scale) / scale


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, fp8_format: str) -> torch.Tensor:
    """fp32 values of 2-D `codes` decoded with one `scale_inv` per `block_rows x 128` block."""
    rows, cols = codes.shape
    per_element = scale_inv.repeat_interleave(block_rows, dim=0).repeat_interleave(BLOCK, dim=1)
    return decode_fp8(codes, fp8_format) * per_element[:rows, :cols]


# ------------------------------------------------------------------------------------------------ tensor
class Float8BlockwiseTensor(QuantizedTensor):
    """FP8 codes with one fp32 scale per 1x128 block or 128x128 tile, rowwise and/or columnwise."""

    def __init__(
        self,
        shape: Iterable[int],
        dtype: torch.dtype,
        device,
        quantizer: Optional[Quantizer],
        *,
        fp8_format: str,
        block_scaling_dim: int,
        rowwise_data: Optional[torch.Tensor] = None,
        rowwise_scale_inv: Optional[torch.Tensor] = None,
        columnwise_data: Optional[torch.Tensor] = None,
        columnwise_scale_inv: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__(shape, dtype, device, quantizer)
        self.fp8_format = fp8_format_of(fp8_format)
        self.block_scaling_dim = block_scaling_dim
        self._block_rows = block_rows_of(block_scaling_dim)
        self._mk = matrix_shape(self._shape)
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self._check_layout()

    def _expected(self, usage: str) -> Tuple[Tuple[int, ...], Tuple[int, int]]:
        """(data shape, scale_inv shape) of one representation."""
        m, k = self._mk
        if usage == "rowwise":
            return tuple(self._shape), scale_grid(m, k, self._block_rows)
        return (k, m), scale_grid(k, m, self._block_rows)

    def _check_layout(self) -> None:
        name = type(self).__name__
        for usage in ("rowwise", "columnwise"):
            data, scale_inv = getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")
            if (data is None) != (scale_inv is None):
                raise ValueError(f"{name}: {usage}_data and {usage}_scale_inv must be given together")
            if data is None:
                continue
            data_shape, scale_shape = self._expected(usage)
            if data.dtype != torch.uint8 or tuple(data.shape) != data_shape:
                raise ValueError(
                    f"{name}.{usage}_data: expected uint8 of shape {data_shape}, "
                    f"got {data.dtype} of shape {tuple(data.shape)}"
                )
            if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != scale_shape:
                raise ValueError(
                    f"{name}.{usage}_scale_inv: expected float32 of shape {scale_shape}, "
                    f"got {scale_inv.dtype} of shape {tuple(scale_inv.shape)}"
                )

    def _dequantize(self, usage: str) -> torch.Tensor:
        m, k = self._mk
        codes, scale_inv = getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")  # both present
        if usage == "rowwise":
            values = dequantize_blocks(codes.reshape(m, k), scale_inv, self._block_rows, self.fp8_format)
        else:
            values = dequantize_blocks(codes, scale_inv, self._block_rows, self.fp8_format).t()
        return values.reshape(self._shape)

    def gemm_values(self, usage: str) -> Optional[GemmValues]:
        """With power-of-two scales (the quantizer's `force_pow_2_scales`, on by default): codes x scale_inv x 2^L in
        bf16 (exact, L as for MXFP8) and the factor 2^-L; otherwise None.  See `gemm_values`."""
        self._require(usage)
        if not getattr(self.quantizer, "force_pow_2_scales", False):
            return None
        m, k = self._mk
        codes, scale_inv = getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")
        rows, cols = (m, k) if usage == "rowwise" else (k, m)
        lift = MXFP8_LIFT[self.fp8_format]
        values = fp8_block_values_bf16(codes.reshape(rows, cols), scale_inv, self._block_rows, self.fp8_format, lift)
        return GemmValues(values if usage == "rowwise" else values.t(), 2.0**-lift)

    def _create(self, usage: str) -> None:
        """128x128 tiles: each direction is the transpose of the other; 1x128 blocks cannot be derived."""
        m, k = self._mk
        # (the type checker cannot see that a direction's scale_inv is present whenever its data is)
        if self.block_scaling_dim == 2 and usage == "columnwise" and self.rowwise_data is not None:
            self.columnwise_data = self.rowwise_data.reshape(m, k).t().contiguous()
            self.columnwise_scale_inv = self.rowwise_scale_inv.t().contiguous()  # type: ignore[union-attr]
        elif self.block_scaling_dim == 2 and usage == "rowwise" and self.columnwise_data is not None:
            self.rowwise_data = self.columnwise_data.t().contiguous().reshape(self._shape)
            self.rowwise_scale_inv = self.columnwise_scale_inv.t().contiguous()  # type: ignore[union-attr]
        else:
            super()._create(usage)

    def _drop(self, usage: str) -> None:
        setattr(self, f"{usage}_data", None)
        setattr(self, f"{usage}_scale_inv", None)

    def _tensor_fields(self) -> Tuple[str, ...]:
        return ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")

    def nonzero_code_count(self, usage: str) -> torch.Tensor:
        data = getattr(self, f"{self._require(usage)}_data")
        return (~fp8_is_zero(data)).sum(dtype=torch.int64)

    def scale_inv_values(self, usage: str) -> torch.Tensor:
        return getattr(self, f"{self._require(usage)}_scale_inv").reshape(-1)


# ------------------------------------------------------------------------------------------------ quantizer
class Float8BlockQuantizer(Quantizer):
    """Blockwise FP8 quantizer (1x128 blocks or 128x128 tiles, fp32 scales, power-of-two by default)."""

    recipe_name = "fp8_block_scaling"

    def __init__(
        self,
        fp8_format: str = "E4M3",
        *,
        block_scaling_dim: int = 2,
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = True,
        rowwise: bool = True,
        columnwise: bool = True,
        kernel: KernelChoice = None,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, kernel=kernel)
        self.fp8_format = fp8_format_of(fp8_format)
        self._block_rows = block_rows_of(block_scaling_dim)
        self.block_scaling_dim = block_scaling_dim
        if not amax_epsilon >= 0.0:
            raise ValueError(f"Float8BlockQuantizer: amax_epsilon must be >= 0, got {amax_epsilon!r}")
        self.amax_epsilon = float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)

    def _quantize_2d(self, x2d: torch.Tensor, value_for_inf: float) -> Tuple[torch.Tensor, torch.Tensor]:
        return quantize_blocks(
            x2d,
            self._block_rows,
            self.fp8_format,
            epsilon=self.amax_epsilon,
            pow2=self.force_pow_2_scales,
            value_for_inf=value_for_inf,
        )

    def _quantize(self, tensor: torch.Tensor) -> Float8BlockwiseTensor:
        check_high_precision_input(tensor, type(self).__name__)
        value_for_inf = torch.finfo(tensor.dtype).max
        # GPU dispatch hook: the CuPy kernel's buffers when it applies, else the torch path below
        buffers = dispatch.quantize_fp8_block(
            tensor,
            self.fp8_format,
            self.block_scaling_dim,
            self.amax_epsilon,
            self.force_pow_2_scales,
            value_for_inf,
            self.rowwise_usage,
            self.columnwise_usage,
            self.kernel,
        )
        row = col = _ABSENT
        fused: dict = {}
        if buffers is not None:
            if self.rowwise_usage:
                row = (buffers.rowwise_data.reshape(tensor.shape), buffers.rowwise_scale_inv)
                fused["rowwise"] = {"underflows_num": buffers.stats[0], "sq_err": buffers.stats[1]}
            if self.columnwise_usage:
                col = (buffers.columnwise_data, buffers.columnwise_scale_inv)
                fused["columnwise"] = {"underflows_num": buffers.stats[2], "sq_err": buffers.stats[3]}
        else:
            m, k = matrix_shape(tensor.shape)
            x2d = tensor.reshape(m, k)
            if self.rowwise_usage:
                codes, scale_inv = self._quantize_2d(x2d, value_for_inf)
                row = (codes.reshape(tensor.shape), scale_inv)
            if self.columnwise_usage:
                if self.block_scaling_dim == 2 and self.rowwise_usage:
                    col = (codes.t().contiguous(), scale_inv.t().contiguous())
                else:
                    col = self._quantize_2d(x2d.t(), value_for_inf)
        out = Float8BlockwiseTensor(
            tensor.shape,
            tensor.dtype,
            tensor.device,
            self,
            fp8_format=self.fp8_format,
            block_scaling_dim=self.block_scaling_dim,
            rowwise_data=row[0],
            rowwise_scale_inv=row[1],
            columnwise_data=col[0],
            columnwise_scale_inv=col[1],
        )
        if buffers is not None:
            attach_fused(out, tensor, fused)  # the statistics the kernel fused into the pass
        return out

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None) -> Float8BlockwiseTensor:
        shape = torch.Size(int(s) for s in shape)
        m, k = matrix_shape(shape)
        device = torch.device(device) if device is not None else torch.device("cpu")

        def alloc(data_shape, rows, cols):
            data = torch.empty(data_shape, dtype=torch.uint8, device=device)
            return data, torch.ones(scale_grid(rows, cols, self._block_rows), dtype=torch.float32, device=device)

        row = alloc(shape, m, k) if self.rowwise_usage else (None, None)
        col = alloc((k, m), k, m) if self.columnwise_usage else (None, None)
        return Float8BlockwiseTensor(
            shape,
            dtype,
            device,
            self,
            fp8_format=self.fp8_format,
            block_scaling_dim=self.block_scaling_dim,
            rowwise_data=row[0],
            rowwise_scale_inv=row[1],
            columnwise_data=col[0],
            columnwise_scale_inv=col[1],
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fp8_format={self.fp8_format}, block_scaling_dim={self.block_scaling_dim}, "
            f"amax_epsilon={self.amax_epsilon}, force_pow_2_scales={self.force_pow_2_scales}, "
            f"rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage})"
        )
