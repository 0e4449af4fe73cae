"""CuPy launchers of the NVFP4 quantize kernels (``kernels/nvfp4.cu``): `nvfp4_quantize(quantizer, tensor)`.

Returns the buffers of the same `NVFP4Tensor` fields as `NVFP4Quantizer._quantize`, bit for bit, plus the fused error
statistics (underflows, squared error per direction), as `NVFP4Buffers`; `tedebug.quantization.nvfp4` builds the
tensor and hands the statistics to the statistics backend (`tedebug.backends.fused_stats`).
Without RHT: two launches, the global amax (`cupy_fp8_tensor.amax_launch`, NaN ignored, written to both amax slots;
for the fast kernel also count_nonzero(x)) and the quantize kernel, which finishes its statistics in its last block; no
host synchronisation.  The quantize
kernel is `ted_nvfp4_quantize16` (fast path: bf16 / fp16, either rounding, 1D or 2D, M % 64 == 0, K % 128 == 0) or the
general `ted_nvfp4_quantize` (everything else).
With RHT (`quantizer.with_rht`, columnwise only): the rowwise direction is quantized as above from the amax of x,
which `ted_nvfp4_rht_amax` (max |y| of the rotated values y, recomputed on the fly, never stored) computes in the
same pass (with count_nonzero(x)); the columnwise direction by `ted_nvfp4_rht_col` (rotation again, 1x16
quantization of y, statistics per block: underflows against y, the squared error against x through the inverse
rotation of the dequantized values, as the torch path measures it), whose per-block partials `ted_sum_columns` adds
up.
`supports(quantizer, tensor)` says which calls the kernels take; `tedebug.backends.dispatch.quantize_nvfp4` sends
every other call to the torch reference.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

# (imported under the names the launch code below uses)
from tedebug.backends.cupy_fp8_tensor import amax_launch as _amax_launch
from tedebug.backends.cupy_stats import BASIC_ROW_LEN
from tedebug.backends.cupy_runtime import device_index as _device_index
from tedebug.backends.cupy_runtime import dtype_options as _dtype_options
from tedebug.backends.cupy_runtime import FLAGS, PlanCache, get_kernel, ready_input
from tedebug.backends.cupy_runtime import sm_count as _sm_count
from tedebug.backends.cupy_runtime import sum_columns as _sum_columns
from tedebug.backends.cupy_runtime import ticket as _ticket
from tedebug.backends.cupy_runtime import workspace as _workspace
from tedebug.backends.launch import Kernel
from tedebug.backends.launch import launch as _launch
from tedebug.backends.launch import raw_stream as _raw_stream
from tedebug.format_constants import RHT_SIGNS

NV_BLOCKS_PER_SM = 2  # NV_MIN_BLOCKS in kernels/nvfp4.cu (ted_nvfp4_quantize: 128 registers, no local memory)
NQ_BLOCKS_PER_SM = 3  # NQ_MIN_BLOCKS in kernels/nvfp4.cu (ted_nvfp4_quantize16, 80 registers)
NQ_SR_BLOCKS_PER_SM = 2  # the same for its stochastic-rounding compile (NV_SR=1: Philox and SR need registers)
NQ_TILE = (64, 128)  # ted_nvfp4_quantize16's tile: rows, columns
NV_THREADS = 256
NV_TILE_ROWS = 64
RHT_TILE_ROWS = 256  # ted_nvfp4_rht_col's tile: NR_ROWS rows x NR_TB = 64 bytes of columns
RHT_TILE_BYTES = 64
RHT_BLOCKS_PER_SM = 2  # NR_MIN_BLOCKS in kernels/nvfp4.cu (ted_nvfp4_rht_col: 128 registers)
RHT_AMAX_BYTES = 8  # ted_nvfp4_rht_amax: bytes per thread and row (NR_APT; 4 for fp32)
RHT_AMAX_BLOCKS_PER_SM = 2  # NR_AMAX_MIN_BLOCKS in kernels/nvfp4.cu
RHT_V1_TILE = (4, 64)  # the v1 RHT kernels (reference=True, the tests' oracle): 16-row groups, columns; 3 per SM
_INV6 = np.float32(1.0 / 6.0)  # fp32(1/6), as the reference's `_f32(1 / E2M1_MAX)`
_INV2688 = np.float32(1.0 / 2688.0)  # fp32(1/2688), as the reference's `_f32(1 / NVFP4_GLOBAL_MAX)`
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NVFP4Buffers(NamedTuple):
    """What the NVFP4 kernels produce for a [M, K] input (None for a direction that is off);
    `tedebug.quantization.nvfp4` wraps it in an `NVFP4Tensor`."""

    rowwise_data: Optional[torch.Tensor]  # packed E2M1 codes [M, K/2]
    rowwise_scale_inv: Optional[torch.Tensor]  # E4M3 block scale codes [M, K/16]
    columnwise_data: Optional[torch.Tensor]  # packed E2M1 codes of the (rotated) transpose [K, M/2]
    columnwise_scale_inv: Optional[torch.Tensor]  # E4M3 block scale codes [K, M/16]
    amax: torch.Tensor  # fp32 [2]: the rowwise and columnwise global amaxes (a slot of an absent direction unset)
    #: (row underflows, row Σ(x-deq)², col underflows, col Σ(x-deq)²): a float64[4] tensor, or with RHT four 0-d
    #: tensors (None for an absent direction); None when the quantizer's `error_stats` is off (nothing kept)
    stats: Optional[Sequence[Optional[torch.Tensor]]]
    #: float64 [13]: the input's basic statistics row when the amax pass was the statistics pass (the quantizer's
    #: `high_precision_stats`, without RHT on the columnwise direction), else None
    high_precision_stats: Optional[torch.Tensor] = None


def supports(quantizer, tensor: torch.Tensor) -> bool:
    """Whether the kernels take this call: a non-empty fp32/bf16/fp16 tensor of a valid NVFP4 shape (any options)."""
    if tensor.dtype not in _KERNEL_DTYPES or tensor.numel() == 0 or tensor.dim() < 2:
        return False
    if not (quantizer.rowwise_usage or quantizer.columnwise_usage):
        return False
    m = tensor.numel() // tensor.shape[-1]
    k = tensor.shape[-1]
    need_rows = quantizer.columnwise_usage or quantizer.with_2d_quantization
    return k % 16 == 0 and not (need_rows and m % 16)


def uses_fast_kernel(m: int, k: int, dtype: torch.dtype, two_d: bool, sr: bool) -> bool:
    """Whether `nvfp4_quantize_raw` takes `ted_nvfp4_quantize16` for this call (else `ted_nvfp4_quantize`); with
    stochastic rounding (`sr`) its NV_SR=1 compile."""
    del sr  # both roundings: the SR compile of the fast kernel rounds with the general kernel's code
    return (
        dtype in (torch.bfloat16, torch.float16)
        and not two_d
        and m % NQ_TILE[0] == 0
        and k % NQ_TILE[1] == 0
        and m < 2**24
        and k < 2**24
    )  # 32-bit offsets within the kernel


def uses_fast_2d_kernel(m: int, k: int, dtype: torch.dtype, two_d: bool, sr: bool) -> bool:
    """Whether `nvfp4_quantize_raw` takes `ted_nvfp4_quantize16` compiled for 16x16 scale tiles (NQ_2D=1): a 2D
    call that `uses_fast_kernel` would take in 1D."""
    return two_d and uses_fast_kernel(m, k, dtype, False, sr)


def takes_fast_kernel(m: int, k: int, dtype: torch.dtype, two_d: bool, sr: bool) -> bool:
    """Whether `nvfp4_quantize_raw` takes `ted_nvfp4_quantize16` (1D or 2D), which needs count_nonzero(x)."""
    return uses_fast_kernel(m, k, dtype, two_d, sr) or uses_fast_2d_kernel(m, k, dtype, two_d, sr)


def _tile_cols(dtype: torch.dtype) -> int:
    return 64 if dtype == torch.float32 else 128  # NV_TK in kernels/nvfp4.cu


def _fast_blocks_per_sm(sr: bool) -> int:
    return NQ_SR_BLOCKS_PER_SM if sr else NQ_BLOCKS_PER_SM


_OPTIONS: Dict[Tuple[torch.dtype, bool, Tuple[str, ...]], Tuple[str, ...]] = {}


def _general_options(x2d: torch.Tensor, sr: bool, extra: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    """NVRTC options of nvfp4.cu (one compiled module per dtype and SR holds every kernel of the file), plus
    `extra` (a variant's defines); built once per combination, as every call needs them."""
    key = (x2d.dtype, sr, extra)
    opts = _OPTIONS.get(key)
    if opts is None:
        opts = _OPTIONS[key] = (
            _dtype_options(x2d)
            + (
                "-DTED_FP8=0",
                f"-DNV_SR={int(sr)}",
                f"-DNV_MIN_BLOCKS={NV_BLOCKS_PER_SM}",
                f"-DNQ_MIN_BLOCKS={_fast_blocks_per_sm(sr)}",
                f"-DNR_MIN_BLOCKS={RHT_BLOCKS_PER_SM}",
                f"-DNR_AMAX_MIN_BLOCKS={RHT_AMAX_BLOCKS_PER_SM}",
            )
            + extra
        )
    return opts


def rht_sign_mask() -> int:
    """`RHT_SIGNS` as the RHT kernels take it: bit i is set iff sign i is -1."""
    return sum(1 << i for i, sign in enumerate(RHT_SIGNS) if sign < 0)


_SIGN_MASK = np.uint32(rht_sign_mask())  # the kernels' argument, built once


def _words(value: int) -> Tuple[np.uint32, np.uint32]:
    """A 64-bit Philox seed or offset as the (low, high) 32-bit words the kernels take."""
    return np.uint32(value & 0xFFFFFFFF), np.uint32((value >> 32) & 0xFFFFFFFF)


_ZERO_WORDS = _words(0) + _words(0) + _words(0)  # seed and both offsets of a call without stochastic rounding


def nvfp4_quantize_raw(
    x2d: torch.Tensor,
    amax: torch.Tensor,
    rowwise: bool,
    columnwise: bool,
    two_d: bool = False,
    sr: Optional[Tuple[int, int, int]] = None,
    nonzero: Optional[torch.Tensor] = None,
    stats: bool = True,
) -> Tuple[
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
]:
    """Quantize a contiguous CUDA [M, K] tensor with the global amaxes `amax` (fp32 [2]: rowwise, columnwise).

    `nonzero`: count_nonzero(x) as an int64 [1] device tensor (`cupy_fp8_tensor.amax_launch(..., count_out=)`
    computes it with the amaxes); the fast kernel (`takes_fast_kernel`) needs it for the underflow counts, the
    general one counts itself.

    Returns (row data [M, K/2], row scales [M, K/16], col data [K, M/2], col scales [K, M/16], stats) with None for
    an absent direction; `stats` is float64[4] = (row underflows, row Σ(x-deq)², col underflows, col Σ(x-deq)²),
    or None when the caller passed ``stats=False`` (the kernel writes them to a per-stream scratch slot instead).
    Stochastic rounding when `sr` = (seed, rowwise offset, columnwise offset) is given: the kernel computes the bytes
    of those Philox draws (`tedebug.quantization.philox`, [M, K] rowwise and [K, M] columnwise) in place.
    """
    m, k = x2d.shape
    dev = x2d.device
    row_data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev) if rowwise else None
    row_scales = torch.empty((m, k // 16), dtype=torch.uint8, device=dev) if rowwise else None
    col_data = torch.empty((k, m // 2), dtype=torch.uint8, device=dev) if columnwise else None
    col_scales = torch.empty((k, m // 16), dtype=torch.uint8, device=dev) if columnwise else None
    kept = torch.empty(4, dtype=torch.float64, device=dev) if stats else None
    stats_ptr = kept.data_ptr() if kept is not None else _discard(dev)
    partials, tickets = _workspace(dev)
    plan = _quantize_plan(x2d, two_d, sr is not None)
    # the arguments both kernels end with: the Philox seed and offsets (unused without SR), outputs, workspace
    words = _words(sr[0]) + _words(sr[1]) + _words(sr[2]) if sr is not None else _ZERO_WORDS
    tail = words + (
        row_data.data_ptr() if row_data is not None else 0,
        row_scales.data_ptr() if row_scales is not None else 0,
        col_data.data_ptr() if col_data is not None else 0,
        col_scales.data_ptr() if col_scales is not None else 0,
        partials,
        tickets + _NVFP4_TICKET,
        stats_ptr,
    )
    flags = (FLAGS[bool(rowwise)], FLAGS[bool(columnwise)])
    if plan.fast:
        if nonzero is None or nonzero.dtype != torch.int64 or nonzero.device != dev:
            raise ValueError(
                "nvfp4_quantize_raw: the fast kernel needs `nonzero`, count_nonzero(x) as an int64 "
                f"tensor on {dev} (from _amax_launch(..., count_out=))"
            )
        head = (x2d.data_ptr(), plan.m, plan.k, amax.data_ptr(), nonzero.data_ptr(), _INV6, _INV2688)
        _launch(plan.kernel, plan.grid, NV_THREADS, head + flags + tail, dev)
        return row_data, row_scales, col_data, col_scales, kept
    head = (x2d.data_ptr(), plan.m, plan.k, amax.data_ptr(), _INV6, _INV2688)
    _launch(plan.kernel, plan.grid, NV_THREADS, head + flags + (FLAGS[bool(two_d)],) + tail, dev)
    return row_data, row_scales, col_data, col_scales, kept


class _QuantizePlan(NamedTuple):
    """The kernel of `nvfp4_quantize_raw` for one (device, dtype, [M, K], 2D, SR) and its grid, worked out once (a
    layer quantizes the same shapes at every step)."""

    fast: bool  # `takes_fast_kernel`: ted_nvfp4_quantize16, which needs count_nonzero(x)
    kernel: Kernel
    grid: int
    m: np.int64
    k: np.int64


#: (device index, dtype, M, K, 2D, SR) -> `_QuantizePlan`
_QUANTIZE_PLANS = PlanCache()


def _quantize_plan(x2d: torch.Tensor, two_d: bool, sr: bool) -> _QuantizePlan:
    m, k = x2d.shape
    index = x2d.get_device()
    key = (index, x2d.dtype, m, k, bool(two_d), sr)
    plan = _QUANTIZE_PLANS.get(key)
    if plan is not None:
        return plan
    if takes_fast_kernel(m, k, x2d.dtype, two_d, sr):
        tiles = (m // NQ_TILE[0]) * (k // NQ_TILE[1])
        grid = max(1, min(_fast_blocks_per_sm(sr) * _sm_count(index), tiles))
        opts = _general_options(x2d, sr, ("-DNQ_2D=1",) if two_d else ())
        plan = _QuantizePlan(True, get_kernel("nvfp4.cu", "ted_nvfp4_quantize16", opts), grid, np.int64(m), np.int64(k))
    else:
        tiles = ((m + NV_TILE_ROWS - 1) // NV_TILE_ROWS) * ((k + _tile_cols(x2d.dtype) - 1) // _tile_cols(x2d.dtype))
        grid = max(1, min(NV_BLOCKS_PER_SM * _sm_count(index), tiles))
        kernel = get_kernel("nvfp4.cu", "ted_nvfp4_quantize", _general_options(x2d, sr))
        plan = _QuantizePlan(False, kernel, grid, np.int64(m), np.int64(k))
    return _QUANTIZE_PLANS.put(key, plan)


_NVFP4_TICKET = _ticket(0, "nvfp4")  # the byte offset of the kernels' ticket in a workspace's tickets


_DISCARDS: Dict[Tuple[int, int], torch.Tensor] = {}


def _discard(device: torch.device) -> int:
    """Address of a float64[4] scratch slot of torch's current stream on `device`: where a kernel writes statistics
    nobody reads (kernels of one stream run in order, so they can share it)."""
    index = _device_index(device)
    key = (index, _raw_stream(index))
    slot = _DISCARDS.get(key)
    if slot is None:
        slot = _DISCARDS[key] = torch.empty(4, dtype=torch.float64, device=device)
    return slot.data_ptr()


def _check_rht_input(x2d: torch.Tensor, amax: torch.Tensor, who: str) -> None:
    m, k = x2d.shape
    if m % 16 or k % 16 or x2d.dtype not in _KERNEL_DTYPES or not x2d.is_contiguous():
        raise ValueError(
            f"{who}: needs a contiguous fp32/bf16/fp16 [M, K] tensor with M and K "
            f"divisible by 16, got {x2d.dtype} {tuple(x2d.shape)}"
        )
    if amax.dtype != torch.float32 or amax.numel() != 2 or amax.device != x2d.device:
        raise ValueError(
            f"{who}: amax must be a float32 [2] tensor on {x2d.device}, got {amax.dtype} "
            f"{tuple(amax.shape)} on {amax.device}"
        )


def nvfp4_rht_amax(
    x2d: torch.Tensor,
    amax: torch.Tensor,
    rowwise: bool = False,
    nonzero: Optional[torch.Tensor] = None,
    reference: bool = False,
    zeroed: bool = False,
) -> None:
    """Set amax[1] (fp32 [2], the columnwise slot) to max|y| of the RHT-rotated values y of a contiguous CUDA [M, K]
    tensor (NaN ignored).  `rowwise`: also amax[0] = max|x| (NaN ignored) and, with `nonzero` (int64 [1]),
    nonzero[0] = count_nonzero(x), from the same pass over x (what `_amax_launch(..., count_out=)` gives the
    rowwise direction).  Launches: the zero fills of the slots, `ted_nvfp4_rht_amax`; no sync.  `reference`: the
    straightforward v1 kernel instead (tile-wise, sequential fp64 rotation), kept as the tests' oracle of the fast
    one.  `zeroed`: the caller allocated the slots the kernel writes (amax, and `nonzero`) as zeros already, so the
    fills are skipped."""
    _check_rht_input(x2d, amax, "nvfp4_rht_amax")
    m, k = x2d.shape
    dev = x2d.device
    if nonzero is not None and (not rowwise or nonzero.dtype != torch.int64 or nonzero.device != dev):
        raise ValueError(f"nvfp4_rht_amax: `nonzero` goes with rowwise=True and must be an int64 tensor on {dev}")
    sms = _sm_count(_device_index(dev))
    mask = _SIGN_MASK
    if reference:
        if rowwise:
            _amax_launch(x2d, amax[:1], count_out=nonzero)
        amax[1:].zero_()  # the kernel takes the atomic max of the fp32 bits into it
        tiles = -(-(m // 16) // RHT_V1_TILE[0]) * -(-k // RHT_V1_TILE[1])
        kernel = get_kernel("nvfp4.cu", "ted_nvfp4_rht_amax_v1", _general_options(x2d, False) + ("-DNR_V1=1",))
        _launch(
            kernel,
            max(1, min(3 * sms, tiles)),
            NV_THREADS,
            (x2d.data_ptr(), np.int64(m), np.int64(k), mask, amax.data_ptr() + 4),
            dev,
        )
        return
    piece = RHT_AMAX_BYTES if x2d.dtype != torch.float32 else 4  # NR_APT
    items = (m // 16) * (k * x2d.element_size() // piece)  # one thread per (16-row group, piece of a row)
    if items >= 2**31:
        raise ValueError(f"nvfp4_rht_amax: tensor too large for the RHT kernels ({m} x {k})")
    grid = max(1, min(RHT_AMAX_BLOCKS_PER_SM * sms, -(-items // NV_THREADS)))
    if not zeroed:  # the kernel takes atomic maxima of the fp32 bits (and sums) into slots that start at 0
        if rowwise:
            amax.zero_()
            if nonzero is not None:
                nonzero.zero_()
        else:
            amax[1:].zero_()
    args = (
        x2d.data_ptr(),
        np.int64(m),
        np.int64(k),
        mask,
        amax.data_ptr() + 4,
        amax.data_ptr() if rowwise else 0,
        nonzero.data_ptr() if nonzero is not None else 0,
    )
    _launch(get_kernel("nvfp4.cu", "ted_nvfp4_rht_amax", _general_options(x2d, False)), grid, NV_THREADS, args, dev)


def nvfp4_rht_columnwise(
    x2d: torch.Tensor,
    amax: torch.Tensor,
    sr: Optional[Tuple[int, int]] = None,
    amax_ready: bool = False,
    reference: bool = False,
    stats: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Columnwise NVFP4 of the RHT-rotated transposed view of a contiguous CUDA [M, K] tensor (M % 16 == 0).

    Sets amax[1] (fp32 [2], the columnwise slot) to max|y| of the rotated values y (NaN ignored; `nvfp4_rht_amax`,
    skipped when `amax_ready`: that call already ran) and returns (col data [K, M/2], col scales [K, M/16], stats)
    with `stats` float64[2] = (underflows against y, Σ(x - deq)² against x where deq is the inverse rotation of the
    dequantized values).  `sr` = (seed, offset) switches to stochastic rounding with the bytes of that Philox draw
    ([K, M]), computed in the kernel.  Launches: the amax pass (two), quantize, sum of the per-block partials; no
    sync.  `reference`: the straightforward v1 kernels instead (the tests' oracle of the fast ones).  With `stats`
    False the kernel skips the squared error (the inverse rotation of every block, most of its arithmetic; build
    ``-DNR_STATS=0``) and `stats` is returned as None.
    """
    _check_rht_input(x2d, amax, "nvfp4_rht_columnwise")
    m, k = x2d.shape
    dev = x2d.device
    if not amax_ready:
        nvfp4_rht_amax(x2d, amax, reference=reference)
    col_data = torch.empty((k, m // 2), dtype=torch.uint8, device=dev)
    col_scales = torch.empty((k, m // 16), dtype=torch.uint8, device=dev)
    want_stats = stats or reference
    sms = _sm_count(_device_index(dev))
    extra = ("-DNR_STATS=0",) if not want_stats else ()
    if reference:
        extra += ("-DNR_V1=1",)
    opts = _general_options(x2d, sr is not None, extra)
    if reference:
        name = "ted_nvfp4_rht_col_v1"
        grid = max(1, min(3 * sms, -(-(m // 16) // RHT_V1_TILE[0]) * -(-k // RHT_V1_TILE[1])))
    else:
        name = "ted_nvfp4_rht_col"
        tiles = -(-m // RHT_TILE_ROWS) * -(-k // (RHT_TILE_BYTES // x2d.element_size()))
        if max(m, k, tiles) >= 2**31:  # the kernel's tile arithmetic is 32-bit
            raise ValueError(f"nvfp4_rht_columnwise: tensor too large for the RHT kernels ({m} x {k})")
        grid = max(1, min(RHT_BLOCKS_PER_SM * sms, tiles))
    if want_stats:
        partial = torch.empty((grid, 2), dtype=torch.float64, device=dev)
        partial_ptr = partial.data_ptr()
    else:  # the per-block partials are written but never read: the stream's workspace takes them
        partial_ptr = _workspace(dev)[0]
    args = (
        x2d.data_ptr(),
        np.int64(m),
        np.int64(k),
        _SIGN_MASK,
        amax.data_ptr(),
        _INV6,
        _INV2688,
        *(_words(sr[0]) + _words(sr[1]) if sr is not None else _words(0) + _words(0)),
        col_data.data_ptr(),
        col_scales.data_ptr(),
        partial_ptr,
    )
    _launch(get_kernel("nvfp4.cu", name, opts), grid, NV_THREADS, args, dev)
    if not want_stats:
        return col_data, col_scales, None
    sums = torch.empty(2, dtype=torch.float64, device=dev)
    _sum_columns(partial, sums)
    return col_data, col_scales, sums


#: zeroed int64 [ZERO_CHUNK, 2] chunks handed out a row at a time, per (device index, raw stream): the RHT amax pass
#: takes atomic maxima and sums into slots that start at 0, and one fill per chunk replaces an allocation and a fill
#: per quantization.  A row is handed out once (the quantized tensor keeps views of it: the amaxes); a chunk lives
#: as long as any of its rows is referenced, and is used only on the stream its fill was enqueued on.
ZERO_CHUNK = 256
_ZERO_CHUNKS: Dict[Tuple[int, int], list] = {}


def _zeroed_pair(device: torch.device) -> torch.Tensor:
    """A fresh int64 [2] view holding zeros (on torch's current stream of `device`)."""
    index = _device_index(device)
    key = (index, _raw_stream(index))
    entry = _ZERO_CHUNKS.get(key)
    if entry is None or entry[1] == ZERO_CHUNK:
        entry = _ZERO_CHUNKS[key] = [torch.zeros((ZERO_CHUNK, 2), dtype=torch.int64, device=device), 0]
    row = entry[0][entry[1]]
    entry[1] += 1
    return row


def nvfp4_quantize(quantizer, tensor: torch.Tensor) -> NVFP4Buffers:
    """The kernel path of `NVFP4Quantizer._quantize`: the buffers of the same NVFP4Tensor fields, bit for bit (see
    `supports`).  Reads the quantizer's options and takes its Philox offsets (`next_sr_offset`) for stochastic
    rounding; `tedebug.quantization.nvfp4` builds the tensor."""
    who = type(quantizer).__name__
    if not supports(quantizer, tensor):
        raise ValueError(
            f"{who}: the NVFP4 kernel does not take this call ({quantizer!r}, dtype {tensor.dtype}, "
            f"shape {tuple(tensor.shape)}); use the torch path (dispatch.quantize_nvfp4 returns None)"
        )
    k = tensor.shape[-1]
    m = tensor.numel() // k  # a valid NVFP4 shape (`supports`)
    x2d = ready_input(tensor if tensor.dim() == 2 else tensor.reshape(m, k))  # (read by address only)
    rht = quantizer.with_rht and quantizer.columnwise_usage
    sr = quantizer.stochastic_rounding
    # the fast kernel takes count_nonzero(x) from the amax pass; with RHT it only runs for the rowwise direction
    # (and in 1D: the RHT path quantizes rows with two_d=False)
    fast = (quantizer.rowwise_usage or not rht) and takes_fast_kernel(
        m, k, x2d.dtype, quantizer.with_2d_quantization and not rht, sr
    )
    high_precision = None
    if rht and quantizer.rowwise_usage:
        # one pass over x: amaxes[0] = max|x|, amaxes[1] = max|y| of the rotated values (and count_nonzero(x)),
        # atomic maxima and sums into slots that start at 0: both in one zeroed pair of a pre-zeroed chunk
        slots = _zeroed_pair(x2d.device)
        amaxes = slots[:1].view(torch.float32)  # fp32 [2]
        nonzero = slots[1:] if fast else None
        nvfp4_rht_amax(x2d, amaxes, rowwise=True, nonzero=nonzero, zeroed=True)
    else:
        amaxes = torch.empty(2, dtype=torch.float32, device=x2d.device)
        nonzero = torch.empty(1, dtype=torch.int64, device=x2d.device) if fast else None
        if not rht:  # amaxes[0] = amaxes[1] = max|x| (NaN ignored); with the statistics row: the statistics pass
            if quantizer.high_precision_stats:
                high_precision = torch.empty(BASIC_ROW_LEN, dtype=torch.float64, device=x2d.device)
            _amax_launch(x2d, amaxes, count_out=nonzero, high_precision_out=high_precision)
    # Philox draws taken in the reference's order (rowwise first); the kernels compute their bytes in place
    row_offset = quantizer.next_sr_offset() if sr and quantizer.rowwise_usage else 0
    col_offset = quantizer.next_sr_offset() if sr and quantizer.columnwise_usage else 0
    draws = (quantizer.sr_seed, row_offset, col_offset) if sr else None
    if rht:
        rd = rs = row_stats = None
        if quantizer.rowwise_usage:
            rd, rs, _, _, row_stats = nvfp4_quantize_raw(
                x2d, amaxes, True, False, False, draws, nonzero, stats=quantizer.error_stats
            )
        cd, cs, col_stats = nvfp4_rht_columnwise(
            x2d,
            amaxes,
            (quantizer.sr_seed, col_offset) if sr else None,
            amax_ready=quantizer.rowwise_usage,
            stats=quantizer.error_stats,
        )
        # 0-d views of the statistics, one unbind per vector
        stats = row_stats.unbind()[:2] if row_stats is not None else (None, None)
        stats += col_stats.unbind() if col_stats is not None else (None, None)
    else:
        rd, rs, cd, cs, stats = nvfp4_quantize_raw(
            x2d,
            amaxes,
            quantizer.rowwise_usage,
            quantizer.columnwise_usage,
            quantizer.with_2d_quantization,
            draws,
            nonzero,
            stats=quantizer.error_stats,
        )
    return NVFP4Buffers(rd, rs, cd, cs, amaxes, stats, high_precision)
