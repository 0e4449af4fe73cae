"""CuPy launchers of the FP8 block-scaling quantize kernels (``kernels/fp8_block.cu``).

What it owns: `fp8_block_quantize_raw` (codes, fp32 scale_inv and fused error statistics of a 2-D CUDA tensor, one
launch, no host synchronisation) and `fp8_block_quantize(quantizer, tensor)`, the kernel version of
`Float8BlockQuantizer._quantize`: the same `Float8BlockwiseTensor` fields, bit for bit, with the fused underflow and
squared-error statistics attached for the statistics backend (`tedebug.backends.fused_stats`).  Both block shapes
(1x128, 128x128), any 2-D view `[M, K]` (partial blocks included), float32 / bfloat16 / float16 inputs.
The overflow statistic does not apply to block scaling (`torch_ref.overflow_partials` needs one scale), so none is
fused.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from tedebug.backends.cupy_runtime import (
    THREADS,
    device_index,
    dtype_options,
    get_kernel,
    pointer,
    prepare_input,
    sm_count,
    ticket,
    workspace,
)
from tedebug.backends.fused_stats import attach_fused
from tedebug.backends.launch import launch
from tedebug.quantization.formats import FP8_MAX

SOURCE = "fp8_block.cu"
TILE = 128
FB_BLOCKS_PER_SM = 2  # FB_MIN_BLOCKS in kernels/fp8_block.cu (<= cupy_runtime.MAX_BLOCKS_PER_SM: workspace rows)
_KERNEL = {1: "ted_fp8_block_quantize_1d", 2: "ted_fp8_block_quantize_2d"}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _scale_shape(rows: int, cols: int, block_scaling_dim: int) -> Tuple[int, int]:
    """Scale grid of a [rows, cols] matrix: 1x128 blocks or 128x128 tiles (float8_block.scale_grid)."""
    return (rows if block_scaling_dim == 1 else _ceil_div(rows, TILE)), _ceil_div(cols, TILE)


def fp8_block_quantize_raw(
    x2d: torch.Tensor,
    fp8_format: str,
    block_scaling_dim: int,
    *,
    epsilon: float,
    pow2: bool,
    value_for_inf: float,
    rowwise: bool,
    columnwise: bool,
):
    """FP8 block codes and scales of a CUDA `[M, K]` tensor (float8_block.quantize_blocks for both directions).

    Returns (row_codes [M, K], row_scale_inv, col_codes [K, M], col_scale_inv, stats) with None for an absent
    direction; scale_inv layouts as in `Float8BlockwiseTensor`; `stats` is float64[4] = (row underflows, row
    Σ(x-deq)², col underflows, col Σ(x-deq)²) on the device.
    """
    if block_scaling_dim not in _KERNEL:
        raise ValueError(f"fp8_block_quantize_raw: block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
    if x2d.dim() != 2 or x2d.numel() == 0:
        raise ValueError(f"fp8_block_quantize_raw: expected a non-empty 2-D tensor, got shape {tuple(x2d.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("fp8_block_quantize_raw: both rowwise and columnwise are off; nothing to produce")
    x2d = prepare_input(x2d)
    m, k = x2d.shape
    dev = x2d.device
    row_codes = row_sinv = col_codes = col_sinv = None
    if rowwise:
        row_codes = torch.empty((m, k), dtype=torch.uint8, device=dev)
        row_sinv = torch.empty(_scale_shape(m, k, block_scaling_dim), dtype=torch.float32, device=dev)
    if columnwise:
        col_codes = torch.empty((k, m), dtype=torch.uint8, device=dev)
        col_sinv = torch.empty(_scale_shape(k, m, block_scaling_dim), dtype=torch.float32, device=dev)
    stats = torch.empty(4, dtype=torch.float64, device=dev)
    tiles = _ceil_div(m, TILE) * _ceil_div(k, TILE)
    grid = max(1, min(FB_BLOCKS_PER_SM * sm_count(device_index(dev)), tiles))
    partials, tickets = workspace(dev)
    with np.errstate(over="ignore"):  # an epsilon beyond fp32 becomes +Inf, as torch's fp32 full_like does
        eps32 = np.float32(epsilon) if epsilon > 0 else np.float32(0.0)  # the reference skips epsilon <= 0 (-0.0)

    kernel = get_kernel(SOURCE, _KERNEL[block_scaling_dim], dtype_options(x2d, fp8_format))
    args = (
        x2d.data_ptr(), np.int64(m), np.int64(k), np.float32(FP8_MAX[fp8_format]), eps32, np.int32(bool(pow2)),
        np.float32(value_for_inf), np.int32(bool(rowwise)), np.int32(bool(columnwise)),
        pointer(row_codes), pointer(row_sinv), pointer(col_codes), pointer(col_sinv),
        partials, ticket(tickets, "fp8_block"), stats.data_ptr(),
    )
    launch(kernel, grid, THREADS, args, dev)
    return row_codes, row_sinv, col_codes, col_sinv, stats


def fp8_block_quantize(quantizer, tensor: torch.Tensor):
    """Kernel version of `Float8BlockQuantizer._quantize` (same Float8BlockwiseTensor fields, bit for bit)."""
    from tedebug.quantization.float8_block import Float8BlockwiseTensor
    from tedebug.quantization.tensor import check_high_precision_input, matrix_shape

    check_high_precision_input(tensor, type(quantizer).__name__)
    m, k = matrix_shape(tensor.shape)
    rowwise, columnwise = quantizer.rowwise_usage, quantizer.columnwise_usage
    rc, rs, cc, cs, stats = fp8_block_quantize_raw(
        tensor.detach().reshape(m, k),
        quantizer.fp8_format,
        quantizer.block_scaling_dim,
        epsilon=quantizer.amax_epsilon,
        pow2=quantizer.force_pow_2_scales,
        value_for_inf=torch.finfo(tensor.dtype).max,
        rowwise=rowwise,
        columnwise=columnwise,
    )
    out = Float8BlockwiseTensor(
        tensor.shape,
        tensor.dtype,
        tensor.device,
        quantizer,
        fp8_format=quantizer.fp8_format,
        block_scaling_dim=quantizer.block_scaling_dim,
        rowwise_data=rc.reshape(tensor.shape) if rowwise else None,
        rowwise_scale_inv=rs,
        columnwise_data=cc,
        columnwise_scale_inv=cs,
    )
    fused = {}
    if rowwise:
        fused["rowwise"] = {"underflows_num": stats[0], "sq_err": stats[1]}
    if columnwise:
        fused["columnwise"] = {"underflows_num": stats[2], "sq_err": stats[3]}
    attach_fused(out, tensor, fused)
    return out
