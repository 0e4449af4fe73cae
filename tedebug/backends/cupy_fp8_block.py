"""CuPy launchers of the FP8 block-scaling quantize kernels (``kernels/fp8_block.cu``).

What it owns: `fp8_block_quantize_raw`, the codes, fp32 scale_inv and fused error statistics (underflows, squared
error per direction) of a 2-D CUDA tensor in one launch, no host synchronisation, returned as raw buffers
(`Float8BlockBuffers`); `tedebug.quantization.float8_block` builds the `Float8BlockwiseTensor` from them, bit for bit
the fields of its torch path.  Both block shapes (1x128, 128x128), any 2-D view `[M, K]` (partial blocks included),
float32 / bfloat16 / float16 inputs.  The overflow statistic does not apply to block scaling
(`torch_ref.overflow_partials` needs one scale), so none is fused.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from tedebug.backends.cupy_runtime import (
    THREADS,
    device_index,
    PlanCache,
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

SOURCE = "fp8_block.cu"
TILE = 128
FB_BLOCKS_PER_SM = 2  # FB_MIN_BLOCKS in kernels/fp8_block.cu (<= cupy_runtime.MAX_BLOCKS_PER_SM: workspace rows)
_KERNEL = {1: "ted_fp8_block_quantize_1d", 2: "ted_fp8_block_quantize_2d"}


class Float8BlockBuffers(NamedTuple):
    """What the FP8 block kernels produce for a [M, K] input (None for a direction that is off)."""

    rowwise_data: Optional[torch.Tensor]  # uint8 codes [M, K]
    rowwise_scale_inv: Optional[torch.Tensor]  # fp32, one per 1x128 block or 128x128 tile of [M, K]
    columnwise_data: Optional[torch.Tensor]  # uint8 codes of the transpose [K, M]
    columnwise_scale_inv: Optional[torch.Tensor]  # fp32, the blocks of [K, M]
    stats: torch.Tensor  # float64[4]: `fused_stats.ROWWISE_STATS`, `fused_stats.COLUMNWISE_STATS`


#: a quantizer's amax epsilon -> the np.float32 the kernel takes (a recipe uses one or two values)
_EPSILON32 = PlanCache(limit=64)


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
) -> Float8BlockBuffers:
    """FP8 block codes and scales of a CUDA `[M, K]` tensor (float8_block.quantize_blocks for both directions).

    Scale_inv layouts as in `Float8BlockwiseTensor`; `stats` is float64[4] = (row underflows, row Σ(x-deq)², col
    underflows, col Σ(x-deq)²) on the device.
    """
    if block_scaling_dim not in _KERNEL:
        raise ValueError(f"fp8_block_quantize_raw: block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")
    if x2d.dim() != 2 or x2d.numel() == 0:
        raise ValueError(f"fp8_block_quantize_raw: expected a non-empty 2-D tensor, got shape {tuple(x2d.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("fp8_block_quantize_raw: both rowwise and columnwise are off; nothing to produce")
    x2d = ready_input(x2d)
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
    eps32 = _EPSILON32.get(epsilon)
    if eps32 is None:
        with np.errstate(over="ignore"):  # an epsilon beyond fp32 becomes +Inf, as torch's fp32 full_like does
            # (the reference skips an epsilon <= 0, -0.0 included)
            eps32 = _EPSILON32.put(epsilon, np.float32(epsilon) if epsilon > 0 else np.float32(0.0))

    kernel = get_kernel(SOURCE, _KERNEL[block_scaling_dim], dtype_options(x2d, fp8_format))
    args = (
        x2d.data_ptr(),
        np.int64(m),
        np.int64(k),
        np.float32(FP8_MAX[fp8_format]),
        eps32,
        np.int32(bool(pow2)),
        np.float32(value_for_inf),
        np.int32(bool(rowwise)),
        np.int32(bool(columnwise)),
        pointer(row_codes),
        pointer(row_sinv),
        pointer(col_codes),
        pointer(col_sinv),
        partials,
        ticket(tickets, "fp8_block"),
        stats.data_ptr(),
    )
    launch(kernel, grid, THREADS, args, dev)
    return Float8BlockBuffers(row_codes, row_sinv, col_codes, col_sinv, stats)
