"""CuPy launchers of ``kernels/mxfp8.cu``: MXFP8 codes, E8M0 scales and the fused error statistics.

bf16 / fp16 inputs take the single-launch ``ted_mxfp8_quantize16`` (32 x 256 tiles, statistics finished by the last
block); float32 inputs take ``ted_mxfp8_quantize``, whose per-block partials a second launch adds up.  Both write
rowwise codes [M, K] with scales [M, K/32] and columnwise codes [M, K] with scales [M/32, K], as the torch reference.
"""

from __future__ import annotations

import numpy as np
import torch

from tedebug.backends.cupy_runtime import (
    BLOCKS_PER_SM,
    SIXTEEN_BIT,
    THREADS,
    device_index,
    dtype_options,
    get_kernel,
    pointer,
    prepare_input,
    sm_count,
    sum_columns,
    ticket,
    workspace,
)
from tedebug.backends.fused_stats import COLUMNWISE_STATS, ROWWISE_STATS, FusedStats, attach_fused
from tedebug.backends.launch import launch
from tedebug.quantization.formats import FP8_MAX

MX_BLOCKS_PER_SM = 4  # ted_mxfp8_quantize16: __launch_bounds__(256, MX_MIN_BLOCKS = 4), 64 registers


def mxfp8_quantize_raw(x2d: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool):
    """MXFP8 codes and E8M0 scales of a contiguous CUDA [M, K] tensor (M, K multiples of 32).

    Returns (row_codes, row_scales, col_codes, col_scales, stats) where absent directions are None and `stats` is
    float64[4] = (row underflows, row Σ(x-deq)², col underflows, col Σ(x-deq)²).
    """
    x2d = prepare_input(x2d)
    m, k = x2d.shape
    dev = x2d.device
    opts = dtype_options(x2d, fp8_format)
    if x2d.dtype in SIXTEEN_BIT:
        return _mxfp8_quantize16(x2d, fp8_format, rowwise, columnwise, opts)
    cpl = 2  # columns per lane, CPL in kernels/mxfp8.cu
    tiles = (m // 32) * ((k + 32 * cpl - 1) // (32 * cpl))
    grid = max(1, min(BLOCKS_PER_SM * sm_count(device_index(dev)), (tiles + 7) // 8))
    row_codes, row_scales, col_codes, col_scales = _mxfp8_empty(m, k, dev, rowwise, columnwise)
    partial = torch.empty((grid, 4), dtype=torch.float64, device=dev)
    stats = torch.empty(4, dtype=torch.float64, device=dev)
    kernel = get_kernel("mxfp8.cu", "ted_mxfp8_quantize", opts)
    args = (
        x2d.data_ptr(), np.int64(m), np.int64(k), np.float32(1.0 / FP8_MAX[fp8_format]),
        np.int32(rowwise), np.int32(columnwise),
        pointer(row_codes), pointer(row_scales), pointer(col_codes), pointer(col_scales), partial.data_ptr(),
    )
    launch(kernel, grid, THREADS, args, dev)
    sum_columns(partial, stats)
    return row_codes, row_scales, col_codes, col_scales, stats


def _mxfp8_empty(m: int, k: int, dev, rowwise: bool, columnwise: bool):
    row_codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
    row_scales = torch.empty((m, k // 32), dtype=torch.uint8, device=dev) if rowwise else None
    col_codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if columnwise else None
    col_scales = torch.empty((m // 32, k), dtype=torch.uint8, device=dev) if columnwise else None
    return row_codes, row_scales, col_codes, col_scales


def _mxfp8_quantize16(x2d: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool, opts):
    """The single-launch bf16 / fp16 kernel (32 x 256 tiles, statistics finished by the last block)."""
    m, k = x2d.shape
    dev = x2d.device
    tiles = (m // 32) * ((k + 255) // 256)
    if tiles >= 2 ** 31:  # the kernel walks tiles with 32-bit indices
        raise ValueError(f"mxfp8 kernel: {m} x {k} has {tiles} tiles of 32 x 256, more than 2^31 - 1")
    grid = max(1, min(MX_BLOCKS_PER_SM * sm_count(device_index(dev)), tiles))
    row_codes, row_scales, col_codes, col_scales = _mxfp8_empty(m, k, dev, rowwise, columnwise)
    stats = torch.empty(4, dtype=torch.float64, device=dev)
    partials, tickets = workspace(dev)
    kernel = get_kernel("mxfp8.cu", "ted_mxfp8_quantize16", opts)
    args = (
        x2d.data_ptr(), np.int64(m), np.int64(k), np.float32(1.0 / FP8_MAX[fp8_format]),
        np.int32(rowwise), np.int32(columnwise),
        pointer(row_codes), pointer(row_scales), pointer(col_codes), pointer(col_scales),
        partials, ticket(tickets, "mxfp8"), stats.data_ptr(),
    )
    launch(kernel, grid, THREADS, args, dev)
    return row_codes, row_scales, col_codes, col_scales, stats


def mxfp8_quantize(quantizer, tensor: torch.Tensor):
    """Kernel version of `MXFP8Quantizer._quantize` (same MXFP8Tensor fields, bit for bit)."""
    from tedebug.quantization.mxfp8 import MXFP8Tensor, _check_input, check_mxfp8_shape

    who = type(quantizer).__name__
    _check_input(tensor, who)
    m, k = check_mxfp8_shape(tensor.shape, who)
    rc, rs, cc, cs, stats = mxfp8_quantize_raw(
        tensor.detach().reshape(m, k), quantizer.fp8_format, quantizer.rowwise_usage, quantizer.columnwise_usage
    )
    out = MXFP8Tensor(tensor.shape, tensor.dtype, tensor.device, quantizer, fp8_format=quantizer.fp8_format)
    fused = {}
    if quantizer.rowwise_usage:
        out.rowwise_data, out.rowwise_scale_inv = rc.reshape(tensor.shape), rs
        fused["rowwise"] = FusedStats(stats, ROWWISE_STATS)
    if quantizer.columnwise_usage:
        out.columnwise_data, out.columnwise_scale_inv = cc.reshape(tensor.shape), cs
        fused["columnwise"] = FusedStats(stats, COLUMNWISE_STATS)
    attach_fused(out, tensor, fused)
    return out
