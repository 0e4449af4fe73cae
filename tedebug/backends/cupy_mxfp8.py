"""CuPy launchers of ``kernels/mxfp8.cu``: MXFP8 codes, E8M0 scales and the fused error statistics.

bf16 / fp16 inputs take the single-launch ``ted_mxfp8_quantize16`` (32 x 256 tiles, statistics finished by the last
block); float32 inputs take ``ted_mxfp8_quantize``; each finishes its statistics in its last block.  Both write
rowwise codes [M, K] with scales [M, K/32] and columnwise codes [M, K] with scales [M/32, K], as the torch reference,
and return them as raw buffers (`MXFP8Buffers`); `tedebug.quantization.mxfp8` builds the `MXFP8Tensor`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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
    ready_input,
    sm_count,
    ticket,
    workspace,
)
from tedebug.backends.launch import launch
from tedebug.format_constants import FP8_MAX

MX_BLOCKS_PER_SM = 4  # ted_mxfp8_quantize16: __launch_bounds__(256, MX_MIN_BLOCKS = 4), 64 registers


class MXFP8Buffers(NamedTuple):
    """What the MXFP8 kernels produce for a [M, K] input (None for a direction that is off);
    `tedebug.quantization.mxfp8` wraps it in an `MXFP8Tensor`."""

    rowwise_data: Optional[torch.Tensor]  # uint8 codes [M, K]
    rowwise_scale_inv: Optional[torch.Tensor]  # E8M0 codes [M, K/32]
    columnwise_data: Optional[torch.Tensor]  # uint8 codes [M, K]
    columnwise_scale_inv: Optional[torch.Tensor]  # E8M0 codes [M/32, K]
    stats: torch.Tensor  # float64[4]: `fused_stats.ROWWISE_STATS`, `fused_stats.COLUMNWISE_STATS`


def mxfp8_quantize_raw(x2d: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool) -> MXFP8Buffers:
    """MXFP8 codes and E8M0 scales of a CUDA [M, K] tensor (M, K multiples of 32; a copy when not contiguous).

    `stats` is float64[4] = (row underflows, row Σ(x-deq)², col underflows, col Σ(x-deq)²).
    """
    x2d = ready_input(x2d)
    m, k = x2d.shape
    dev = x2d.device
    opts = dtype_options(x2d, fp8_format)
    if x2d.dtype in SIXTEEN_BIT:
        return _mxfp8_quantize16(x2d, fp8_format, rowwise, columnwise, opts)
    cpl = 2  # columns per lane, CPL in kernels/mxfp8.cu
    tiles = (m // 32) * ((k + 32 * cpl - 1) // (32 * cpl))
    grid = max(1, min(BLOCKS_PER_SM * sm_count(device_index(dev)), (tiles + 7) // 8))
    outputs = _mxfp8_empty(m, k, dev, rowwise, columnwise)
    stats = torch.empty(4, dtype=torch.float64, device=dev)
    partials, tickets = workspace(dev)
    kernel = get_kernel("mxfp8.cu", "ted_mxfp8_quantize", opts)
    args = _head_args(x2d, fp8_format, rowwise, columnwise, outputs) + (
        partials,
        ticket(tickets, "mxfp8"),
        stats.data_ptr(),
    )
    launch(kernel, grid, THREADS, args, dev)
    return MXFP8Buffers(*outputs, stats)


def _head_args(x2d: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool, outputs) -> tuple:
    """The arguments both MXFP8 quantize kernels start with: the input, its shape, 1 / FP8 max, the directions and
    the four output pointers (0 for an absent direction)."""
    m, k = x2d.shape
    flags = (np.float32(1.0 / FP8_MAX[fp8_format]), np.int32(rowwise), np.int32(columnwise))
    return (x2d.data_ptr(), np.int64(m), np.int64(k)) + flags + tuple(pointer(t) for t in outputs)


def _mxfp8_empty(m: int, k: int, dev, rowwise: bool, columnwise: bool):
    row_codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
    row_scales = torch.empty((m, k // 32), dtype=torch.uint8, device=dev) if rowwise else None
    col_codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if columnwise else None
    col_scales = torch.empty((m // 32, k), dtype=torch.uint8, device=dev) if columnwise else None
    return row_codes, row_scales, col_codes, col_scales


def _mxfp8_quantize16(x2d: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool, opts) -> MXFP8Buffers:
    """The single-launch bf16 / fp16 kernel (32 x 256 tiles, statistics finished by the last block)."""
    m, k = x2d.shape
    dev = x2d.device
    tiles = (m // 32) * ((k + 255) // 256)
    if tiles >= 2**31:  # the kernel walks tiles with 32-bit indices
        raise ValueError(f"mxfp8 kernel: {m} x {k} has {tiles} tiles of 32 x 256, more than 2^31 - 1")
    grid = max(1, min(MX_BLOCKS_PER_SM * sm_count(device_index(dev)), tiles))
    outputs = _mxfp8_empty(m, k, dev, rowwise, columnwise)
    stats = torch.empty(4, dtype=torch.float64, device=dev)
    partials, tickets = workspace(dev)
    kernel = get_kernel("mxfp8.cu", "ted_mxfp8_quantize16", opts)
    args = _head_args(x2d, fp8_format, rowwise, columnwise, outputs) + (
        partials,
        ticket(tickets, "mxfp8"),
        stats.data_ptr(),
    )
    launch(kernel, grid, THREADS, args, dev)
    return MXFP8Buffers(*outputs, stats)
