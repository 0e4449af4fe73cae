"""CuPy launchers of ``kernels/fp8_tensor.cu``: per-tensor FP8 (current and delayed scaling) and the amax pass.

What it owns:

- `amax_launch`: one launch of ``ted_fp8_amax_scale`` / ``ted_amax_count`` in one of its modes (`AmaxMode`): the
  amax alone, the amax with the current-scaling scale and scale_inv, the amax in two slots (NVFP4's rowwise and
  columnwise global amaxes), or recorded into a delayed-scaling history with scale_inv = 1 / scale;
- `fp8_amax`, `fp8_amax_scale`, `fp8_current_scale`, `fp8_scale_inv`: device scalars without a host sync;
- the cast + transpose (``ted_fp8_cast_transpose16`` for bf16 / fp16 with M % 64 == 0 and K % 128 == 0, else the
  general ``ted_fp8_cast_transpose``), which also counts underflows and overflows and sums the squared error;
- the kernel paths of the per-tensor quantizers (`fp8_current_quantize`, `fp8_delayed_quantize`, `fp8_quantize`),
  which return the raw buffers (`Float8Buffers`; `tedebug.quantization.float8` builds the `Float8Tensor`), and of
  the delayed-scaling update (`fp8_delayed_update`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from tedebug.backends.cupy_runtime import (
    BLOCKS_PER_SM,
    SIXTEEN_BIT,
    THREADS,
    device_index,
    dtype_options,
    get_kernel,
    grid_for,
    prepare_input,
    sm_count,
    sum_columns,
    ticket,
    workspace,
)
from tedebug.backends.cupy_stats import BASIC_ROW_LEN, basic_stats_and_amax_into
from tedebug.backends.fused_stats import FP8_STATS_WITH_SCALE
from tedebug.backends.launch import launch
from tedebug.format_constants import FP8_MAX

CT_BLOCKS_PER_SM = 4  # ted_fp8_cast_transpose16 (48 registers)
DELAYED_UPDATE_MAX_LEN = 8 * THREADS  # ted_fp8_delayed_update keeps 8 history entries per thread


class AmaxMode(enum.IntEnum):
    """The `mode` argument of ``ted_fp8_amax_scale`` / ``ted_amax_count``: what the last block writes."""

    AMAX = 0  # out[0] = amax
    CURRENT_SCALE = 1  # out[0] = amax, then the current-scaling scale and scale_inv
    BOTH_SLOTS = 2  # out[0] = out[1] = amax (NVFP4's rowwise and columnwise global amaxes)
    RECORD = 3  # delayed scaling: out[0] = maximum(out[0], amax) (a history entry), scale_inv = 1 / scale


# ------------------------------------------------------------------------------------------------ amax
def amax_launch(
    x: torch.Tensor,
    out: torch.Tensor,
    fp8_format: Optional[str] = None,
    epsilon: float = 0.0,
    pow2: bool = False,
    count_out: Optional[torch.Tensor] = None,
    scale_inv_slot: int = 2,
    record: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    high_precision_out: Optional[torch.Tensor] = None,
) -> None:
    """One launch of ted_fp8_amax_scale over the prepared tensor `x`; the mode follows from the arguments:

    - with `fp8_format` (`AmaxMode.CURRENT_SCALE`): out[0] = amax, out[1] = scale, out[scale_inv_slot] = scale_inv
      (slot 4 puts it 16-byte aligned, as cuBLASLt wants a scale);
    - with `record` = (scale, scale_inv) (`AmaxMode.RECORD`, delayed scaling): out (the amax history) gets
      out[0] = maximum(out[0], max|x|) and scale_inv[0] = 1 / scale[0];
    - else a 2-element `out` gets out[0] = out[1] = amax (`AmaxMode.BOTH_SLOTS`), a longer one out[0] = amax.

    With `count_out` (int64 [1] on x's device) the launch is `ted_amax_count`, which also writes
    count_out[0] = count_nonzero(x).  With `high_precision_out` (float64 [13] on x's device) the launch is the
    statistics pass `ted_stats_amax` instead, which writes the same outputs and x's basic statistics row there
    (`cupy_stats.basic_stats_and_amax_into`)."""
    n = x.numel()
    vec = 16 // x.element_size()
    grid = grid_for(x.device, max(n // vec, 1))
    _, tickets = workspace(x.device)
    base = out.data_ptr()
    if record is not None:
        mode = AmaxMode.RECORD
        scale_ptr, scale_inv_ptr = record[0].data_ptr(), record[1].data_ptr()
    elif fp8_format is not None:
        mode = AmaxMode.CURRENT_SCALE
        scale_ptr, scale_inv_ptr = base + 4, base + 4 * scale_inv_slot
    else:
        mode = AmaxMode.BOTH_SLOTS if out.numel() == 2 else AmaxMode.AMAX
        scale_ptr = scale_inv_ptr = base  # not written in these modes
    fp8_max = FP8_MAX[fp8_format] if mode == AmaxMode.CURRENT_SCALE else 0.0
    outputs = (base, np.int32(mode), np.float32(fp8_max), np.float32(epsilon), np.int32(pow2), scale_ptr, scale_inv_ptr)
    if count_out is not None and (
        count_out.dtype != torch.int64 or count_out.numel() < 1 or count_out.device != x.device
    ):
        raise ValueError(
            f"amax_launch: count_out must be an int64 tensor on {x.device}, got "
            f"{count_out.dtype} {tuple(count_out.shape)} on {count_out.device}"
        )
    if high_precision_out is not None:
        if (
            high_precision_out.dtype != torch.float64
            or high_precision_out.numel() < BASIC_ROW_LEN
            or high_precision_out.device != x.device
            or not high_precision_out.is_contiguous()
        ):
            raise ValueError(
                f"amax_launch: high_precision_out must be a contiguous float64 tensor of {BASIC_ROW_LEN} elements on "
                f"{x.device}, got {high_precision_out.dtype} {tuple(high_precision_out.shape)} on "
                f"{high_precision_out.device}"
            )
        nz_ptr = count_out.data_ptr() if count_out is not None else 0
        basic_stats_and_amax_into(x, high_precision_out.data_ptr(), outputs, nz_ptr)
        return
    args = (x.data_ptr(), np.int64(n), ticket(tickets, "amax")) + outputs
    if count_out is None:
        kernel = get_kernel("fp8_tensor.cu", "ted_fp8_amax_scale", dtype_options(x))
    else:
        kernel = get_kernel("fp8_tensor.cu", "ted_amax_count", dtype_options(x))
        args += (count_out.data_ptr(),)
    launch(kernel, grid, THREADS, args, x.device)


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """0-d fp32 max|x| ignoring NaN (= `formats.tensor_amax`), computed on the device (one launch)."""
    x = prepare_input(x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    out = torch.empty(1, dtype=torch.float32, device=x.device)
    amax_launch(x, out)
    return out[0]


def fp8_amax_scale(x: torch.Tensor, fp8_format: str, epsilon: float, pow2: bool):
    """(amax, scale, scale_inv) 0-d fp32 device tensors (formats.compute_scale_from_amax) in one launch."""
    x = prepare_input(x)
    out = torch.empty(3, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        out[0] = 0.0
        scale, scale_inv = fp8_current_scale(out[0], fp8_format, epsilon, pow2)
        return out[0], scale, scale_inv
    amax_launch(x, out, fp8_format, epsilon, pow2)
    return out[0], out[1], out[2]


def fp8_current_scale(amax: torch.Tensor, fp8_format: str, epsilon: float, pow2: bool):
    """(scale, scale_inv) 0-d fp32 device tensors from a device amax (formats.compute_scale_from_amax)."""
    amax = amax.reshape(()).contiguous()
    scale = torch.empty((), dtype=torch.float32, device=amax.device)
    scale_inv = torch.empty_like(scale)
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_current_scale", ())
    args = (
        amax.data_ptr(),
        np.float32(FP8_MAX[fp8_format]),
        np.float32(epsilon),
        np.int32(pow2),
        scale.data_ptr(),
        scale_inv.data_ptr(),
    )
    launch(kernel, 1, 1, args, amax.device)
    return scale, scale_inv


def fp8_scale_inv(scale: torch.Tensor) -> torch.Tensor:
    """0-d fp32 1/scale on the device."""
    scale = scale.detach().float().reshape(()).contiguous()
    out = torch.empty((), dtype=torch.float32, device=scale.device)
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_scale_inv", ())
    launch(kernel, 1, 1, (scale.data_ptr(), out.data_ptr()), scale.device)
    return out


# ------------------------------------------------------------------------------------------------ cast + transpose
def fp8_cast_transpose_raw(
    x2d: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool
):
    """(row codes [M, K] or None, col codes [K, M] or None, stats float64 (underflows, Σerr², overflows), followed by
    the scale_inv partials on the single-launch path: `fused_stats.FP8_STATS_WITH_SCALE`)."""
    x2d = prepare_input(x2d)
    return _cast_transpose(x2d, scale.data_ptr(), scale_inv.data_ptr(), fp8_format, rowwise, columnwise)


#: the two small outputs of one per-tensor FP8 quantization share one allocation (`_outputs`), in bytes: the float64
#: statistics vector (at most 9 entries) at 0, the float32 vector of the scale kernels (amax, scale, -, -, scale_inv)
#: at 128, so that scale_inv sits 16-byte aligned at byte 144, as cuBLASLt wants a scale.  The codes keep their own
#: allocations: a dropped direction (`update_usage`) frees its memory, and a statistic or scale_inv view kept by the
#: statistics never keeps the codes alive.
_STATS_AT = 0
_VECTOR_AT = 128
_HIGH_PRECISION_AT = _VECTOR_AT + 32  # float64 [13]: the basic statistics row of the fused statistics pass
_SMALL_BYTES = _HIGH_PRECISION_AT + 8 * BASIC_ROW_LEN


class _Outputs(NamedTuple):
    rowwise: Optional[torch.Tensor]  # uint8 [M, K]
    columnwise: Optional[torch.Tensor]  # uint8 [K, M]
    stats: torch.Tensor  # float64 [stats_len]
    vector: torch.Tensor  # float32 [8]
    high_precision: torch.Tensor  # float64 [13]


def _outputs(m: int, k: int, device: torch.device, rowwise: bool, columnwise: bool, stats_len: int) -> _Outputs:
    """The outputs of one quantization: the codes of the enabled directions, and the statistics and scale vectors as
    views of one small allocation (one allocator call fewer per quantization)."""
    small = torch.empty(_SMALL_BYTES, dtype=torch.uint8, device=device)
    return _Outputs(
        torch.empty((m, k), dtype=torch.uint8, device=device) if rowwise else None,
        torch.empty((k, m), dtype=torch.uint8, device=device) if columnwise else None,
        small[_STATS_AT : _STATS_AT + 8 * stats_len].view(torch.float64),
        small[_VECTOR_AT:_HIGH_PRECISION_AT].view(torch.float32),
        small[_HIGH_PRECISION_AT:_SMALL_BYTES].view(torch.float64),
    )


def _single_launch(x2d: torch.Tensor) -> bool:
    """Whether the cast of the prepared [M, K] `x2d` runs as the one-launch 16-bit kernel."""
    m, k = x2d.shape
    return x2d.dtype in SIXTEEN_BIT and m % 64 == 0 and k % 128 == 0 and m > 0 and k > 0


def _stats_len(x2d: torch.Tensor) -> int:
    """The length of the statistics vector of the cast of `x2d` (`fused_stats`)."""
    return len(FP8_STATS_WITH_SCALE) if _single_launch(x2d) else 3


def _cast_transpose(
    x2d: torch.Tensor,
    scale_ptr: int,
    scale_inv_ptr: int,
    fp8_format: str,
    rowwise: bool,
    columnwise: bool,
    outputs: Optional[_Outputs] = None,
):
    """`fp8_cast_transpose_raw` of a prepared (contiguous, aligned) [M, K] tensor, with device addresses of the fp32
    scale and scale_inv: the single-launch bf16 / fp16 kernel when M % 64 == 0 and K % 128 == 0, else the general
    kernel (per-block partials summed by a second launch).  `outputs` (from `_outputs`, for these usages and
    `_stats_len(x2d)`) are written when given, else allocated here."""
    m, k = x2d.shape
    dev = x2d.device
    fast = _single_launch(x2d)
    if outputs is None:
        outputs = _outputs(m, k, dev, rowwise, columnwise, len(FP8_STATS_WITH_SCALE) if fast else 3)
    row, col, stats = outputs.rowwise, outputs.columnwise, outputs.stats
    codes = (row.data_ptr() if row is not None else 0, col.data_ptr() if col is not None else 0)
    head = (
        x2d.data_ptr(),
        np.int64(m),
        np.int64(k),
        scale_ptr,
        scale_inv_ptr,
        np.float32(FP8_MAX[fp8_format]),
        np.int32(rowwise),
        np.int32(columnwise),
    ) + codes
    if fast:  # one launch; its vector also holds the scale_inv partials (FP8_STATS_WITH_SCALE)
        grid = max(1, min(CT_BLOCKS_PER_SM * sm_count(device_index(dev)), (m // 64) * (k // 128)))
        partials, tickets = workspace(dev)
        kernel = get_kernel("fp8_tensor.cu", "ted_fp8_cast_transpose16", dtype_options(x2d, fp8_format))
        launch(kernel, grid, THREADS, head + (partials, ticket(tickets, "cast"), stats.data_ptr()), dev)
        return row, col, stats
    grid = max(1, min(BLOCKS_PER_SM * sm_count(device_index(dev)), ((m + 63) // 64) * ((k + 63) // 64)))
    partial = torch.empty((grid, 3), dtype=torch.float64, device=dev)
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_cast_transpose", dtype_options(x2d, fp8_format))
    launch(kernel, grid, THREADS, head + (partial.data_ptr(),), dev)
    sum_columns(partial, stats)
    return row, col, stats


class Float8Buffers(NamedTuple):
    """What the per-tensor FP8 kernels produce for a [M, K] input; `tedebug.quantization.float8` wraps it in a
    `Float8Tensor`."""

    rowwise_data: Optional[torch.Tensor]  # uint8 codes [M, K], None when rowwise is off
    columnwise_data: Optional[torch.Tensor]  # uint8 codes of the transpose [K, M], None when columnwise is off
    scale_inv: torch.Tensor  # 0-d fp32 1 / scale, shared by both directions
    #: float64 (underflows, Σ(x - deq)², overflows): `fused_stats.FP8_STATS`; the single-launch cast adds the
    #: scale_inv partials and numel: `fused_stats.FP8_STATS_WITH_SCALE` (9 entries)
    stats: torch.Tensor
    #: float64 [13]: the input's basic statistics row (`cupy_stats.BASIC_ROW_KEYS` order) when the amax came from
    #: the statistics pass (`fp8_current_quantize(..., high_precision_stats=True)`), else None
    high_precision_stats: Optional[torch.Tensor] = None


# ------------------------------------------------------------------------------------------------ quantizers
def fp8_quantize(
    x2d: torch.Tensor,
    scale: torch.Tensor,
    fp8_format: str,
    rowwise: bool,
    columnwise: bool,
    scale_inv: Optional[torch.Tensor] = None,
) -> Float8Buffers:
    """The cast + transpose of a CUDA [M, K] tensor with a given device `scale` (the same bytes as the torch path).

    `scale_inv` (0-d fp32 on the device, = 1 / scale) is computed here when not given.
    """
    if not (
        scale.dtype is torch.float32
        and scale.dim() == 0
        and scale.device == x2d.device
        and not scale.requires_grad
        and scale.is_contiguous()
    ):
        scale = scale.detach().float().reshape(()).to(x2d.device).contiguous()
    if scale_inv is None:
        scale_inv = fp8_scale_inv(scale)
    x2d = prepare_input(x2d)
    row, col, stats = _cast_transpose(x2d, scale.data_ptr(), scale_inv.data_ptr(), fp8_format, rowwise, columnwise)
    return Float8Buffers(row, col, scale_inv, stats)


def fp8_current_quantize(
    x2d: torch.Tensor,
    fp8_format: str,
    epsilon: float,
    pow2: bool,
    rowwise: bool,
    columnwise: bool,
    high_precision_stats: bool = False,
) -> Float8Buffers:
    """Current scaling of a CUDA [M, K] tensor: amax + scale (one launch), cast + transpose.

    The cast reads the scale and scale_inv the first launch wrote, by address: no tensor op in between.  With
    `high_precision_stats` the first launch is the statistics pass (`amax_launch(..., high_precision_out=)`),
    which writes the same amax, scale and scale_inv and also the input's basic statistics row
    (`Float8Buffers.high_precision_stats`): a tensor logged and quantized is read once for both."""
    x = prepare_input(x2d)
    if x.numel() == 0:
        _, scale, scale_inv = fp8_amax_scale(x, fp8_format, epsilon, pow2)
        return fp8_quantize(x, scale, fp8_format, rowwise, columnwise, scale_inv)
    # the outputs' float32 vector gets amax, scale, -, -, scale_inv: scale_inv 16-byte aligned, so that
    # torch._scaled_mm takes it without a copy
    m, k = x.shape
    outputs = _outputs(m, k, x.device, rowwise, columnwise, _stats_len(x))
    vec = outputs.vector
    base = vec.data_ptr()
    high_precision = outputs.high_precision if high_precision_stats else None
    amax_launch(x, vec, fp8_format, epsilon, pow2, scale_inv_slot=4, high_precision_out=high_precision)
    row, col, stats = _cast_transpose(x, base + 4, base + 16, fp8_format, rowwise, columnwise, outputs)
    return Float8Buffers(row, col, vec[4], stats, high_precision)


def fp8_delayed_update(history: torch.Tensor, scale: torch.Tensor, scaled_max: float, most_recent: bool) -> None:
    """`Float8Quantizer.update_scale` in one launch (roll the contiguous fp32 `history`, refresh the 1-element
    fp32 `scale` in place); the caller checks devices, dtypes and len(history) <= DELAYED_UPDATE_MAX_LEN."""
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_delayed_update", ())
    args = (
        history.data_ptr(),
        np.int32(history.numel()),
        scale.data_ptr(),
        np.float32(scaled_max),
        np.int32(most_recent),
    )
    launch(kernel, 1, THREADS, args, history.device)


def fp8_delayed_quantize(
    x2d: torch.Tensor,
    history: torch.Tensor,
    scale: torch.Tensor,
    fp8_format: str,
    rowwise: bool,
    columnwise: bool,
    high_precision_stats: bool = False,
) -> Float8Buffers:
    """Delayed scaling of a CUDA [M, K] tensor: records max|x| into history[0] (as torch.maximum, NaN kept) and
    casts with the current `scale` (the quantizer's state on x's device: fp32 `history` [L] or [L, 1], `scale`).
    `high_precision_stats`: the recording pass is the statistics pass, as in `fp8_current_quantize`."""
    x = prepare_input(x2d)
    if x.numel() == 0 or not (scale.dtype == torch.float32 and scale.numel() == 1 and scale.is_contiguous()):
        recorded = history[:1]  # history entry 0, a 1-element view
        torch.maximum(recorded, fp8_amax(x), out=recorded)
        return fp8_quantize(x, scale, fp8_format, rowwise, columnwise)
    # one launch: amax of x recorded into history[0] (torch.maximum) and scale_inv = 1 / scale (into the outputs'
    # float32 vector, 16-byte aligned), then the cast
    m, k = x.shape
    outputs = _outputs(m, k, x.device, rowwise, columnwise, _stats_len(x))
    scale_inv = outputs.vector
    high_precision = outputs.high_precision if high_precision_stats else None
    amax_launch(x, history, record=(scale, scale_inv), high_precision_out=high_precision)
    row, col, stats = _cast_transpose(
        x, scale.data_ptr(), scale_inv.data_ptr(), fp8_format, rowwise, columnwise, outputs
    )
    return Float8Buffers(row, col, scale_inv[0], stats, high_precision)
