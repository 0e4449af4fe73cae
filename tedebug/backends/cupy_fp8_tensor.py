"""CuPy launchers of ``kernels/fp8_tensor.cu``: per-tensor FP8 (current and delayed scaling) and the amax pass.

What it owns:

- `amax_launch`: one launch of ``ted_fp8_amax_scale`` / ``ted_amax_count`` in one of its modes (`AmaxMode`): the
  amax alone, the amax with the current-scaling scale and scale_inv, the amax in two slots (NVFP4's rowwise and
  columnwise global amaxes), or recorded into a delayed-scaling history with scale_inv = 1 / scale;
- `fp8_amax`, `fp8_current_scale`, `fp8_scale_inv`: device scalars without a host sync;
- the cast + transpose (``ted_fp8_cast_transpose16`` for bf16 / fp16 with M % 64 == 0 and K % 128 == 0, else the
  general ``ted_fp8_cast_transpose``), which also counts underflows and overflows and sums the squared error;
- current scaling of a bf16 / fp16 tensor of that fast shape in one cooperative launch
  (``ted_fp8_current_cast16``: the amax pass and the cast with a grid-wide barrier between them; the same bytes;
  ``ted_fp8_current_stats_cast16`` for a tensor that is also logged: stats.cu's statistics pass in place of the
  amax pass, so its basic statistics row comes from the same launch),
  and delayed scaling of one in one ordinary launch (``ted_fp8_delayed_cast16``: the cast records the amax);
- the kernel paths of the per-tensor quantizers (`fp8_current_quantize`, `fp8_delayed_quantize`, `fp8_quantize`),
  which return the raw buffers (`Float8Buffers`; `tedebug.quantization.float8` builds the `Float8Tensor`), and of
  the delayed-scaling update (`fp8_delayed_update`).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch

from tedebug.backends.cupy_runtime import (
    BLOCKS_PER_SM,
    FLAGS,
    SIXTEEN_BIT,
    THREADS,
    TICKETS,
    PlanCache,
    dtype_options,
    get_kernel,
    grid_for,
    grid_on,
    prepare_input,
    ready_input,
    sm_count,
    ticket,
    workspace,
    workspace_on,
)
from tedebug.backends.cupy_stats import BASIC_ROW_LEN, STATS_TICKET_OFFSET, basic_stats_and_amax_into, lone_grid
from tedebug.backends.fused_stats import FP8_STATS, FP8_STATS_WITH_SCALE
from tedebug.backends.launch import (
    Kernel,
    cooperative_blocks_per_sm,
    launch,
    launch_cooperative_on,
    launch_mode,
    launch_on,
    raw_stream,
)
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


def fp8_current_scale(amax: torch.Tensor, fp8_format: str, epsilon: float, pow2: bool):
    """(scale, scale_inv) 0-d fp32 device tensors from a device amax (formats.compute_scale_from_amax)."""
    amax = amax.reshape(()).contiguous()
    scale = torch.empty((), dtype=torch.float32, device=amax.device)
    scale_inv = torch.empty_like(scale)
    _scale_launch(amax.data_ptr(), fp8_format, epsilon, pow2, scale.data_ptr(), scale_inv.data_ptr(), amax.device)
    return scale, scale_inv


def _scale_launch(
    amax_ptr: int, fp8_format: str, epsilon: float, pow2: bool, scale_ptr: int, scale_inv_ptr: int, device
) -> None:
    """One launch of ``ted_fp8_current_scale``: the fp32 scale and scale_inv at those device addresses from the fp32
    amax at `amax_ptr`."""
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_current_scale", ())
    args = (amax_ptr, np.float32(FP8_MAX[fp8_format]), np.float32(epsilon), np.int32(pow2), scale_ptr, scale_inv_ptr)
    launch(kernel, 1, 1, args, device)


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
    """(row codes [M, K] or None, col codes [K, M] or None, stats float64 (underflows, Σerr², overflows, then the
    scale_inv partials and the element count: `fused_stats.FP8_STATS_WITH_SCALE`))."""
    x2d = prepare_input(x2d)
    return _cast_transpose(x2d, scale.data_ptr(), scale_inv.data_ptr(), fp8_format, rowwise, columnwise)


#: the small outputs of one per-tensor FP8 quantization share one float64 allocation (`_outputs`), in bytes: the
#: statistics vector (at most 9 entries) at 0, the float32 vector of the scale kernels (amax, scale, -, -,
#: scale_inv) at 128, so that scale_inv sits 16-byte aligned at byte 144, as cuBLASLt wants a scale, and the basic
#: statistics row of the fused statistics pass (float64 [13]) at 160.  The codes keep their own allocations: a
#: dropped direction (`update_usage`) frees its memory, and a statistic or scale_inv view kept by the statistics
#: never keeps the codes alive.
_VECTOR_AT = 128
#: the entries of a cast's statistics vector (both casts write them all: kernels/fp8_tensor.cu)
_STATS_LEN = len(FP8_STATS_WITH_SCALE)
_HIGH_PRECISION_AT = _VECTOR_AT + 32
_SMALL_WORDS = (_HIGH_PRECISION_AT + 8 * BASIC_ROW_LEN) // 8
#: the float64 words of the basic statistics row in the small allocation
_HIGH_PRECISION_ROW = slice(_HIGH_PRECISION_AT // 8, _SMALL_WORDS)
#: float32 index in the small allocation of scale_inv under current scaling (vector[4]) and delayed scaling (vector[0])
_CURRENT_SCALE_INV = (_VECTOR_AT + 16) // 4
#: float32 index in the small allocation of the amax the scale kernels read (vector[0])
_AMAX = _VECTOR_AT // 4
_DELAYED_SCALE_INV = _VECTOR_AT // 4


class _Outputs(NamedTuple):
    rowwise: Optional[torch.Tensor]  # uint8 [M, K]
    columnwise: Optional[torch.Tensor]  # uint8 [K, M]
    small: torch.Tensor  # float64 [_SMALL_WORDS]: the layout above


def _outputs(m: int, k: int, device: torch.device, rowwise: bool, columnwise: bool) -> _Outputs:
    """The outputs of one quantization: the codes of the enabled directions and the small allocation (three
    allocator calls, no view: the callers make the views they return)."""
    return _Outputs(
        torch.empty((m, k), dtype=torch.uint8, device=device) if rowwise else None,
        torch.empty((k, m), dtype=torch.uint8, device=device) if columnwise else None,
        torch.empty(_SMALL_WORDS, dtype=torch.float64, device=device),
    )


class _CastPlan(NamedTuple):
    """What the quantization of one (device, dtype, [M, K], FP8 format) needs besides the pointers: the kernels,
    their grids and the constant arguments, worked out once (a layer quantizes the same shapes at every step)."""

    fast: bool  # the cast is the one-launch 16-bit kernel (`_single_launch`)
    amax: Kernel  # ted_fp8_amax_scale
    amax_grid: int
    cast: Kernel
    cast_grid: int
    n: np.int64
    m: np.int64
    k: np.int64
    fp8_max: np.float32


#: (device index, dtype, M, K, FP8 format) -> `_CastPlan`
_CAST_PLANS = PlanCache()


def _cast_plan(x2d: torch.Tensor, index: int, fp8_format: str) -> _CastPlan:
    m, k = x2d.shape
    key = (index, x2d.dtype, m, k, fp8_format)
    plan = _CAST_PLANS.get(key)
    if plan is not None:
        return plan
    fast = _single_launch(x2d)
    sms = sm_count(index)
    n = m * k
    if fast:
        cast = get_kernel("fp8_tensor.cu", "ted_fp8_cast_transpose16", dtype_options(x2d, fp8_format))
        cast_grid = max(1, min(CT_BLOCKS_PER_SM * sms, (m // 64) * (k // 128)))
    else:
        cast = get_kernel("fp8_tensor.cu", "ted_fp8_cast_transpose", dtype_options(x2d, fp8_format))
        cast_grid = max(1, min(BLOCKS_PER_SM * sms, ((m + 63) // 64) * ((k + 63) // 64)))
    plan = _CastPlan(
        fast,
        get_kernel("fp8_tensor.cu", "ted_fp8_amax_scale", dtype_options(x2d)),
        grid_on(index, max(n // (16 // x2d.element_size()), 1)),  # `amax_launch`'s grid
        cast,
        cast_grid,
        np.int64(n),
        np.int64(m),
        np.int64(k),
        np.float32(FP8_MAX[fp8_format]),
    )
    return _CAST_PLANS.put(key, plan)


def _single_launch(x2d: torch.Tensor) -> bool:
    """Whether the cast of the prepared [M, K] `x2d` runs as the one-launch 16-bit kernel."""
    m, k = x2d.shape
    return x2d.dtype in SIXTEEN_BIT and m % 64 == 0 and k % 128 == 0 and m > 0 and k > 0


def _launch_cast(
    plan: _CastPlan,
    x2d: torch.Tensor,
    index: int,
    stream: int,
    scale_ptr: int,
    scale_inv_ptr: int,
    outputs: _Outputs,
) -> torch.Tensor:
    """The cast + transpose of the prepared `x2d` into `outputs` (the enabled directions' codes, the statistics
    vector at the start of the small allocation, returned as a float64 view of its `_STATS_LEN` entries): one launch
    of the 16-bit kernel or of the general kernel, each finishing its statistics in its last block."""
    row, col, small = outputs
    partials, tickets = workspace_on(index, stream)
    args = (
        (x2d.data_ptr(), plan.m, plan.k, scale_ptr, scale_inv_ptr, plan.fp8_max)
        + _codes_args(row, col)
        + (partials, tickets + _CAST_TICKET, small.data_ptr())
    )
    launch_on(plan.cast, index, stream, plan.cast_grid, THREADS, args)
    return small[:_STATS_LEN]


def _codes_args(row: Optional[torch.Tensor], col: Optional[torch.Tensor]) -> Tuple[Any, ...]:
    """The cast kernels' arguments for the directions produced: (do_row, do_col, row codes, col codes), 0 for an
    absent direction."""
    return (
        FLAGS[row is not None],
        FLAGS[col is not None],
        row.data_ptr() if row is not None else 0,
        col.data_ptr() if col is not None else 0,
    )


_CAST_TICKET = 4 * TICKETS["cast"]
_AMAX_TICKET = 4 * TICKETS["amax"]
_CURRENT_TICKET = 4 * TICKETS["fp8_current"]

#: whether torch's current stream is capturing a CUDA graph (the private call skips the public one's checks)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing

#: (device index, dtype, FP8 format, with the statistics pass) -> (``ted_fp8_current_cast16`` or
#: ``ted_fp8_current_stats_cast16``, the most blocks resident at once: the largest grid its grid-wide barrier
#: allows; 0: no cooperative launch there)
_CURRENT_KERNELS: Dict[Tuple[int, torch.dtype, str, bool], Tuple[Kernel, int]] = {}
#: the one-launch kernel, without and with the statistics pass
_CURRENT_KERNEL_NAMES = ("ted_fp8_current_cast16", "ted_fp8_current_stats_cast16")


def _fused_current(
    plan: _CastPlan, x2d: torch.Tensor, index: int, fp8_format: str, high_precision_stats: bool = False
) -> Optional[Kernel]:
    """The one-launch current-scaling kernel for a quantization of `plan` (the 16-bit fast path), or None where
    its barrier cannot hold or the launch could fail: cooperative launches unavailable (the ``cupy`` launch mode,
    the device), the cast's grid larger than the blocks that fit on the device at once, or a CUDA graph being
    captured on the current stream.  With `high_precision_stats`, the kernel whose first phase is the statistics
    pass (``ted_fp8_current_stats_cast16``) instead of the amax pass."""
    if launch_mode() != "driver":  # (asked at every call, as `launch_on` does: $TEDEBUG_LAUNCH may change)
        return None
    if _capturing():  # a CUDA graph being captured: cooperative launches are not capturable on every CUDA version
        return None
    key = (index, x2d.dtype, fp8_format, high_precision_stats)
    entry = _CURRENT_KERNELS.get(key)
    if entry is None:
        name = _CURRENT_KERNEL_NAMES[high_precision_stats]
        kernel = get_kernel("fp8_tensor.cu", name, dtype_options(x2d, fp8_format))
        entry = _CURRENT_KERNELS[key] = (kernel, cooperative_blocks_per_sm(kernel, index, THREADS) * sm_count(index))
    kernel, capacity = entry
    return kernel if plan.cast_grid <= capacity else None


def _amax_pass(
    plan: _CastPlan,
    x: torch.Tensor,
    index: int,
    stream: int,
    outputs: Tuple[Any, ...],
    small: torch.Tensor,
    high_precision_stats: bool,
) -> Optional[torch.Tensor]:
    """The first launch of the flat per-tensor paths: the amax pass of the prepared `x`, writing `outputs` (the
    ``(out, mode, fp8_max, epsilon, pow2, scale, scale_inv)`` arguments `amax_launch` builds), or with
    `high_precision_stats` the statistics pass that writes the same and x's basic statistics row into the small
    allocation; returns that row (a view of `small`), or None."""
    if high_precision_stats:
        row = small[_HIGH_PRECISION_ROW]
        basic_stats_and_amax_into(x, row.data_ptr(), outputs)
        return row
    _, tickets = workspace_on(index, stream)
    launch_on(
        plan.amax, index, stream, plan.amax_grid, THREADS, (x.data_ptr(), plan.n, tickets + _AMAX_TICKET) + outputs
    )
    return None


def _cast_transpose(
    x2d: torch.Tensor,
    scale_ptr: int,
    scale_inv_ptr: int,
    fp8_format: str,
    rowwise: bool,
    columnwise: bool,
):
    """`fp8_cast_transpose_raw` of a prepared (contiguous, aligned, non-empty) [M, K] tensor, with device addresses
    of the fp32 scale and scale_inv: (row codes, col codes, statistics vector)."""
    index = x2d.get_device()
    plan = _cast_plan(x2d, index, fp8_format)
    outputs = _outputs(plan.m, plan.k, x2d.device, rowwise, columnwise)
    stream = raw_stream(index)
    stats = _launch_cast(plan, x2d, index, stream, scale_ptr, scale_inv_ptr, outputs)
    return outputs.rowwise, outputs.columnwise, stats


class Float8Buffers(NamedTuple):
    """What the per-tensor FP8 kernels produce for a [M, K] input; `tedebug.quantization.float8` wraps it in a
    `Float8Tensor`."""

    rowwise_data: Optional[torch.Tensor]  # uint8 codes [M, K], None when rowwise is off
    columnwise_data: Optional[torch.Tensor]  # uint8 codes of the transpose [K, M], None when columnwise is off
    scale_inv: torch.Tensor  # 0-d fp32 1 / scale, shared by both directions
    #: float64 (underflows, Σ(x - deq)², overflows, the scale_inv partials, numel): `fused_stats.FP8_STATS_WITH_SCALE`
    #: (9 entries; an empty input's is the first three, zeros: `fused_stats.FP8_STATS`)
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
    if x2d.numel() == 0:
        codes = _outputs(*x2d.shape, x2d.device, rowwise, columnwise)
        stats = codes.small[: len(FP8_STATS)].zero_()
        return Float8Buffers(codes.rowwise, codes.columnwise, scale_inv, stats)
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
    reduce_amax: Optional[Callable[[torch.Tensor], None]] = None,
) -> Float8Buffers:
    """Current scaling of a CUDA [M, K] tensor: amax + scale (one launch), cast + transpose.

    The cast reads the scale and scale_inv the first launch wrote, by address: no tensor op in between.  On the
    16-bit fast shape, where the device allows a cooperative launch of the cast's grid, the two are one launch of
    ``ted_fp8_current_cast16`` (`_fused_current`: the same codes, scale_inv and statistics; a launch costs the host
    more than such a tensor's whole quantization costs the GPU).  With
    `high_precision_stats` the first launch is the statistics pass (`amax_launch(..., high_precision_out=)`),
    which writes the same amax, scale and scale_inv and also the input's basic statistics row
    (`Float8Buffers.high_precision_stats`): a tensor logged and quantized is read once for both.  On the fast
    shape that pass and the cast are again one launch (``ted_fp8_current_stats_cast16``), so a logged tensor's
    quantization costs the host what an unlogged one costs.

    With `reduce_amax`, `x2d` is one rank's shard of a larger tensor (a tensor-parallel GEMM operand) quantized with
    the scale of the whole tensor: the amax pass (or the statistics pass) writes the shard's amax only;
    `reduce_amax` turns that 1-element fp32 device tensor (a view of the small allocation) into the whole tensor's
    amax in place (the TP layers' all-reduce MAX over their group, enqueued on the current stream); then
    ``ted_fp8_current_scale`` and the cast read it by address.  So the codes, scale_inv and statistics vector are
    those of the torch path with the reduced amax (`formats.compute_scale_from_amax`, `_cast_per_tensor`), in three
    launches and the collective, and the host never waits.  An empty shard still takes part in the reduction.

    Every training step quantizes each GEMM operand, so the path is flat: the kernels, grids and constant arguments
    of the shape come from `_cast_plan`, and the call makes three allocations and two views."""
    x = ready_input(x2d)
    if x.numel() == 0:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        if reduce_amax is not None:
            reduce_amax(amax)
        scale, scale_inv = fp8_current_scale(amax, fp8_format, epsilon, pow2)
        return fp8_quantize(x, scale, fp8_format, rowwise, columnwise, scale_inv)
    index = x.get_device()
    plan = _cast_plan(x, index, fp8_format)
    outputs = _outputs(plan.m, plan.k, x.device, rowwise, columnwise)
    small = outputs.small
    vector = small.data_ptr() + _VECTOR_AT  # float32 amax, scale, -, -, scale_inv
    scale_ptr, scale_inv_ptr = vector + 4, vector + 16
    stream = raw_stream(index)
    if reduce_amax is not None:  # a tensor-parallel shard: the amax, the group's reduction of it, the scale
        amax_only = (vector, _AMAX_MODE, np.float32(0.0), np.float32(0.0), FLAGS[False], vector, vector)
        high_precision = _amax_pass(plan, x, index, stream, amax_only, small, high_precision_stats)
        reduce_amax(small.view(torch.float32)[_AMAX : _AMAX + 1])
        _scale_launch(vector, fp8_format, epsilon, pow2, scale_ptr, scale_inv_ptr, x.device)
        stats = _launch_cast(plan, x, index, stream, scale_ptr, scale_inv_ptr, outputs)
    elif plan.fast and (fused := _fused_current(plan, x, index, fp8_format, high_precision_stats)) is not None:
        # amax (or the statistics pass), scale and cast in one launch
        high_precision = small[_HIGH_PRECISION_ROW] if high_precision_stats else None
        stats = _launch_current(fused, plan, x, index, stream, vector, epsilon, pow2, outputs, high_precision)
    else:
        mode_args = (vector, _CURRENT_SCALE_MODE, plan.fp8_max, np.float32(epsilon), FLAGS[bool(pow2)], scale_ptr)
        high_precision = _amax_pass(plan, x, index, stream, mode_args + (scale_inv_ptr,), small, high_precision_stats)
        stats = _launch_cast(plan, x, index, stream, scale_ptr, scale_inv_ptr, outputs)
    scale_inv = small.view(torch.float32)[_CURRENT_SCALE_INV]
    return Float8Buffers(outputs.rowwise, outputs.columnwise, scale_inv, stats, high_precision)


def _launch_current(
    kernel: Kernel,
    plan: _CastPlan,
    x2d: torch.Tensor,
    index: int,
    stream: int,
    vector: int,
    epsilon: float,
    pow2: bool,
    outputs: _Outputs,
    high_precision: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The cooperative launch of ``ted_fp8_current_cast16`` with the cast's grid: the same small allocation as the
    two launches (amax, scale and scale_inv at `vector`, the statistics vector at its start), returned as the
    float64 view of its `_STATS_LEN` entries.  With `high_precision` (the basic statistics row's view of the small
    allocation), ``ted_fp8_current_stats_cast16``, whose statistics pass writes that row, working as the blocks of
    a lone statistics launch on `x2d` (`cupy_stats.lone_grid`)."""
    row, col, small = outputs
    partials, tickets = workspace_on(index, stream)
    args = (
        (
            x2d.data_ptr(),
            plan.m,
            plan.k,
            tickets + _CURRENT_TICKET,
            vector,
            plan.fp8_max,
            np.float32(epsilon),
            FLAGS[bool(pow2)],
        )
        + _codes_args(row, col)
        + (partials, tickets + _CAST_TICKET, small.data_ptr())
    )
    if high_precision is not None:
        args += _stats_pass_args(tickets, high_precision, x2d, index)
    launch_cooperative_on(kernel, index, stream, plan.cast_grid, THREADS, args)
    return small[:_STATS_LEN]


_CURRENT_SCALE_MODE = np.int32(AmaxMode.CURRENT_SCALE)
_AMAX_MODE = np.int32(AmaxMode.AMAX)


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
    On the 16-bit fast shape both are one launch of ``ted_fp8_delayed_cast16`` (the same codes, history entry,
    scale_inv and statistics as the two launches).  `high_precision_stats`: the recording pass is the statistics
    pass, as in `fp8_current_quantize`; on the fast shape again in one launch with the cast
    (``ted_fp8_delayed_stats_cast16``)."""
    x = ready_input(x2d)
    if x.numel() == 0 or not (scale.dtype == torch.float32 and scale.numel() == 1 and scale.is_contiguous()):
        recorded = history[:1]  # history entry 0, a 1-element view
        torch.maximum(recorded, fp8_amax(x), out=recorded)
        return fp8_quantize(x, scale, fp8_format, rowwise, columnwise)
    # amax of x recorded into history[0] (torch.maximum), scale_inv = 1 / scale (into the outputs' float32 vector,
    # 16-byte aligned) and the cast: one launch on the 16-bit fast shape, else the recording pass and the cast
    index = x.get_device()
    plan = _cast_plan(x, index, fp8_format)
    outputs = _outputs(plan.m, plan.k, x.device, rowwise, columnwise)
    small = outputs.small
    scale_ptr, scale_inv_ptr = scale.data_ptr(), small.data_ptr() + _VECTOR_AT
    stream = raw_stream(index)
    if _delayed_in_one_launch(plan, high_precision_stats):  # the recording (or statistics) pass and the cast
        high_precision = small[_HIGH_PRECISION_ROW] if high_precision_stats else None
        stats = _launch_delayed(
            plan, x, index, stream, fp8_format, history, scale_ptr, scale_inv_ptr, outputs, high_precision
        )
    else:
        mode_args = (history.data_ptr(), _RECORD_MODE, _ZERO_F32, _ZERO_F32, FLAGS[0], scale_ptr, scale_inv_ptr)
        high_precision = _amax_pass(plan, x, index, stream, mode_args, small, high_precision_stats)
        stats = _launch_cast(plan, x, index, stream, scale_ptr, scale_inv_ptr, outputs)
    scale_inv = small.view(torch.float32)[_DELAYED_SCALE_INV]
    return Float8Buffers(outputs.rowwise, outputs.columnwise, scale_inv, stats, high_precision)


_RECORD_MODE = np.int32(AmaxMode.RECORD)
_ZERO_F32 = np.float32(0.0)
_DELAYED_TICKET = 4 * TICKETS["fp8_delayed"]
#: (device index, dtype, FP8 format, with the statistics pass) -> ``ted_fp8_delayed_cast16`` or
#: ``ted_fp8_delayed_stats_cast16``
_DELAYED_KERNELS: Dict[Tuple[int, torch.dtype, str, bool], Kernel] = {}
#: the one-launch kernel, without and with the statistics pass
_DELAYED_KERNEL_NAMES = ("ted_fp8_delayed_cast16", "ted_fp8_delayed_stats_cast16")


def _delayed_in_one_launch(plan: _CastPlan, high_precision_stats: bool) -> bool:
    """Whether a delayed-scaling quantization of `plan` takes one launch (``ted_fp8_delayed_cast16``, or
    ``ted_fp8_delayed_stats_cast16`` when the statistics pass records the amax): on the 16-bit fast shape (an
    ordinary launch: nothing to check about the device).  The answer does not depend on `high_precision_stats`;
    the argument is the chooser's interface, which `_fused_current` shares, so that a replacement can decide by it
    (`tools/ab_logged_quantization.py` keeps logged quantizations in two launches that way)."""
    return plan.fast


def _launch_delayed(
    plan: _CastPlan,
    x2d: torch.Tensor,
    index: int,
    stream: int,
    fp8_format: str,
    history: torch.Tensor,
    scale_ptr: int,
    scale_inv_ptr: int,
    outputs: _Outputs,
    high_precision: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The launch of ``ted_fp8_delayed_cast16`` with the cast's grid (the 16-bit fast path): the codes and the
    statistics vector of `_launch_cast`, max|x| recorded into history[0] and scale_inv written at `scale_inv_ptr`
    as the recording pass does; returns the float64 view of its `_STATS_LEN` entries.  With `high_precision` (the
    basic statistics row's view of the small allocation), ``ted_fp8_delayed_stats_cast16``, whose statistics pass
    records the amax and writes that row, working as the blocks of a lone statistics launch on `x2d`."""
    row, col, small = outputs
    logged = high_precision is not None
    key = (index, x2d.dtype, fp8_format, logged)
    kernel = _DELAYED_KERNELS.get(key)
    if kernel is None:
        options = dtype_options(x2d, fp8_format)
        kernel = _DELAYED_KERNELS[key] = get_kernel("fp8_tensor.cu", _DELAYED_KERNEL_NAMES[logged], options)
    partials, tickets = workspace_on(index, stream)
    args = (
        (
            x2d.data_ptr(),
            plan.m,
            plan.k,
            tickets + _DELAYED_TICKET,
            history.data_ptr(),
            scale_ptr,
            scale_inv_ptr,
            plan.fp8_max,
        )
        + _codes_args(row, col)
        + (partials, tickets + _CAST_TICKET, small.data_ptr())
    )
    if high_precision is not None:
        args += _stats_pass_args(tickets, high_precision, x2d, index)
    launch_on(kernel, index, stream, plan.cast_grid, THREADS, args)
    return small[:_STATS_LEN]


def _stats_pass_args(tickets: int, high_precision: torch.Tensor, x2d: torch.Tensor, index: int) -> Tuple[Any, ...]:
    """The trailing arguments of the ``*_stats_cast16`` kernels: the statistics pass's ticket, the row it writes
    (`high_precision`, a view of the small allocation) and the grid of a lone statistics launch on `x2d`, whose
    blocks the pass works as."""
    return (tickets + STATS_TICKET_OFFSET, high_precision.data_ptr(), np.uint32(lone_grid(x2d, index)))
