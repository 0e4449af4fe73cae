"""Reference math of the per-feed statistic partials, in plain torch (CPU and CUDA).

One function per partial family; each returns a dict of 0-d float64 tensors on the input's device, named as in
`tedebug.stats.definitions.PARTIALS`.  A fused GPU kernel of the same family must return the same dict with the
same values (counts, minima and maxima bit-exact; sums up to float64 summation order).

Conventions: min / max / amax / minima of non-zero magnitudes are taken exactly in the input dtype and then
converted to float64; sums accumulate in float64; ``m2`` is Σ (x − mean)² around the feed's own float64 mean (no
Σx² − (Σx)²/n cancellation); counts are exact integers stored as float64.
"""

from __future__ import annotations

import math
import threading
from itertools import repeat
from typing import Dict, List

import numpy as np
import torch

from tedebug.host_numpy import PerThreadTable, compiling, host_view

from tedebug.format_constants import FP8_MAX

F64 = torch.float64
Partials = Dict[str, torch.Tensor]


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(F64)


def _nonzero_abs_min(a: torch.Tensor) -> torch.Tensor:
    """min of the non-zero entries of a non-negative tensor; +inf when there is none (NaN propagates)."""
    inf = torch.full((), float("inf"), dtype=a.dtype, device=a.device)
    return torch.where(a != 0, a, inf).amin()


# ------------------------------------------------------------------------------------------------ basic
def basic_partials(x: torch.Tensor) -> Partials:
    """min, max, sum, m2, abs_sum, sq_sum, amax, nz_abs_min, nz_abs_max, nonzero_count, nan_count, inf_count.

    nz_abs_min is +inf and nz_abs_max is 0 when x has no non-zero element (nz_abs_max equals amax otherwise).
    """
    flat = x.reshape(-1)
    a = flat.abs()
    x64 = _f64(flat)
    total = x64.sum()
    mean = total / flat.numel()
    amax = _f64(a.amax())
    return {
        "min": _f64(flat.amin()),
        "max": _f64(flat.amax()),
        "sum": total,
        "m2": ((x64 - mean) ** 2).sum(),
        "abs_sum": _f64(a).sum(),
        "sq_sum": (x64 * x64).sum(),
        "amax": amax,
        "nz_abs_min": _f64(_nonzero_abs_min(a)),
        "nz_abs_max": amax,
        "nonzero_count": _f64(torch.count_nonzero(flat)),
        "nan_count": _f64(torch.isnan(flat).sum()),
        "inf_count": _f64(torch.isinf(flat).sum()),
    }


#: the order of `basic_partials_row` (the same order as the CUDA kernels' row)
BASIC_KEYS = (
    "min",
    "max",
    "sum",
    "m2",
    "abs_sum",
    "sq_sum",
    "amax",
    "nz_abs_min",
    "nz_abs_max",
    "nonzero_count",
    "nan_count",
    "inf_count",
)
#: a host row as `StatsEngine` lays it out before picking its columns: numel, then `BASIC_KEYS`
BASIC_ROW_KEYS = ("numel",) + BASIC_KEYS


def basic_partials_row(x: torch.Tensor) -> torch.Tensor:
    """`basic_partials` as one float64 vector in `BASIC_KEYS` order, bit for bit the same values (on a CPU tensor
    built from `basic_partial_values`; other devices get the stacked partials, with no host read-back)."""
    if x.device.type != "cpu" or x.numel() == 0:
        partials = basic_partials(x)
        return torch.stack([partials[key] for key in BASIC_KEYS])
    return torch.tensor(basic_partial_values(x), dtype=F64)


def basic_partial_values(x: torch.Tensor) -> tuple:
    """`basic_partials` of a non-empty CPU tensor as Python floats in `BASIC_KEYS` order, bit for bit the same values.

    On the CPU the values can be read on the host as they come (no device to wait for), which lets this skip work
    whose answer is already known: ``amax`` is max(|min|, |max|); with no zero element the smallest non-zero
    magnitude is the smallest magnitude; a finite float64 sum means no NaN and no infinity (either would make the
    sum NaN or infinite), so both counts are 0.  A tensor of at most `HOST_PASS_MAX_NUMEL` elements takes
    `_small_basic_partial_values` (numpy for what does not depend on an order, torch's own sums for what does);
    a larger one the torch calls below.  A tensor that requires grad is read detached (no autograd record)."""
    if x.requires_grad:
        x = x.detach()
    n = x.numel()
    if n <= HOST_PASS_MAX_NUMEL and not compiling():
        return _small_basic_partial_values(x, n)
    flat = x.reshape(-1)
    # min and max in the input dtype, as `basic_partials` takes them (aminmax may differ in the sign of a zero)
    low, high = flat.amin().item(), flat.amax().item()
    amax = max(abs(low), abs(high)) if low == low else low  # NaN propagates, as amax of |x| does
    x64 = flat.to(F64)
    total_value = x64.sum().item()
    # the mean as a Python float: the same correctly rounded float64 division as `total / numel` on a 0-d tensor
    m2 = (x64 - total_value / n).square().sum().item()
    a64 = x64.abs()
    abs_sum = a64.sum().item()
    sq_sum = (x64 * x64).sum().item()
    nonzero = torch.count_nonzero(flat).item()
    nz_abs_min = (a64.amin() if nonzero == n else torch.where(a64 != 0, a64, math.inf).amin()).item()
    if math.isfinite(total_value):
        nan_count = inf_count = 0
    else:
        nan_count, inf_count = torch.isnan(flat).sum().item(), torch.isinf(flat).sum().item()
    return (
        low,
        high,
        total_value,
        m2,
        abs_sum,
        sq_sum,
        amax,
        nz_abs_min,
        amax,
        float(nonzero),
        float(nan_count),
        float(inf_count),
    )


#: the largest tensor `basic_partial_values` reads through numpy: up to torch's parallel grain size (32768
#: elements, ``at::internal::GRAIN_SIZE``) a CPU sum runs on one thread, so that the sum of a row of a matrix
#: (one call for three sums) equals the sum of the row alone bit for bit; above it the rows of the matrix and
#: the lone vector may be split between threads differently (measured: different last bits from 33392 elements)
HOST_PASS_MAX_NUMEL = 32768
#: dtypes whose CPU tensors numpy reads without a copy (bfloat16 has no numpy dtype: torch converts it)
_NUMPY_DTYPES = frozenset((torch.float32, torch.float64, torch.float16))


#: dtypes whose values, converted to float64, can be squared and subtracted without overflow (their largest finite
#: magnitude is below 2^128): with no infinity and no NaN among them, numpy's element-wise work raises no
#: floating-point flag, so it needs no `np.errstate`
_NARROW_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


def _small_basic_partial_values(x: torch.Tensor, n: int) -> tuple:
    """`basic_partial_values` of a CPU tensor `x` (any shape, no autograd) of `n` <= `HOST_PASS_MAX_NUMEL` elements,
    with 2 torch calls.

    Every value is the one `basic_partials` computes.  The tensor is converted once to float64 (exact) in a numpy
    matrix whose other rows receive x·x, |x| and -x (element-wise IEEE operations: the same values as torch's);
    minima, maxima and counts do not depend on the order of the elements, so numpy takes them from the float64
    copy (the conversion keeps every value and its order; max(x) is -min(-x), both exact) - except a minimum or
    maximum that is a zero, taken again by torch in the input dtype, whose choice between +0 and -0 the reference
    fixes.  The sums depend on the order of the additions, so torch takes them as the reference does: Σx², Σx and
    Σ|x| as the rows of one matrix sum, then Σ(x − mean)² on the |x| row overwritten.  Infinities and NaNs
    propagate as in torch, without numpy's warnings: the work after the sums runs under `np.errstate` when the sum
    is not finite, and all of it does for a float64 tensor (whose squares may overflow)."""
    space = _workspace(n)
    if x.dtype in _NARROW_DTYPES:
        return _small_values(x, n, space)
    with np.errstate(all="ignore"):
        return _small_values(x, n, space)


class _Workspace:
    """The arrays of `_small_basic_partial_values` for one element count, and the tensors that wrap them.

    Four rows of float64: x·x, x, |x| and -x.  The first three are summed by one torch call (rows 0-2); the last
    three give min(x), min(|x|) and -max(x) in one numpy reduction (rows 1-3).  `sums` receives Σx², Σx, Σ|x| and
    then Σ(x - mean)², each written by torch into its slot (``out=``: no result tensor per call)."""

    __slots__ = (
        "rows",
        "squares",
        "values",
        "magnitudes",
        "negatives",
        "summed",
        "reduced",
        "sums",
        "summed_tensor",
        "magnitudes_tensor",
        "sums_tensor",
        "m2_tensor",
        "shaped",
    )

    def __init__(self, n: int) -> None:
        self.rows = np.empty((4, n))
        self.squares, self.values, self.magnitudes, self.negatives = self.rows
        self.summed = self.rows[:3]
        self.reduced = self.rows[1:]
        self.sums = np.empty(4)
        self.summed_tensor = torch.from_numpy(self.summed)
        self.magnitudes_tensor = torch.from_numpy(self.magnitudes)
        self.sums_tensor = torch.from_numpy(self.sums[:3])
        self.m2_tensor = torch.from_numpy(self.sums[3:]).view(())  # the last slot as a 0-d tensor
        #: tensor shape -> the `values` row viewed in that shape (a copy into it lays the elements out row-major)
        self.shaped: Dict[torch.Size, np.ndarray] = {}

    def values_as(self, shape: torch.Size) -> np.ndarray:
        view = self.shaped.get(shape)
        if view is None:
            if len(self.shaped) >= _WORKSPACES_PER_THREAD:
                self.shaped.clear()
            view = self.shaped[shape] = self.values.reshape(shape)
        return view


#: distinct element counts whose workspaces one thread keeps (at most 16 x 1 MB) before it starts over (also the
#: number of shapes a workspace keeps views for)
_WORKSPACES_PER_THREAD = 16
_WORKSPACES = PerThreadTable(_WORKSPACES_PER_THREAD)
_thread_state = threading.local()  # (the batch scratch of `_batch_scratch`, one per thread)


def _workspace(n: int) -> _Workspace:
    space = _WORKSPACES.get(n)
    if space is None:
        space = _WORKSPACES.keep(n, _Workspace(n))
    return space


def _small_values(x: torch.Tensor, n: int, space: _Workspace) -> tuple:
    values = space.values
    if x.dtype in _NUMPY_DTYPES:  # the elements in row-major order, as `reshape(-1)` orders them
        np.copyto(space.values_as(x.shape), host_view(x))
    else:
        torch.from_numpy(values).copy_(x.reshape(-1))
    np.abs(values, out=space.magnitudes)
    np.multiply(values, values, out=space.squares)
    np.negative(values, out=space.negatives)
    torch.sum(space.summed_tensor, dim=1, out=space.sums_tensor)
    sq_sum, total_value, abs_sum = space.sums[:3].tolist()
    if math.isfinite(total_value):  # a finite float64 sum: no NaN and no infinity, so both counts are 0
        return _small_values_after_sums(x, n, space, total_value, abs_sum, sq_sum, 0.0, 0.0)
    with np.errstate(all="ignore"):
        nan_count, inf_count = float(np.isnan(values).sum()), float(np.isinf(values).sum())
        return _small_values_after_sums(x, n, space, total_value, abs_sum, sq_sum, nan_count, inf_count)


def _small_values_after_sums(
    x: torch.Tensor,
    n: int,
    space: _Workspace,
    total_value: float,
    abs_sum: float,
    sq_sum: float,
    nan_count: float,
    inf_count: float,
) -> tuple:
    values, magnitudes = space.values, space.magnitudes
    low, smallest_magnitude, negated_high = np.minimum.reduce(space.reduced, axis=1).tolist()  # NaN propagates
    # max(x) = -min(-x) exactly; a NaN is taken from the values themselves (its sign bit as numpy's max gives it)
    high = -negated_high if negated_high == negated_high else float(np.maximum.reduce(values))
    if low == 0.0:  # the zero's sign as the reference's reduction of the flattened tensor picks it
        low = x.reshape(-1).amin().item()
    if high == 0.0:
        high = x.reshape(-1).amax().item()
    amax = max(abs(low), abs(high)) if low == low else low  # NaN propagates, as amax of |x| does
    if smallest_magnitude > 0.0:  # no zero (and no NaN): every element counts, the smallest magnitude is non-zero
        nonzero, nz_abs_min = n, smallest_magnitude
    else:
        nonzero = int(np.count_nonzero(values))
        if nonzero == n:  # a NaN and no zero
            nz_abs_min = smallest_magnitude
        else:  # +inf when every element is zero; a NaN propagates
            nz_abs_min = float(np.minimum.reduce(magnitudes, where=magnitudes != 0, initial=math.inf))
    # the mean as a Python float: the same correctly rounded float64 division as `total / numel` on a 0-d tensor
    np.subtract(values, total_value / n, out=magnitudes)
    np.square(magnitudes, out=magnitudes)
    torch.sum(space.magnitudes_tensor, dim=0, out=space.m2_tensor)
    m2 = float(space.sums[3])
    return (low, high, total_value, m2, abs_sum, sq_sum, amax, nz_abs_min, amax, float(nonzero), nan_count, inf_count)


#: dtypes whose CPU tensors `basic_partial_rows` reduces (their float64 conversion is exact and converts back)
BATCH_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))


def basic_partial_rows(values: np.ndarray, dtype: torch.dtype) -> List[tuple]:
    """`basic_partial_values` of many tensors at once: row i of `values` (a C-contiguous float64 [k, n] matrix, with
    n <= `HOST_PASS_MAX_NUMEL`) holds the elements of tensor i of `dtype` (one of `BATCH_DTYPES`) in row-major order,
    converted to float64; the result is one tuple per row, bit for bit what `basic_partial_values` gives that tensor.

    One numpy or torch call serves many rows: the three sums (Σx², Σx, Σ|x|) and Σ(x − mean)² are torch's row sums of
    [rows, n] matrices of fewer than `HOST_PASS_MAX_NUMEL` elements when n allows it (each row summed alone, bit for
    bit: the fact `HOST_PASS_MAX_NUMEL` rests on; below torch's grain size the call also runs on the calling thread,
    never waiting for the thread pool, which on a busy machine costs milliseconds); minima, maxima and counts come
    from numpy reductions along all the rows at once.  A row whose float64 sum is finite holds no NaN and no
    infinity: its minimum, maximum and smallest non-zero magnitude are then unique values (a zero minimum or maximum
    is taken again by torch in `dtype`, whose choice between +0 and -0 the reference fixes).  A row whose sum is not
    finite (a NaN, an infinity, or a float64 sum that overflows: rare) goes through `_small_basic_partial_values`
    alone, so that which NaN propagates and the non-finite counts are exactly the lone tensor's.  Writes nothing
    into `values`.  The rows are taken `_BATCH_BLOCK_ELEMENTS` elements at a time (the scratch stays small)."""
    k, n = values.shape
    block = max(1, _BATCH_BLOCK_ELEMENTS // n)
    if k <= block:
        return _partial_rows_block(values, dtype)
    rows: List[tuple] = []
    for start in range(0, k, block):
        rows += _partial_rows_block(values[start : start + block], dtype)
    return rows


#: the most elements `basic_partial_rows` reduces with one set of calls (its scratch: 2 x 8 bytes per element)
_BATCH_BLOCK_ELEMENTS = 1 << 18


def _partial_rows_block(values: np.ndarray, dtype: torch.dtype) -> List[tuple]:
    """`basic_partial_rows` of at most `_BATCH_BLOCK_ELEMENTS` elements (or one row)."""
    k, n = values.shape
    space = _batch_scratch(k, n)
    squares, magnitudes = space.squares[: k * n].reshape(k, n), space.magnitudes[: k * n].reshape(k, n)
    squares_tensor, magnitudes_tensor = torch.from_numpy(squares), torch.from_numpy(magnitudes)
    with np.errstate(all="ignore"):  # squares of float64 values may overflow; the non-finite rows are redone below
        np.multiply(values, values, out=squares)
        np.abs(values, out=magnitudes)
        step = max(1, (HOST_PASS_MAX_NUMEL - 1) // n)  # rows per torch call
        sums = space.sums[: 4 * k].reshape(4, k)  # Σx², Σx, Σ|x|, Σ(x − mean)² per row
        sums_tensor = torch.from_numpy(sums)
        _row_sums(squares_tensor, step, sums_tensor[0])
        _row_sums(torch.from_numpy(values), step, sums_tensor[1])
        _row_sums(magnitudes_tensor, step, sums_tensor[2])
        totals_array = sums[1]
        lows_array = np.minimum.reduce(values, axis=1)
        highs_array = np.maximum.reduce(values, axis=1)
        smallest_array = np.minimum.reduce(magnitudes, axis=1)
        # per row: max|x| = max(|min|, |max|) (exact); every element counts and the smallest magnitude is the
        # smallest non-zero one unless the row holds a zero (no NaN in a row of finite sum: those are redone below)
        amaxs = np.maximum(np.abs(lows_array), np.abs(highs_array)).tolist()
        nonzeros = np.full(k, float(n))
        nz_abs_mins = smallest_array.copy()
        # rows holding a zero: their non-zero count and smallest non-zero magnitude (+inf when all are zero)
        with_zero = np.flatnonzero(smallest_array == 0.0)
        if len(with_zero):
            some = magnitudes[with_zero]
            nonzeros[with_zero] = np.count_nonzero(some, axis=1)
            nz_abs_mins[with_zero] = np.minimum.reduce(some, axis=1, where=some != 0, initial=math.inf)
        # rows redone or patched below: a sum that is not finite, a zero minimum or maximum (its sign)
        patched = np.flatnonzero(~np.isfinite(totals_array) | (lows_array == 0.0) | (highs_array == 0.0)).tolist()
        # Σ(x − mean)² around each row's mean, the same correctly rounded float64 division as `total / numel`
        np.subtract(values, (totals_array / n)[:, None], out=magnitudes)
        np.square(magnitudes, out=magnitudes)
        _row_sums(magnitudes_tensor, step, sums_tensor[3])
        totals = totals_array.tolist()
        # one tuple per row in `BASIC_KEYS` order, built by zip (the NaN and infinity counts of a finite row are 0)
        rows: List[tuple] = list(
            zip(
                lows_array.tolist(),
                highs_array.tolist(),
                totals,
                sums[3].tolist(),
                sums[2].tolist(),
                sums[0].tolist(),
                amaxs,
                nz_abs_mins.tolist(),
                amaxs,
                nonzeros.tolist(),
                repeat(0.0),
                repeat(0.0),
            )
        )
    for i in patched:
        if not math.isfinite(totals[i]):  # a NaN, an infinity or a float64 overflow: the lone tensor's path
            lone = torch.from_numpy(values[i])
            rows[i] = _small_basic_partial_values(lone if dtype is F64 else lone.to(dtype), n)
            continue
        low, high = rows[i][0], rows[i][1]
        if low == 0.0:  # the zero's sign as the reference's reduction of the flattened tensor picks it
            low = _in_dtype(values[i], dtype).amin().item()
        if high == 0.0:
            high = _in_dtype(values[i], dtype).amax().item()
        rows[i] = (low, high) + rows[i][2:]
    return rows


def _row_sums(matrix: torch.Tensor, step: int, out: torch.Tensor) -> None:
    """Write the float64 sum of each row of `matrix` into `out` (a contiguous vector), `step` rows per torch call."""
    for start in range(0, len(matrix), step):
        torch.sum(matrix[start : start + step], dim=1, out=out[start : start + step])


def _in_dtype(row: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A float64 row as the contiguous tensor of `dtype` it was converted from (exact)."""
    tensor = torch.from_numpy(row)
    return tensor if dtype is F64 else tensor.to(dtype)


class _BatchScratch:
    """The scratch of `basic_partial_rows` (x·x and |x|, then x − mean; the four sums of each row, written by torch
    with ``out=``: no result tensor, read through numpy), flat, viewed as [k, n] for each block."""

    __slots__ = ("squares", "magnitudes", "sums")

    def __init__(self, elements: int, rows: int) -> None:
        self.squares = np.empty(elements)
        self.magnitudes = np.empty(elements)
        self.sums = np.empty(4 * rows)


def _batch_scratch(k: int, n: int) -> _BatchScratch:
    """This thread's scratch for a block of `k` rows of `n` elements (at most `_BATCH_BLOCK_ELEMENTS` elements, or one
    row), kept across calls whatever the element counts (grown, never beyond one block)."""
    space = getattr(_thread_state, "batch_scratch", None)
    if space is None or len(space.squares) < k * n or len(space.sums) < 4 * k:
        elements = max(k * n, len(space.squares) if space is not None else 0)
        rows = max(k, len(space.sums) // 4 if space is not None else 0)
        space = _thread_state.batch_scratch = _BatchScratch(elements, rows)
    return space


# ------------------------------------------------------------------------------------------------ blockwise
def blockwise_dynamic_range_partials(
    x: torch.Tensor, block_size: int, dims: int, max_over_orientations: bool
) -> Partials:
    """block_dr: max over blocks of log2(amax_block) − log2(min non-zero |x| of the block) (0 for all-zero blocks).

    x is viewed as 2-D [prod(leading dims), last dim].  dims=1: blocks of `block_size` consecutive elements of
    the row-major order (numel must be divisible by block_size); dims=2: block_size × block_size tiles (both 2-D
    dims divisible by block_size).  `max_over_orientations` also takes the dims=1 blocks of the transposed view
    (for dims=2 the tiles of the transpose are the same tiles, so the value is unchanged).
    """
    a2d = x.reshape(-1, x.shape[-1]).abs() if x.dim() > 0 else x.reshape(1, 1).abs()
    value = _max_block_dynamic_range(a2d, block_size, dims)
    if max_over_orientations and dims == 1:
        value = torch.maximum(value, _max_block_dynamic_range(a2d.t(), block_size, dims))
    return {"block_dr": value}


def _max_block_dynamic_range(a2d: torch.Tensor, block_size: int, dims: int) -> torch.Tensor:
    rows, cols = a2d.shape
    if dims == 1:
        if a2d.numel() % block_size:
            raise ValueError(
                f"max_blockwise_dynamic_range: numel {a2d.numel()} (2-D view {rows}x{cols}) is not divisible "
                f"by block_size {block_size}"
            )
        blocks = a2d.reshape(-1, block_size)
    else:
        if rows % block_size or cols % block_size:
            raise ValueError(
                f"max_blockwise_dynamic_range: dims=2 needs both dims of the 2-D view {rows}x{cols} divisible by "
                f"block_size {block_size}"
            )
        b = block_size
        blocks = a2d.reshape(rows // b, b, cols // b, b).permute(0, 2, 1, 3).reshape(-1, b * b)
    amax = blocks.amax(dim=1)
    inf = torch.full((), float("inf"), dtype=blocks.dtype, device=blocks.device)
    amin = torch.where(blocks != 0, blocks, inf).amin(dim=1)
    # a block's two logarithms side by side in one log2 call, so that one thread computes both: on the CPU a worker
    # thread of torch's pool was seen (after other tests ran in the process) to give log2(1000.0) 3.3e-14 above the
    # main thread's, which made a uniform block's range non-zero when its two logs came from different threads
    logs = torch.log2(_f64(torch.stack((amax, amin), dim=1)))
    per_block = torch.where(amax != 0, logs[:, 0] - logs[:, 1], torch.zeros((), dtype=F64, device=amax.device))
    return per_block.amax()


# ------------------------------------------------------------------------------------------------ quantized
def _check_same_shape(x: torch.Tensor, q) -> None:
    if tuple(q.shape) != tuple(x.shape):
        raise ValueError(f"quantized tensor shape {tuple(q.shape)} does not match the tensor shape {tuple(x.shape)}")


def underflow_partials(x: torch.Tensor, q, usage: str) -> Partials:
    """underflows_num = count_nonzero(values) − number of stored codes of `usage` that are not ±0, where values are
    the inputs of those codes (`q.code_domain(x, usage)`: x itself, or the RHT-rotated values of NVFP4 columnwise)."""
    _check_same_shape(x, q)
    kept = q.nonzero_code_count(usage).to(x.device)
    return {"underflows_num": _f64(torch.count_nonzero(q.code_domain(x, usage)) - kept)}


def mse_partials(x: torch.Tensor, q, usage: str) -> Partials:
    """sq_err = Σ (x − dequantize(usage))² in float64 (the dequantization of the requested representation)."""
    _check_same_shape(x, q)
    deq = q.dequantize(usage=usage, dtype=F64).to(x.device)
    return {"sq_err": ((_f64(x) - deq) ** 2).sum()}


def overflow_partials(x: torch.Tensor, q, usage: str) -> Partials:
    """overflows_num = count of |x| > fp8_max · scale_inv (per-tensor FP8 only; threshold in fp32)."""
    _check_same_shape(x, q)
    fmt = getattr(q, "fp8_format", None)
    scales = q.scale_inv_values(usage)
    if fmt not in FP8_MAX or scales.numel() != 1:
        raise ValueError(
            f"overflows% needs a per-tensor FP8 quantized tensor (one scale_inv and an fp8_format), got "
            f"{type(q).__name__} with {scales.numel()} scale(s)"
        )
    threshold = scales.reshape(()).to(device=x.device, dtype=torch.float32) * FP8_MAX[fmt]
    return {"overflows_num": _f64((x.float().abs() > threshold).sum())}


def scale_inv_partials(q, usage: str) -> Partials:
    """scale_count, scale_sum, scale_m2, scale_nz_min (+inf if all zero), scale_max of q.scale_inv_values(usage)."""
    s = _f64(q.scale_inv_values(usage).reshape(-1))
    if s.numel() == 0:
        raise ValueError(f"{type(q).__name__}.scale_inv_values({usage!r}) is empty")
    total = s.sum()
    mean = total / s.numel()
    return {
        "scale_count": torch.full((), float(s.numel()), dtype=F64, device=s.device),
        "scale_sum": total,
        "scale_m2": ((s - mean) ** 2).sum(),
        "scale_nz_min": _nonzero_abs_min(s),
        "scale_max": s.amax(),
    }
