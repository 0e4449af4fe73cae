"""CuPy launchers of ``kernels/stats.cu``: the kernel backend of the statistics family functions.

`tedebug.backends.dispatch.stats_backend` returns this module for a CUDA tensor the kernels take; it offers the same
family functions as `tedebug.backends.torch_ref`, returning the same values:

- `basic_partials` / `basic_partials_row` / `basic_stats_into`: all basic partials of a tensor in one launch of
  ``ted_stats`` (no host synchronisation); `basic_stats_into` writes a whole statistics row to a device address (a
  row of the engine's slab), so a logged tensor costs this launch and nothing else;
- `fused_vector`: a quantize kernel's whole statistics vector for one tensor, from which the engine gathers a row of
  quantization statistics in one op;
- `underflow_partials`, `mse_partials`, `overflow_partials`: the statistics the quantize kernel fused into its pass
  (`tedebug.backends.fused_stats`) when they were computed for exactly this tensor, else the torch reference;
- `blockwise_dynamic_range_partials`, `scale_inv_partials`: the torch reference.

Inputs must be non-empty CUDA float32 / bfloat16 / float16 tensors (`dispatch` sends everything else to torch).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np
import torch

from tedebug.backends import torch_ref
from tedebug.backends.cupy_runtime import (
    ACC_BYTES,
    DTYPE_CODE,
    THREADS,
    TICKETS,
    device_index,
    dtype_options,
    dtype_options_of,
    get_kernel,
    prepare_input,
    sm_count,
    workspace_on,
)
from tedebug.backends.fused_stats import fused_statistic, fused_vector  # noqa: F401 - fused_vector: engine API
from tedebug.backends.launch import (
    Kernel,
    compiled_launches,
    compiled_target,
    launch_on,
    launch_signed,
    raw_stream,
)

STATS_BLOCKS_PER_SM = 3  # ted_stats: __launch_bounds__(256, 3)
#: the order of the kernel's basic partials (the same as the torch reference's rows)
BASIC_KEYS = torch_ref.BASIC_KEYS
#: the float64 row `basic_stats_into` writes: numel, then the basic partials in `BASIC_KEYS` order
BASIC_ROW_KEYS = torch_ref.BASIC_ROW_KEYS
#: its length (13): the float64 slots a statistics pass that is also an amax pass writes (`basic_stats_and_amax_into`)
BASIC_ROW_LEN = len(BASIC_ROW_KEYS)
#: the statistics pass's ticket in a workspace's tickets (its byte offset)
STATS_TICKET_OFFSET = 4 * TICKETS["stats"]


def basic_stats_into(x: torch.Tensor, out_ptr: int) -> None:
    """One launch writing the float64 row `BASIC_ROW_KEYS` (13 values) at device address `out_ptr`.

    The statistics engine hands out rows of a per-step slab, so a logged tensor costs this launch and nothing
    else on the host or the device (no output allocation, no gather).  `x` must be a non-empty CUDA tensor of a
    kernel dtype on the slab's device.  Every logged tensor comes through here, so the per-(device, dtype) launch
    constants are looked up once (`_stats_launch`).
    """
    _lone_launch(x, out_ptr, False)


def basic_stats_scratch_into(x: torch.Tensor, scratch_ptr: int) -> None:
    """`basic_stats_into` without the pass's end: the launch leaves its block partials in the row scratch at
    `scratch_ptr` (`row_scratch_bytes` bytes) and `finish_rows` writes the row later, bit for bit the same
    (``ted_stats_scratch``; docs/performance.md, section 23)."""
    _lone_launch(x, scratch_ptr, True)


def _lone_launch(x: torch.Tensor, address: int, scratch: bool) -> None:
    dtype = x.dtype
    if dtype not in DTYPE_CODE:
        raise TypeError(f"tedebug kernels: expected a float32/bfloat16/float16 tensor, got {dtype}")
    pointer = x.data_ptr()
    if pointer % 16 or not x.is_contiguous():
        x = prepare_input(x)
        pointer = x.data_ptr()
    n = x.numel()
    if n == 0:
        raise ValueError("basic statistics of an empty tensor")
    index = x.get_device()
    constants = _STATS_LAUNCH.get((index, dtype))
    if constants is None:
        constants = _stats_launch(x, index)
    kernel, vec, max_grid, scratch_kernel = constants
    grid = _lone_grid(n, vec, max_grid)
    stream = raw_stream(index)
    if scratch:
        launch_on(scratch_kernel, index, stream, grid, THREADS, (pointer, np.int64(n), address))
        return
    partials, tickets = workspace_on(index, stream)
    launch_on(
        kernel, index, stream, grid, THREADS, (pointer, np.int64(n), partials, tickets + STATS_TICKET_OFFSET, address)
    )


def lone_grid(x: torch.Tensor, index: int) -> int:
    """The grid of `basic_stats_into` for the prepared CUDA tensor `x` on device `index`: a kernel that runs the
    statistics pass inside another launch (``ted_fp8_current_stats_cast16``, ``ted_fp8_delayed_stats_cast16``)
    works as that many blocks, so that its
    row is this launch's bit for bit."""
    _, vec, max_grid, _ = _STATS_LAUNCH.get((index, x.dtype)) or _stats_launch(x, index)
    return _lone_grid(x.numel(), vec, max_grid)


def _lone_grid(n: int, vec: int, max_grid: int) -> int:
    """The grid of `basic_stats_into` for `n` elements of `vec` per 16-byte load: a block per `THREADS` loads, at
    most `max_grid` (one wave), at least one."""
    return min(max_grid, (max(n // vec, 1) + THREADS - 1) // THREADS)


#: (device index, dtype) -> (kernel, elements per 16-byte load, largest grid, the scratch kernel) of
#: `basic_stats_into` and `basic_stats_scratch_into`
_STATS_LAUNCH: Dict[Tuple[int, torch.dtype], Tuple[Kernel, int, int, Kernel]] = {}


def _stats_launch(x: torch.Tensor, index: int) -> Tuple[Kernel, int, int, Kernel]:
    key = (index, x.dtype)
    options = dtype_options(x)
    kernel = get_kernel("stats.cu", "ted_stats", options)
    scratch_kernel = get_kernel("stats.cu", "ted_stats_scratch", options)
    constants = _STATS_LAUNCH[key] = (kernel, 16 // x.element_size(), _max_grid(index), scratch_kernel)
    return constants


def _max_grid(index: int) -> int:
    """The largest grid of a statistics pass on device `index`: one wave of ``ted_stats`` blocks."""
    return max(1, STATS_BLOCKS_PER_SM * sm_count(index))


#: bytes of a row scratch's header, ``sizeof(RowScratch)`` (kernels/stats_pass.cuh asserts it)
_SCRATCH_HEADER_BYTES = 16


def row_scratch_bytes(device: torch.device) -> int:
    """Bytes of one row scratch on `device` (`basic_stats_scratch_into`, `basic_stats_group_scratch_into`): the
    header and a block partial per block of the largest grid, a multiple of 256."""
    raw = _SCRATCH_HEADER_BYTES + _max_grid(device_index(device)) * ACC_BYTES
    return -(-raw // 256) * 256


def finish_rows(device: torch.device, scratch_ptr: int, scratch_bytes: int, rows_ptr: int, width: int, count: int):
    """One launch (``ted_stats_finish_rows``, on torch's current stream) turning each of `count` row scratches (the
    first at `scratch_ptr`, `scratch_bytes` apart) in which a scratch launch left partials into its row (the first
    at `rows_ptr`, `width` float64 apart), as the launch's own end would have written it; the others are left
    alone.  A scratch is turned into a row once: the launch marks it empty."""
    if count <= 0:
        return
    index = device_index(device)
    kernel = get_kernel("stats.cu", "ted_stats_finish_rows", dtype_options_of(_FINISH_DTYPE))
    args = (scratch_ptr, np.int64(scratch_bytes), rows_ptr, np.int32(width))
    launch_on(kernel, index, raw_stream(index), count, THREADS, args)


#: the finishing kernel does not depend on the input dtype; it is taken from the bf16 build of stats.cu
_FINISH_DTYPE = torch.bfloat16


#: the most tensors one `basic_stats_group_into` launch reduces (the arguments of ``ted_stats_group``)
GROUP_MAX = 3
_GROUP_TICKET_OFFSET = 4 * TICKETS["stats_group"]


def group_grids(numels: Sequence[int], vec: int, max_grid: int) -> Tuple[int, ...]:
    """The blocks `basic_stats_group_into` gives each tensor of a group (`numels`, elements of `vec` per 16-byte
    load): each its lone launch's grid when those fit in one wave of `max_grid` blocks, else shares of the wave in
    proportion to the tensors' sizes, at least one block each and never more than its lone grid."""
    lone = [_lone_grid(n, vec, max_grid) for n in numels]
    if sum(lone) <= max_grid:
        return tuple(lone)
    total = sum(numels)
    return tuple(max(1, min(grid, max_grid * n // total)) for grid, n in zip(lone, numels))


def basic_stats_group_into(items: Sequence[Tuple[torch.Tensor, int]]) -> None:
    """`basic_stats_into` of up to `GROUP_MAX` tensors in one launch of ``ted_stats_group``.

    `items` are (tensor, row address) pairs of non-empty CUDA tensors of one dtype on one device (a strided or
    misaligned one is read from its contiguous copy, as `basic_stats_into` does).  The blocks of one wave are split
    among the tensors (`group_grids`); a tensor's row is then bit for bit the row of a lone launch with that many
    blocks, and the launch costs about what one pass over all the tensors' bytes costs, where separate launches
    each pay a pass's ramp-up and drain (kernels/stats.cu).  Every logged tensor of a layer comes through here, so
    the checks and the arguments are made in one pass over `items`, with the per-(device, dtype) constants looked
    up once (`_group_launch`) and the blocks once per group of shapes (`_group_grids_of`)."""
    _group_launch_of(items, False)


def basic_stats_group_scratch_into(items: Sequence[Tuple[torch.Tensor, int]]) -> None:
    """`basic_stats_group_into` leaving each tensor's block partials in its row scratch (`items`: (tensor, scratch
    address) pairs) for `finish_rows` (``ted_stats_group_scratch``; its rows are those of ``ted_stats_group``).

    The usual call, a GEMM call's tensors, is launched by compiled code where `compiled_launches` gives it (the
    same launch, without the Python per tensor: ``kernels/host_launch.c``); a call it does not take, or the first
    of a device and dtype, takes the Python path, which leaves the constants the compiled launch needs in
    `_COMPILED_GROUPS`."""
    compiled = compiled_launches()
    if compiled is None or compiled.stats_group_scratch(_COMPILED_GROUPS, items):
        _group_launch_of(items, True, compiled is not None)


def _group_launch_of(items: Sequence[Tuple[torch.Tensor, int]], scratch: bool, compiled: bool = False) -> None:
    """The Python path of the group launches; `compiled`: the compiled launches are on, and a scratch launch of a
    device and dtype they have no constants for leaves them (`_COMPILED_GROUPS`)."""
    count = len(items)
    if count == 1:
        _lone_launch(items[0][0], items[0][1], scratch)
        return
    if not 1 < count <= GROUP_MAX:
        raise ValueError(f"basic_stats_group_into: 1 to {GROUP_MAX} tensors, got {count}")
    x = items[0][0]
    dtype, index = x.dtype, x.get_device()
    constants = _GROUP_LAUNCH.get((index, dtype))
    if constants is None:
        if dtype not in DTYPE_CODE:
            raise TypeError(f"tedebug kernels: expected a float32/bfloat16/float16 tensor, got {dtype}")
        constants = _group_launch(x, index)
    kernel, vec, max_grid, scratch_kernel = constants
    values: list = []  # (data, numel, blocks, row or scratch address) per tensor; the blocks are filled in below
    numels = []
    copies = None  # the contiguous copies made here: they must stay alive until the launch is queued
    for tensor, address in items:
        n = tensor.numel()
        if tensor.dtype is not dtype or tensor.get_device() != index or n == 0:
            raise ValueError("basic_stats_group_into: the tensors must be non-empty, of one dtype, on one device")
        pointer = tensor.data_ptr()
        if pointer % 16 or not tensor.is_contiguous():
            tensor = prepare_input(tensor)
            pointer = tensor.data_ptr()
            copies = (copies or []) + [tensor]
        values += (pointer, n, 0, address)
        numels.append(n)
    grids, blocks = _group_grids_of(tuple(numels), vec, max_grid)
    values[2::4] = grids
    values += _ABSENT_TENSOR * (GROUP_MAX - count)
    stream = raw_stream(index)
    if scratch:
        launch_signed(scratch_kernel, index, stream, blocks, THREADS, _GROUP_SCRATCH_SIGNATURE, values)
        if compiled and (index, dtype) not in _COMPILED_GROUPS:
            _note_compiled_group(index, dtype, scratch_kernel, vec, max_grid)
        return
    partials, tickets = workspace_on(index, stream)
    values += (partials, tickets + _GROUP_TICKET_OFFSET)
    launch_signed(kernel, index, stream, blocks, THREADS, _GROUP_SIGNATURE, values)


#: (numels, elements per load, largest grid) -> (`group_grids`, their sum), for `basic_stats_group_into`: a training
#: step launches the same groups of shapes every step; the cache starts over past `_GROUP_GRIDS_SIZE` entries
_GROUP_GRIDS: Dict[Tuple[Tuple[int, ...], int, int], Tuple[Tuple[int, ...], int]] = {}
_GROUP_GRIDS_SIZE = 4096


def _group_grids_of(numels: Tuple[int, ...], vec: int, max_grid: int) -> Tuple[Tuple[int, ...], int]:
    """`group_grids` of `numels` and the launch's block count (their sum), remembered per shape."""
    key = (numels, vec, max_grid)
    known = _GROUP_GRIDS.get(key)
    if known is None:
        if len(_GROUP_GRIDS) >= _GROUP_GRIDS_SIZE:
            _GROUP_GRIDS.clear()
        grids = group_grids(numels, vec, max_grid)
        known = _GROUP_GRIDS[key] = (grids, sum(grids))
    return known


#: the argument types of ``ted_stats_group``: (data, numel, blocks, row address) per tensor, then the workspace's
#: partials and ticket
_GROUP_SIGNATURE = (int, np.int64, np.uint32, int) * GROUP_MAX + (int, int)
#: those of ``ted_stats_group_scratch``: (data, numel, blocks, scratch address) per tensor
_GROUP_SCRATCH_SIGNATURE = (int, np.int64, np.uint32, int) * GROUP_MAX
#: the arguments of an absent tensor of ``ted_stats_group`` (no blocks)
_ABSENT_TENSOR = (0, 0, 0, 0)
#: (device index, dtype) -> (the ``ted_stats_group`` kernel, elements per 16-byte load, largest grid, the
#: ``ted_stats_group_scratch`` kernel) of `basic_stats_group_into` and `basic_stats_group_scratch_into`
_GROUP_LAUNCH: Dict[Tuple[int, torch.dtype], Tuple[Kernel, int, int, Kernel]] = {}


def _group_launch(x: torch.Tensor, index: int) -> Tuple[Kernel, int, int, Kernel]:
    _, vec, max_grid, _ = _STATS_LAUNCH.get((index, x.dtype)) or _stats_launch(x, index)
    options = dtype_options(x)
    kernel = get_kernel("stats.cu", "ted_stats_group", options)
    scratch_kernel = get_kernel("stats.cu", "ted_stats_group_scratch", options)
    constants = _GROUP_LAUNCH[(index, x.dtype)] = (kernel, vec, max_grid, scratch_kernel)
    return constants


#: (device index, dtype) -> the constants of the compiled ``ted_stats_group_scratch`` launch there (the extension's
#: table: ``(the CUfunction, THREADS, elements per 16-byte load, the largest grid)``), filled by the Python path's
#: first launch
_COMPILED_GROUPS: Dict[Tuple[int, torch.dtype], Tuple[Any, ...]] = {}


def _note_compiled_group(index: int, dtype: torch.dtype, kernel: Kernel, vec: int, max_grid: int) -> None:
    """Leave the compiled launch's constants for `index` and `dtype` where it will find them (nothing where torch
    lacks what they need: the Python path then takes every launch)."""
    function = compiled_target(kernel, index)
    if function is not None:
        _COMPILED_GROUPS[(index, dtype)] = (function, THREADS, vec, max_grid)


def basic_stats_and_amax_into(x: torch.Tensor, out_ptr: int, amax_args: Tuple[Any, ...], nz_ptr: int = 0) -> None:
    """`basic_stats_into` of a prepared (contiguous, 16-byte aligned, non-empty) CUDA tensor whose one launch also
    writes what the amax pass writes (``ted_stats_amax``: the same pass and grid as `basic_stats_into`, so the row is
    bit for bit the same).  `amax_args`: the amax pass's ``(amax_out, mode, fp8_max, epsilon, pow2, scale_out,
    scale_inv_out)`` (`cupy_fp8_tensor.amax_launch`); `nz_ptr`: where count_nonzero(x) goes (int64), 0 for none."""
    index = x.get_device()
    kernel = get_kernel("stats.cu", "ted_stats_amax", dtype_options(x))
    n = x.numel()
    grid = lone_grid(x, index)  # the grid of `basic_stats_into`
    stream = raw_stream(index)
    partials, tickets = workspace_on(index, stream)
    args = (x.data_ptr(), np.int64(n), partials, tickets + STATS_TICKET_OFFSET, out_ptr) + amax_args + (nz_ptr,)
    launch_on(kernel, index, stream, grid, THREADS, args)


def basic_stats_tensor(x: torch.Tensor) -> torch.Tensor:
    """float64[12] on x's device: the basic partials in `BASIC_KEYS` order (one launch, no host sync)."""
    x = prepare_input(x)
    if x.numel() == 0:
        raise ValueError("basic statistics of an empty tensor")
    out = torch.empty(len(BASIC_ROW_KEYS), dtype=torch.float64, device=x.device)
    basic_stats_into(x, out.data_ptr())
    return out[1:]


def basic_partials(x: torch.Tensor):
    """Kernel version of `torch_ref.basic_partials` (0-d float64 views of one device tensor)."""
    if x.numel() == 0:
        return torch_ref.basic_partials(x)
    out = basic_stats_tensor(x)
    return {key: out[i] for i, key in enumerate(BASIC_KEYS)}


def basic_partials_row(x: torch.Tensor) -> torch.Tensor:
    """`basic_partials` as the kernel's own float64[12] output vector (`BASIC_KEYS` order), without the 0-d views.

    `StatsEngine.feed` gathers its row from this vector when the backend offers it (torch_ref's
    `basic_partials_row` is the CPU counterpart)."""
    if x.numel() == 0:
        partials = torch_ref.basic_partials(x)
        return torch.stack([partials[key] for key in BASIC_KEYS])
    return basic_stats_tensor(x)


def blockwise_dynamic_range_partials(x, block_size, dims, max_over_orientations):
    return torch_ref.blockwise_dynamic_range_partials(x, block_size, dims, max_over_orientations)


def underflow_partials(x, q, usage):
    value = fused_statistic(q, x, usage, "underflows_num")
    return {"underflows_num": value} if value is not None else torch_ref.underflow_partials(x, q, usage)


def mse_partials(x, q, usage):
    value = fused_statistic(q, x, usage, "sq_err")
    return {"sq_err": value} if value is not None else torch_ref.mse_partials(x, q, usage)


def overflow_partials(x, q, usage):
    value = fused_statistic(q, x, usage, "overflows_num")
    return {"overflows_num": value} if value is not None else torch_ref.overflow_partials(x, q, usage)


def scale_inv_partials(q, usage):
    return torch_ref.scale_inv_partials(q, usage)
