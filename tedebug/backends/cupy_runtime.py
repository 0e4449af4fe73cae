"""What every CuPy launcher module shares: compiling the kernels, the per-stream workspace, grid sizing.

What it owns:

- loading: one `cupy.RawModule` per (source file, compile options), built lazily and cached (the source stamped
  with a digest of the kernel headers, so that CuPy's disk cache never serves a binary of other headers); a
  compile failure raises `KernelCompileError` naming the source and options and showing the NVRTC log;
  `get_kernel` returns a cached `tedebug.backends.launch.Kernel` (launched with `tedebug.backends.launch.launch`
  on torch's current stream);
- one persistent workspace per (device, stream) holding the per-block partials and the atomic tickets of the
  single-launch kernels (the last block of a launch finishes the reduction and resets its ticket), so a call
  allocates only its outputs; `ticket(tickets, name)` is the address of one kernel family's ticket slot;
- grid sizing from the device's SM count, the NVRTC options that select the input dtype and FP8 format
  (`dtype_options`), `prepare_input` (a contiguous, 16-byte-aligned CUDA tensor) and `sum_columns` (the second
  launch of the kernels that leave per-block partials).

The launchers live in one module per kernel source: `cupy_stats` (``stats.cu``), `cupy_fp8_tensor`
(``fp8_tensor.cu``), `cupy_mxfp8` (``mxfp8.cu``), `cupy_philox` (``philox.cu``), `cupy_fp8_block`
(``fp8_block.cu``), `cupy_nvfp4` (``nvfp4.cu``) and `cupy_dequant` (``dequant.cu``).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from tedebug.backends.launch import Kernel, launch, raw_stream

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # TED_DTYPE of kernels/common.cuh
FP8_CODE = {"E4M3": 0, "E5M2": 1}  # TED_FP8 of kernels/common.cuh
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
THREADS = 256
BLOCKS_PER_SM = 4  # general kernels
#: the most blocks per SM of any kernel that keeps per-block partials in the workspace (the workspace's rows)
MAX_BLOCKS_PER_SM = 4
#: sizeof(Acc), one block partial of the statistics pass (kernels/stats_pass.cuh asserts it)
ACC_BYTES = 88
#: the workspace's bytes per block partial: room for the statistics pass's `Acc` and for the 4 doubles of the other
#: kernels' partials
_PARTIAL_ROW_BYTES = max(128, ACC_BYTES, 4 * 8)
#: uint32 slots of the tickets; "amax": 4 (amax bits), 5 (ticket), 6-7 (64-bit non-zero count of ted_amax_count);
#: "stats_group": 16-18 (one per tensor of a `ted_stats_group` launch); "fp8_current": 24 (amax bits), 25 (barrier
#: ticket), 26 (barrier flag) of ``ted_fp8_current_cast16`` (25 and 26 also of ``ted_fp8_current_stats_cast16``,
#: whose statistics pass takes the "stats" ticket); "fp8_delayed": 28 (amax bits of
#: ``ted_fp8_delayed_cast16``)
TICKETS = {
    "stats": 0,
    "mxfp8": 1,
    "cast": 2,
    "amax": 4,
    "fp8_block": 8,
    "nvfp4": 12,
    "stats_group": 16,
    "fp8_current": 24,
    "fp8_delayed": 28,
}
_TICKET_BYTES = 256


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


def cupy_importable() -> bool:
    """True when CuPy imports (it may still fail later without a GPU).

    A probe: an ImportError (not installed) or CuPy's own initialisation error (no CUDA runtime) means "no".
    """
    try:
        _cupy()
    except (ImportError, RuntimeError, OSError):
        return False
    return True


_MODULES: Dict[Tuple[str, Tuple[str, ...]], object] = {}


@functools.lru_cache(maxsize=None)
def headers_stamp(directory: Path) -> str:
    """A comment line naming a digest of every header (``*.cuh``) in the kernel folder `directory`, appended to each
    source before it is compiled.

    Why: CuPy keeps compiled modules on disk keyed by the source text and the options, not by the files the source
    includes, so after an upgrade that changed only a header (the statistics pass lives in ``stats_pass.cuh``) it
    would load the binary built from the old header.  The stamp makes the key change with any header.  Read once
    per process and folder."""
    digest = hashlib.sha256()
    for header in sorted(directory.glob("*.cuh")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes() + b"\0")
    return f"\n// tedebug kernel headers {digest.hexdigest()[:32]}\n"


def get_module(source: str, options: Tuple[str, ...]):
    """The compiled RawModule of ``kernels/<source>`` for `options` (cached per (source, options))."""
    key = (source, tuple(options))
    module = _MODULES.get(key)
    if module is not None:
        return module
    cp = _cupy()
    directory = kernel_dir()
    path = directory / source
    code = path.read_text() + headers_stamp(directory)  # (the compile cache must see the headers: `headers_stamp`)
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


# ------------------------------------------------------------------------------------------------ devices, workspace
def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (torch's current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The number of streaming multiprocessors of CUDA device `index`."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def grid_for(device: torch.device, work_items: int, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """Blocks of `THREADS` threads for `work_items` items, at most `blocks_per_sm` per SM (grid-stride loops)."""
    return grid_on(device_index(device), work_items, blocks_per_sm)


def grid_on(index: int, work_items: int, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """`grid_for` of CUDA device `index` (for the launch plans, which know the index)."""
    return max(1, min(blocks_per_sm * sm_count(index), (work_items + THREADS - 1) // THREADS))


_WORKSPACES: Dict[Tuple[int, int], torch.Tensor] = {}
#: (device index, raw stream) -> (partials pointer, tickets pointer) of the workspace in `_WORKSPACES`
_WORKSPACE_POINTERS: Dict[Tuple[int, int], Tuple[int, int]] = {}


def workspace(device: torch.device) -> Tuple[int, int]:
    """(partials pointer, tickets pointer) of the workspace of torch's current stream on `device`.

    The tickets start at 0 and every single-launch kernel leaves them at 0; kernels on one stream run in order,
    so they can share it.
    """
    index = device_index(device)
    return workspace_on(index, raw_stream(index))


def workspace_on(index: int, stream: int) -> Tuple[int, int]:
    """`workspace` of device `index` for raw stream `stream` (torch's current stream there)."""
    key = (index, stream)
    pointers = _WORKSPACE_POINTERS.get(key)
    if pointers is None:
        nbytes = _TICKET_BYTES + MAX_BLOCKS_PER_SM * sm_count(index) * _PARTIAL_ROW_BYTES
        ws = _WORKSPACES[key] = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
        base = ws.data_ptr()
        pointers = _WORKSPACE_POINTERS[key] = (base + _TICKET_BYTES, base)
    return pointers


def ticket(tickets: int, name: str) -> int:
    """Device address of the ticket slot of kernel family `name` (`TICKETS`) in a workspace's tickets."""
    return tickets + 4 * TICKETS[name]


# ------------------------------------------------------------------------------------------------ inputs, options
_OPTIONS: Dict[Tuple[torch.dtype, Optional[str]], Tuple[str, ...]] = {}  # (dtype, format) -> NVRTC options


def dtype_options(x: torch.Tensor, fp8_format: Optional[str] = None) -> Tuple[str, ...]:
    """The NVRTC options compiling a kernel source for `x`'s dtype (and an FP8 format): ``-DTED_DTYPE=...``."""
    return dtype_options_of(x.dtype, fp8_format)


def dtype_options_of(dtype: torch.dtype, fp8_format: Optional[str] = None) -> Tuple[str, ...]:
    """`dtype_options` of a dtype (a kernel whose work does not depend on the input dtype takes one build)."""
    opts = _OPTIONS.get((dtype, fp8_format))
    if opts is None:
        if dtype not in DTYPE_CODE:
            raise TypeError(f"tedebug kernels: expected a float32/bfloat16/float16 tensor, got {dtype}")
        opts = (f"-DTED_DTYPE={DTYPE_CODE[dtype]}",)
        if fp8_format is not None:
            opts += (f"-DTED_FP8={FP8_CODE[fp8_format]}",)
        _OPTIONS[(dtype, fp8_format)] = opts
    return opts


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


#: np.int32(False), np.int32(True): the flag arguments of the kernels' signatures, made once (`FLAGS[bool(on)]`)
FLAGS = (np.int32(0), np.int32(1))


class PlanCache:
    """The per-shape launch constants of one launcher (kernels, grids, the np scalars of the extents), worked out
    once: a layer quantizes and dequantizes the same shapes at every step.  ``get(key)`` is the dict's own look-up
    (None when absent); `put` keeps a plan and returns it, after starting over when `limit` plans are kept (shapes
    that vary without end)."""

    __slots__ = ("_plans", "limit", "get")

    def __init__(self, limit: int = 4096) -> None:
        self._plans: Dict[tuple, Any] = {}
        self.limit = limit
        self.get = self._plans.get

    def put(self, key: tuple, plan: Any) -> Any:
        if len(self._plans) >= self.limit:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def ready_input(x: torch.Tensor) -> torch.Tensor:
    """`prepare_input` for a CUDA tensor that is usually ready already (contiguous, 16-byte aligned): then `x`
    itself, without a call (the kernels read it by address; no autograd op touches it)."""
    if x.is_contiguous() and not x.data_ptr() % 16:
        return x
    return prepare_input(x)


def pointer(t: Optional[torch.Tensor]) -> int:
    """The device address of `t`, 0 (a null pointer) for None: an absent output of a kernel."""
    return t.data_ptr() if t is not None else 0


def sum_columns(partial: torch.Tensor, out: torch.Tensor) -> None:
    """out[j] = Σ_i partial[i, j] of a float64 [rows, cols] tensor of per-block partials (one launch)."""
    rows, cols = partial.shape
    kernel = get_kernel("common.cuh", "ted_sum_columns", ())
    launch(kernel, 1, THREADS, (partial.data_ptr(), np.int32(rows), np.int32(cols), out.data_ptr()), partial.device)
