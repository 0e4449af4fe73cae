"""CuPy RawKernel backend: compiles and launches the CUDA kernels in ``kernels/*.cu`` on torch CUDA tensors.

What it owns:

- loading: one `cupy.RawModule` per (source file, compile options), built lazily and cached; a compile failure
  raises `KernelCompileError` naming the source and options and showing the NVRTC log;
- launching on torch's current stream through `tedebug.backends.launch` (the driver's cuLaunchKernel, a few
  microseconds per launch), with raw ``data_ptr()`` arguments and numpy-typed scalars;
- one persistent workspace per (device, stream) holding the per-block partials and the atomic tickets of the
  single-launch kernels (the last block of a launch finishes the reduction and resets its ticket), so a call
  allocates only its outputs;
- the kernel-backed versions of the statistics family functions (`basic_partials`; the other families delegate
  to `tedebug.backends.torch_ref`) and of the quantize paths (MXFP8, per-tensor FP8), each returning exactly what
  the torch reference returns.  Results stay on the GPU: no host synchronisation per tensor.

Inputs must be contiguous CUDA float32 / bfloat16 / float16 tensors; the callers (`tedebug.backends.dispatch`)
make a contiguous, 16-byte-aligned copy when needed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from tedebug.backends import torch_ref
from tedebug.quantization.formats import FP8_MAX
from tedebug.backends.launch import Kernel, launch, launch_on, raw_stream

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FP8_CODE = {"E4M3": 0, "E5M2": 1}
THREADS = 256
BLOCKS_PER_SM = 4        # general kernels
STATS_BLOCKS_PER_SM = 3  # ted_stats: __launch_bounds__(256, 3)
MX_BLOCKS_PER_SM = 4     # ted_mxfp8_quantize16: __launch_bounds__(256, MX_MIN_BLOCKS = 4), 64 registers
CT_BLOCKS_PER_SM = 4     # ted_fp8_cast_transpose16 (48 registers)
_MAX_BLOCKS_PER_SM = 4
_PARTIAL_ROW_BYTES = 128  # >= sizeof(Acc) = 88 and 4 doubles
# uint32 slots; "amax": 4 (amax bits), 5 (ticket), 6-7 (64-bit non-zero count of ted_amax_count)
_TICKETS = {"stats": 0, "mxfp8": 1, "cast": 2, "amax": 4, "fp8_block": 8, "nvfp4": 12}
_TICKET_BYTES = 256
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)

BASIC_KEYS = (
    "min", "max", "sum", "m2", "abs_sum", "sq_sum", "amax", "nz_abs_min", "nz_abs_max",
    "nonzero_count", "nan_count", "inf_count",
)


class KernelCompileError(RuntimeError):
    """NVRTC could not compile a tedebug kernel source; the message carries the compiler log."""


# ------------------------------------------------------------------------------------------------ loading
def kernel_dir() -> Path:
    """Directory of the ``.cu`` sources: the installed ``tedebug.kernels`` package, else the repository's
    ``kernels``."""
    try:
        import tedebug.kernels as pkg  # installed layout (package-dir mapping)

        return Path(pkg.__file__).resolve().parent
    except ImportError:
        return Path(__file__).resolve().parents[2] / "kernels"


@functools.lru_cache(maxsize=None)
def _cupy():
    import cupy  # noqa: WPS433 - optional dependency, imported on first use

    return cupy


_MODULES: Dict[Tuple[str, Tuple[str, ...]], object] = {}


def get_module(source: str, options: Tuple[str, ...]):
    """The compiled RawModule of ``kernels/<source>`` for `options` (cached per (source, options))."""
    key = (source, tuple(options))
    module = _MODULES.get(key)
    if module is not None:
        return module
    cp = _cupy()
    directory = kernel_dir()
    path = directory / source
    code = path.read_text()
    # No fast math.  CuPy appends -ftz=true itself; the kernels avoid flushing through inline PTX (common.cuh).
    full_options = ("-std=c++17", "--prec-div=true", "--prec-sqrt=true", f"-I{directory}") + tuple(options)
    try:
        module = cp.RawModule(code=code, options=full_options)
        module.compile()
    except cp.cuda.compiler.CompileException as exc:
        raise KernelCompileError(
            f"tedebug: NVRTC failed to compile {path} with options {full_options}:\n{exc.get_message()}"
        ) from exc
    _MODULES[key] = module
    return module


_KERNELS: Dict[Tuple[str, str, Tuple[str, ...]], Kernel] = {}


def get_kernel(source: str, name: str, options: Tuple[str, ...]) -> Kernel:
    """The `Kernel` `name` of ``kernels/<source>`` (cached); errors name the kernel and the source."""
    key = (source, name, tuple(options))
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    module = get_module(source, options)
    kernel = Kernel(module, name)
    try:
        kernel.raw(torch.cuda.current_device())  # load now: a missing symbol fails here, named
    except Exception as exc:  # CuPy raises CUDADriverError for a missing symbol
        raise KernelCompileError(f"tedebug: kernel {name!r} not found in {source} ({options}): {exc}") from exc
    _KERNELS[key] = kernel
    return kernel


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _launch(kernel: Kernel, grid: int, block: int, args, device: torch.device) -> None:
    """Launch on torch's current stream of `device` (`tedebug.backends.launch`)."""
    launch(kernel, grid, block, args, device)


_WORKSPACES: Dict[Tuple[int, int], torch.Tensor] = {}
#: (device index, raw stream) -> (partials pointer, tickets pointer) of the workspace in `_WORKSPACES`
_WORKSPACE_POINTERS: Dict[Tuple[int, int], Tuple[int, int]] = {}


def _workspace(device: torch.device) -> Tuple[int, int]:
    """(partials pointer, tickets pointer) of the workspace of torch's current stream on `device`.

    The tickets start at 0 and every single-launch kernel leaves them at 0; kernels on one stream run in order,
    so they can share it.
    """
    return _workspace_of(_device_index(device))


def _workspace_of(index: int) -> Tuple[int, int]:
    """`_workspace` of device `index`."""
    return _workspace_on(index, raw_stream(index))


def _workspace_on(index: int, stream: int) -> Tuple[int, int]:
    """`_workspace` of device `index` for raw stream `stream` (torch's current stream there)."""
    key = (index, stream)
    pointers = _WORKSPACE_POINTERS.get(key)
    if pointers is None:
        nbytes = _TICKET_BYTES + _MAX_BLOCKS_PER_SM * _sm_count(index) * _PARTIAL_ROW_BYTES
        ws = _WORKSPACES[key] = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        base = ws.data_ptr()
        pointers = _WORKSPACE_POINTERS[key] = (base + _TICKET_BYTES, base)
    return pointers


def _ticket(tickets: int, name: str) -> int:
    return tickets + 4 * _TICKETS[name]


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid_for(device: torch.device, work_items: int, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    return max(1, min(blocks_per_sm * _sm_count(_device_index(device)), (work_items + THREADS - 1) // THREADS))


def _dtype_options(x: torch.Tensor, fp8_format: Optional[str] = None) -> Tuple[str, ...]:
    opts = _OPTIONS.get((x.dtype, fp8_format))
    if opts is None:
        if x.dtype not in _DTYPE_CODE:
            raise TypeError(f"tedebug kernels: expected a float32/bfloat16/float16 tensor, got {x.dtype}")
        opts = (f"-DTED_DTYPE={_DTYPE_CODE[x.dtype]}",)
        if fp8_format is not None:
            opts += (f"-DTED_FP8={_FP8_CODE[fp8_format]}",)
        _OPTIONS[(x.dtype, fp8_format)] = opts
    return opts


_OPTIONS: Dict[Tuple[torch.dtype, Optional[str]], Tuple[str, ...]] = {}  # (dtype, format) -> NVRTC options


def prepare_input(x: torch.Tensor) -> torch.Tensor:
    """`x` as a contiguous CUDA tensor whose data pointer is 16-byte aligned (a copy only when needed)."""
    if not x.is_cuda:
        raise ValueError(f"tedebug kernels need a CUDA tensor, got a tensor on {x.device}")
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return x


def _sum_columns(partial: torch.Tensor, out: torch.Tensor) -> None:
    rows, cols = partial.shape
    kernel = get_kernel("common.cuh", "ted_sum_columns", ())
    _launch(kernel, 1, THREADS, (partial.data_ptr(), np.int32(rows), np.int32(cols), out.data_ptr()), partial.device)


# ------------------------------------------------------------------------------------------------ statistics
#: the float64 row `basic_stats_into` writes: numel, then the basic partials in `BASIC_KEYS` order
BASIC_ROW_KEYS = ("numel",) + BASIC_KEYS
_ROW_BYTES = 8 * len(BASIC_ROW_KEYS)
_STATS_TICKET_OFFSET = 4 * _TICKETS["stats"]


def basic_stats_into(x: torch.Tensor, out_ptr: int) -> None:
    """One launch writing the float64 row `BASIC_ROW_KEYS` (13 values) at device address `out_ptr`.

    The statistics engine hands out rows of a per-step slab, so a logged tensor costs this launch and nothing
    else on the host or the device (no output allocation, no gather).  `x` must be a non-empty CUDA tensor of a
    kernel dtype on the slab's device.  Every logged tensor comes through here, so the per-(device, dtype) launch
    constants are looked up once (`_stats_launch`).
    """
    dtype = x.dtype
    if dtype not in _DTYPE_CODE:
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
    kernel, vec, max_grid = constants
    grid = min(max_grid, (max(n // vec, 1) + THREADS - 1) // THREADS)
    stream = raw_stream(index)
    partials, tickets = _workspace_on(index, stream)
    launch_on(kernel, index, stream, grid, THREADS,
              (pointer, np.int64(n), partials, tickets + _STATS_TICKET_OFFSET, out_ptr))


#: (device index, dtype) -> (kernel, elements per 16-byte load, largest grid) of `basic_stats_into`
_STATS_LAUNCH: Dict[Tuple[int, torch.dtype], Tuple[Kernel, int, int]] = {}


def _stats_launch(x: torch.Tensor, index: int) -> Tuple[Kernel, int, int]:
    key = (index, x.dtype)
    kernel = _STATS_KERNELS.get(key)
    if kernel is None:
        kernel = _STATS_KERNELS[key] = get_kernel("stats.cu", "ted_stats", _dtype_options(x))
    max_grid = max(1, STATS_BLOCKS_PER_SM * _sm_count(index))
    constants = _STATS_LAUNCH[key] = (kernel, 16 // x.element_size(), max_grid)
    return constants


_STATS_KERNELS: Dict[Tuple[int, torch.dtype], Kernel] = {}


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


def _fused(q, x, usage: str, key: str):
    """A statistic the quantize kernel already computed for exactly this `x` (same tensor, same version)."""
    fused = getattr(q, "_fused_error_stats", None)
    if not fused or fused["source"]() is not x or fused["version"] != x._version:
        return None
    return fused.get(usage, {}).get(key)


def underflow_partials(x, q, usage):
    value = _fused(q, x, usage, "underflows_num")
    return {"underflows_num": value} if value is not None else torch_ref.underflow_partials(x, q, usage)


def mse_partials(x, q, usage):
    value = _fused(q, x, usage, "sq_err")
    return {"sq_err": value} if value is not None else torch_ref.mse_partials(x, q, usage)


def overflow_partials(x, q, usage):
    value = _fused(q, x, usage, "overflows_num")
    return {"overflows_num": value} if value is not None else torch_ref.overflow_partials(x, q, usage)


def scale_inv_partials(q, usage):
    return torch_ref.scale_inv_partials(q, usage)


class FusedStats(Mapping):
    """Statistic name -> 0-d view of a kernel's float64 statistics vector, made only when a statistic is read (most
    quantizations are never measured, and a view costs a tensor op)."""

    __slots__ = ("_vector", "_index")

    def __init__(self, vector: torch.Tensor, index: Dict[str, int]) -> None:
        self._vector = vector
        self._index = index

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._vector[self._index[key]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _attach_fused(q, x: torch.Tensor, per_usage: Dict[str, Mapping]) -> None:
    q._fused_error_stats = {"source": weakref.ref(x), "version": x._version, **per_usage}


# ------------------------------------------------------------------------------------------------ MXFP8
def mxfp8_quantize_raw(x2d: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool):
    """MXFP8 codes and E8M0 scales of a contiguous CUDA [M, K] tensor (M, K multiples of 32).

    Returns (row_codes, row_scales, col_codes, col_scales, stats) where absent directions are None and `stats` is
    float64[4] = (row underflows, row Σ(x-deq)², col underflows, col Σ(x-deq)²).
    """
    x2d = prepare_input(x2d)
    m, k = x2d.shape
    dev = x2d.device
    opts = _dtype_options(x2d, fp8_format)
    if x2d.dtype in _SIXTEEN_BIT:
        return _mxfp8_quantize16(x2d, fp8_format, rowwise, columnwise, opts)
    cpl = 2  # columns per lane, CPL in kernels/mxfp8.cu
    tiles = (m // 32) * ((k + 32 * cpl - 1) // (32 * cpl))
    grid = max(1, min(BLOCKS_PER_SM * _sm_count(dev.index), (tiles + 7) // 8))
    row_codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
    row_scales = torch.empty((m, k // 32), dtype=torch.uint8, device=dev) if rowwise else None
    col_codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if columnwise else None
    col_scales = torch.empty((m // 32, k), dtype=torch.uint8, device=dev) if columnwise else None
    partial = torch.empty((grid, 4), dtype=torch.float64, device=dev)
    stats = torch.empty(4, dtype=torch.float64, device=dev)

    def ptr(t):
        return t.data_ptr() if t is not None else 0

    kernel = get_kernel("mxfp8.cu", "ted_mxfp8_quantize", opts)
    args = (
        x2d.data_ptr(), np.int64(m), np.int64(k), np.float32(1.0 / FP8_MAX[fp8_format]),
        np.int32(rowwise), np.int32(columnwise),
        ptr(row_codes), ptr(row_scales), ptr(col_codes), ptr(col_scales), partial.data_ptr(),
    )
    _launch(kernel, grid, THREADS, args, dev)
    _sum_columns(partial, stats)
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
    grid = max(1, min(MX_BLOCKS_PER_SM * _sm_count(_device_index(dev)), tiles))
    row_codes, row_scales, col_codes, col_scales = _mxfp8_empty(m, k, dev, rowwise, columnwise)
    stats = torch.empty(4, dtype=torch.float64, device=dev)
    partials, tickets = _workspace(dev)

    def ptr(t):
        return t.data_ptr() if t is not None else 0

    kernel = get_kernel("mxfp8.cu", "ted_mxfp8_quantize16", opts)
    args = (
        x2d.data_ptr(), np.int64(m), np.int64(k), np.float32(1.0 / FP8_MAX[fp8_format]),
        np.int32(rowwise), np.int32(columnwise),
        ptr(row_codes), ptr(row_scales), ptr(col_codes), ptr(col_scales),
        partials, _ticket(tickets, "mxfp8"), stats.data_ptr(),
    )
    _launch(kernel, grid, THREADS, args, dev)
    return row_codes, row_scales, col_codes, col_scales, stats


_MX_ROW_STATS = {"underflows_num": 0, "sq_err": 1}
_MX_COL_STATS = {"underflows_num": 2, "sq_err": 3}


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
        fused["rowwise"] = FusedStats(stats, _MX_ROW_STATS)
    if quantizer.columnwise_usage:
        out.columnwise_data, out.columnwise_scale_inv = cc.reshape(tensor.shape), cs
        fused["columnwise"] = FusedStats(stats, _MX_COL_STATS)
    _attach_fused(out, tensor, fused)
    return out


# ------------------------------------------------------------------------------------------------ per-tensor FP8
def _amax_launch(x: torch.Tensor, out: torch.Tensor, fp8_format: Optional[str] = None, epsilon: float = 0.0,
                 pow2: bool = False, count_out: Optional[torch.Tensor] = None, scale_inv_slot: int = 2) -> None:
    """One launch of ted_fp8_amax_scale: out[0] = amax; with `fp8_format` also out[1] = scale, out[scale_inv_slot]
    = scale_inv (slot 4 puts it 16-byte aligned, as cuBLASLt wants a scale);
    without `fp8_format` and a 2-element `out`, out[0] = out[1] = amax (NVFP4's rowwise and columnwise amaxes).
    With `count_out` (int64 [1] on x's device) the launch is `ted_amax_count`, which also writes
    count_out[0] = count_nonzero(x)."""
    n = x.numel()
    vec = 16 // x.element_size()
    grid = _grid_for(x.device, max(n // vec, 1))
    partials, tickets = _workspace(x.device)
    base = out.data_ptr()
    mode = 1 if fp8_format is not None else (2 if out.numel() == 2 else 0)
    fp8_max = FP8_MAX[fp8_format] if fp8_format is not None else 0.0
    args = (x.data_ptr(), np.int64(n), _ticket(tickets, "amax"), base, np.int32(mode), np.float32(fp8_max),
            np.float32(epsilon), np.int32(pow2), base + 4 * (mode == 1), base + 4 * scale_inv_slot * (mode == 1))
    if count_out is None:
        kernel = get_kernel("fp8_tensor.cu", "ted_fp8_amax_scale", _dtype_options(x))
    else:
        if count_out.dtype != torch.int64 or count_out.numel() < 1 or count_out.device != x.device:
            raise ValueError(f"_amax_launch: count_out must be an int64 tensor on {x.device}, got "
                             f"{count_out.dtype} {tuple(count_out.shape)} on {count_out.device}")
        kernel = get_kernel("fp8_tensor.cu", "ted_amax_count", _dtype_options(x))
        args += (count_out.data_ptr(),)
    _launch(kernel, grid, THREADS, args, x.device)


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """0-d fp32 max|x| ignoring NaN (= `formats.tensor_amax`), computed on the device (one launch)."""
    x = prepare_input(x)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    out = torch.empty(1, dtype=torch.float32, device=x.device)
    _amax_launch(x, out)
    return out[0]


def fp8_amax_scale(x: torch.Tensor, fp8_format: str, epsilon: float, pow2: bool):
    """(amax, scale, scale_inv) 0-d fp32 device tensors (formats.compute_scale_from_amax) in one launch."""
    x = prepare_input(x)
    out = torch.empty(3, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        out[0] = 0.0
        scale, scale_inv = fp8_current_scale(out[0], fp8_format, epsilon, pow2)
        return out[0], scale, scale_inv
    _amax_launch(x, out, fp8_format, epsilon, pow2)
    return out[0], out[1], out[2]


def fp8_current_scale(amax: torch.Tensor, fp8_format: str, epsilon: float, pow2: bool):
    """(scale, scale_inv) 0-d fp32 device tensors from a device amax (formats.compute_scale_from_amax)."""
    amax = amax.reshape(()).contiguous()
    scale = torch.empty((), dtype=torch.float32, device=amax.device)
    scale_inv = torch.empty_like(scale)
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_current_scale", ())
    args = (amax.data_ptr(), np.float32(FP8_MAX[fp8_format]), np.float32(epsilon), np.int32(pow2),
            scale.data_ptr(), scale_inv.data_ptr())
    _launch(kernel, 1, 1, args, amax.device)
    return scale, scale_inv


def fp8_scale_inv(scale: torch.Tensor) -> torch.Tensor:
    """0-d fp32 1/scale on the device."""
    scale = scale.detach().float().reshape(()).contiguous()
    out = torch.empty((), dtype=torch.float32, device=scale.device)
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_scale_inv", ())
    _launch(kernel, 1, 1, (scale.data_ptr(), out.data_ptr()), scale.device)
    return out


def fp8_cast_transpose_raw(x2d: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fp8_format: str,
                           rowwise: bool, columnwise: bool):
    """(row codes [M, K] or None, col codes [K, M] or None, stats float64[3] = (underflows, Σerr², overflows))."""
    x2d = prepare_input(x2d)
    return _cast_transpose(x2d, scale.data_ptr(), scale_inv.data_ptr(), fp8_format, rowwise, columnwise)


def _cast_transpose(x2d: torch.Tensor, scale_ptr: int, scale_inv_ptr: int, fp8_format: str, rowwise: bool,
                    columnwise: bool):
    """`fp8_cast_transpose_raw` of a prepared (contiguous, aligned) [M, K] tensor, with device addresses of the fp32
    scale and scale_inv: the single-launch bf16 / fp16 kernel when M % 64 == 0 and K % 128 == 0, else the general
    kernel (per-block partials summed by a second launch)."""
    m, k = x2d.shape
    dev = x2d.device
    row = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
    col = torch.empty((k, m), dtype=torch.uint8, device=dev) if columnwise else None
    stats = torch.empty(3, dtype=torch.float64, device=dev)
    codes = (row.data_ptr() if row is not None else 0, col.data_ptr() if col is not None else 0)
    head = (x2d.data_ptr(), np.int64(m), np.int64(k), scale_ptr, scale_inv_ptr, np.float32(FP8_MAX[fp8_format]),
            np.int32(rowwise), np.int32(columnwise)) + codes
    if x2d.dtype in _SIXTEEN_BIT and m % 64 == 0 and k % 128 == 0 and m > 0 and k > 0:
        grid = max(1, min(CT_BLOCKS_PER_SM * _sm_count(_device_index(dev)), (m // 64) * (k // 128)))
        partials, tickets = _workspace(dev)
        kernel = get_kernel("fp8_tensor.cu", "ted_fp8_cast_transpose16", _dtype_options(x2d, fp8_format))
        _launch(kernel, grid, THREADS, head + (partials, _ticket(tickets, "cast"), stats.data_ptr()), dev)
        return row, col, stats
    grid = max(1, min(BLOCKS_PER_SM * _sm_count(_device_index(dev)), ((m + 63) // 64) * ((k + 63) // 64)))
    partial = torch.empty((grid, 3), dtype=torch.float64, device=dev)
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_cast_transpose", _dtype_options(x2d, fp8_format))
    _launch(kernel, grid, THREADS, head + (partial.data_ptr(),), dev)
    _sum_columns(partial, stats)
    return row, col, stats


_FP8_STATS = {"underflows_num": 0, "sq_err": 1, "overflows_num": 2}


def _float8_result(quantizer, tensor: torch.Tensor, row, col, stats: torch.Tensor, scale_inv: torch.Tensor):
    """The Float8Tensor of a cast + transpose, with its fused statistics attached."""
    from tedebug.quantization.float8 import Float8Tensor

    out = Float8Tensor(
        tensor.shape, tensor.dtype, tensor.device, quantizer, fp8_format=quantizer.fp8_format,
        scale_inv=scale_inv, rowwise_data=row.reshape(tensor.shape) if row is not None else None,
        columnwise_data=col,
    )
    per = FusedStats(stats, _FP8_STATS)
    _attach_fused(out, tensor, {u: per for u, on in (("rowwise", quantizer.rowwise_usage),
                                                     ("columnwise", quantizer.columnwise_usage)) if on})
    return out


def fp8_quantize(quantizer, tensor: torch.Tensor, scale: torch.Tensor, scale_inv: Optional[torch.Tensor] = None):
    """Kernel version of `float8._cast_per_tensor` with a given device `scale` (Float8Tensor, same bytes).

    `scale_inv` (0-d fp32 on the device, = 1 / scale) is computed here when not given.
    """
    from tedebug.quantization.tensor import matrix_shape

    m, k = matrix_shape(tensor.shape)
    if not (scale.dtype is torch.float32 and scale.dim() == 0 and scale.device == tensor.device
            and not scale.requires_grad and scale.is_contiguous()):
        scale = scale.detach().float().reshape(()).to(tensor.device).contiguous()
    if scale_inv is None:
        scale_inv = fp8_scale_inv(scale)
    x2d = prepare_input(tensor).view(m, k)
    row, col, stats = _cast_transpose(x2d, scale.data_ptr(), scale_inv.data_ptr(), quantizer.fp8_format,
                                      quantizer.rowwise_usage, quantizer.columnwise_usage)
    return _float8_result(quantizer, tensor, row, col, stats, scale_inv)


def fp8_current_quantize(quantizer, tensor: torch.Tensor):
    """Kernel version of `Float8CurrentScalingQuantizer._quantize`: amax + scale (one launch), cast + transpose.

    The cast reads the scale and scale_inv the first launch wrote, by address: no tensor op in between."""
    from tedebug.quantization.tensor import matrix_shape

    x = prepare_input(tensor)
    if x.numel() == 0:
        _, scale, scale_inv = fp8_amax_scale(tensor, quantizer.fp8_format, quantizer.amax_epsilon,
                                             quantizer.force_pow_2_scales)
        return fp8_quantize(quantizer, tensor, scale, scale_inv)
    # amax, scale, -, -, scale_inv: scale_inv 16-byte aligned, so that torch._scaled_mm takes it without a copy
    vec = torch.empty(8, dtype=torch.float32, device=x.device)
    _amax_launch(x, vec, quantizer.fp8_format, quantizer.amax_epsilon, quantizer.force_pow_2_scales,
                 scale_inv_slot=4)
    m, k = matrix_shape(tensor.shape)
    base = vec.data_ptr()
    row, col, stats = _cast_transpose(x.view(m, k), base + 4, base + 16, quantizer.fp8_format,
                                      quantizer.rowwise_usage, quantizer.columnwise_usage)
    return _float8_result(quantizer, tensor, row, col, stats, vec[4])


DELAYED_UPDATE_MAX_LEN = 8 * THREADS  # ted_fp8_delayed_update keeps 8 history entries per thread


def fp8_delayed_update(history: torch.Tensor, scale: torch.Tensor, scaled_max: float, most_recent: bool) -> None:
    """`Float8Quantizer.update_scale` in one launch (roll the contiguous fp32 `history`, refresh the 1-element
    fp32 `scale` in place); the caller checks devices, dtypes and len(history) <= DELAYED_UPDATE_MAX_LEN."""
    kernel = get_kernel("fp8_tensor.cu", "ted_fp8_delayed_update", ())
    args = (history.data_ptr(), np.int32(history.numel()), scale.data_ptr(), np.float32(scaled_max),
            np.int32(most_recent))
    _launch(kernel, 1, THREADS, args, history.device)


def fp8_delayed_quantize(quantizer, tensor: torch.Tensor):
    """Kernel version of `Float8Quantizer._quantize`: records the amax into history[0], casts with `scale`."""
    from tedebug.quantization.tensor import matrix_shape

    quantizer.state_to(tensor.device)
    x = prepare_input(tensor)
    history, scale = quantizer._history, quantizer.scale
    if x.numel() == 0 or not (scale.dtype == torch.float32 and scale.numel() == 1 and scale.is_contiguous()):
        recorded = quantizer.amax  # history entry 0, a 1-element view
        torch.maximum(recorded, fp8_amax(tensor), out=recorded)
        return fp8_quantize(quantizer, tensor, quantizer.scale)
    # one launch: amax of x recorded into history[0] (torch.maximum) and scale_inv = 1 / scale, then the cast
    scale_inv = torch.empty(4, dtype=torch.float32, device=x.device)
    _amax_record_launch(x, history, scale, scale_inv)
    m, k = matrix_shape(tensor.shape)
    row, col, stats = _cast_transpose(x.view(m, k), scale.data_ptr(), scale_inv.data_ptr(), quantizer.fp8_format,
                                      quantizer.rowwise_usage, quantizer.columnwise_usage)
    return _float8_result(quantizer, tensor, row, col, stats, scale_inv[0])


def _amax_record_launch(x: torch.Tensor, history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """ted_fp8_amax_scale mode 3: history[0] = maximum(history[0], max|x|), scale_inv[0] = 1 / scale[0]."""
    n = x.numel()
    grid = _grid_for(x.device, max(n // (16 // x.element_size()), 1))
    partials, tickets = _workspace(x.device)
    args = (x.data_ptr(), np.int64(n), _ticket(tickets, "amax"), history.data_ptr(), np.int32(3), np.float32(0.0),
            np.float32(0.0), np.int32(0), scale.data_ptr(), scale_inv.data_ptr())
    _launch(get_kernel("fp8_tensor.cu", "ted_fp8_amax_scale", _dtype_options(x)), grid, THREADS, args, x.device)


# ------------------------------------------------------------------------------------------------ random bytes
def philox_bytes(seed: int, offset: int, n: int, device: torch.device) -> torch.Tensor:
    """`n` Philox4x32-10 bytes of (seed, offset) on a CUDA device (`tedebug.quantization.philox`, same bytes)."""
    out = torch.empty(n, dtype=torch.uint8, device=device)
    blocks = (n + 15) // 16
    grid = max(1, min(BLOCKS_PER_SM * _sm_count(_device_index(device)), (blocks + THREADS - 1) // THREADS))
    args = (out.data_ptr(), np.int64(n), np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32),
            np.uint32(offset & 0xFFFFFFFF), np.uint32(offset >> 32))
    _launch(get_kernel("philox.cu", "ted_philox_bytes", ()), grid, THREADS, args, device)
    return out


def cupy_importable() -> bool:
    """True when CuPy imports (it may still fail later without a GPU).

    A probe: an ImportError (not installed) or CuPy's own initialisation error (no CUDA runtime) means "no".
    """
    try:
        _cupy()
    except (ImportError, RuntimeError, OSError):
        return False
    return True
