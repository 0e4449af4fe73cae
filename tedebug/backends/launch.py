"""Launching a CuPy-compiled kernel on torch's current CUDA stream with little host cost.

What it owns: `Kernel` (one compiled kernel function, its CUDA function handle per device) and `launch(kernel,
grid, block, args, device)`; and, for a kernel with a grid-wide barrier, `launch_cooperative_on`
(``cuLaunchCooperativeKernel``: every block resident at once) with `cooperative_blocks_per_sm`, which bounds the
grid it takes (0 in the ``cupy`` mode or where the device has no cooperative launches: the caller then takes
another path).

Two ways to launch, chosen once per process:

- ``driver`` (default where ``libcuda`` loads): ``cuLaunchKernel`` called through ctypes with the function handle
  CuPy loaded, the raw ``cudaStream_t`` of torch's current stream and the arguments packed by one ``struct`` call
  into a parameter block (`_ArgBlock`: one 8-byte slot per argument and a fixed array of pointers to the slots, made
  once per argument signature and thread, so concurrent launches from the autograd thread never share one).  This
  costs a few microseconds, several times less than CuPy's own argument packing, which matters when every logged
  tensor launches a kernel (a training step logs hundreds).  The call holds the GIL (``ctypes.PyDLL``), so launches from
  the autograd thread and the main thread never interleave.  A non-zero ``CUresult`` raises `KernelLaunchError`
  naming the kernel, the grid and the driver's error name.  Where the extension of ``kernels/host_launch.c``
  builds (`tedebug.backends.host_launch`; `compiled_launches`), launches go through it first: the same parameter
  block and the same driver call made from C, and for the statistics group launch of every GEMM call
  (`cupy_stats.basic_stats_group_scratch_into`) the tensors read from C as well.  A launch it hands back (a type or
  value it does not take, a device that is not current, a driver error) takes the ctypes path, which raises what
  it raises; ``TEDEBUG_LAUNCH=ctypes`` keeps every launch on the ctypes path.
- ``cupy``: CuPy's ``RawKernel.__call__`` on a CuPy stream made from torch's stream (``Stream.from_external`` with
  an object implementing the CUDA stream protocol; ``ExternalStream`` on CuPy versions without it), one cached
  stream object per torch stream.  Used where libcuda cannot be loaded, or when ``TEDEBUG_LAUNCH=cupy`` asks for it.

Arguments follow the kernels' C signatures, typed on the Python side: ``numpy.int64`` / ``numpy.int32`` /
``numpy.uint32`` / ``numpy.float32`` / ``numpy.float64`` scalars and plain Python ``int`` device pointers
(``tensor.data_ptr()``; 0 for a null pointer).  Any other argument type is a TypeError, never a guess.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from tedebug.backends.environ import environ_value

ENV_VAR = "TEDEBUG_LAUNCH"
_MODES = ("driver", "cupy", "ctypes")

#: the `struct` format of one argument's 8-byte parameter slot, by the argument's Python type (little-endian;
#: a 4-byte value fills the low half of its slot, which is where the driver reads it)
_SLOT_FORMAT = {
    int: "Q",  # a device pointer
    np.int64: "q",
    np.uint64: "Q",
    np.int32: "i4x",
    np.uint32: "I4x",
    np.float32: "f4x",
    np.float64: "d",
}
#: the argument types the compiled launches take, in the order of ``kernels/host_launch.c``'s kinds (pointer, int64,
#: uint64, int32, uint32, float32, float64): the keys of `_SLOT_FORMAT`
_KIND_TYPES = (int, np.int64, np.uint64, np.int32, np.uint32, np.float32, np.float64)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: torch's current CUDA device index (the private call skips `torch.cuda.current_device`'s lazy-init check; the
#: launch path only runs after CUDA tensors exist)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


class KernelLaunchError(RuntimeError):
    """The CUDA driver refused a tedebug kernel launch."""


def raw_stream(device_index: int) -> int:
    """The raw cudaStream_t of torch's current stream on `device_index` (the fast private call when present)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


# ------------------------------------------------------------------------------------------------ driver path
@functools.lru_cache(maxsize=None)
def _libcuda():
    """libcuda through ctypes.PyDLL (calls hold the GIL), or None if it cannot load."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.PyDLL(name)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def _driver():
    """(cuLaunchKernel, cuGetErrorName) from libcuda, or None if it cannot load."""
    lib = _libcuda()
    if lib is None:
        return None
    launch_fn = lib.cuLaunchKernel
    launch_fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch_fn.restype = ctypes.c_int
    error_name = lib.cuGetErrorName
    error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    error_name.restype = ctypes.c_int
    return launch_fn, error_name


@functools.lru_cache(maxsize=None)
def _cooperative_driver():
    """(cuLaunchCooperativeKernel, cuOccupancyMaxActiveBlocksPerMultiprocessor, cuDeviceGetAttribute) from libcuda,
    or None if it cannot load."""
    lib = _libcuda()
    if lib is None:
        return None
    launch_fn = lib.cuLaunchCooperativeKernel
    launch_fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p]
    launch_fn.restype = ctypes.c_int
    occupancy = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
    occupancy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    occupancy.restype = ctypes.c_int
    attribute = lib.cuDeviceGetAttribute
    attribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    attribute.restype = ctypes.c_int
    return launch_fn, occupancy, attribute


@functools.lru_cache(maxsize=None)
def _context_driver():
    """(cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent) from libcuda, or None if it cannot load."""
    lib = _libcuda()
    if lib is None:
        return None
    device_get = lib.cuDeviceGet
    device_get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    device_get.restype = ctypes.c_int
    retain = lib.cuDevicePrimaryCtxRetain
    retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    retain.restype = ctypes.c_int
    set_current = lib.cuCtxSetCurrent
    set_current.argtypes = [ctypes.c_void_p]
    set_current.restype = ctypes.c_int
    return device_get, retain, set_current


#: CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current CUDA context
_INVALID_CONTEXT = 201


def _bind_primary_context(index: int) -> bool:
    """Make device `index`'s primary context (the one torch's CUDA runtime uses) current on the calling thread;
    False when the driver refuses.

    Why: the runtime binds it to a thread at that thread's first runtime call that needs it, and torch's device
    switch skips ``cudaSetDevice`` when the device already reads as current, which device 0 does on a new thread.
    So a driver launch that comes first on a thread - a tedebug kernel launched from autograd's device thread before
    any torch kernel ran there, or from a thread of the user's - finds no context (CUDA_ERROR_INVALID_CONTEXT).
    Asked only after that error (the launch is then made again), so it costs nothing on the usual path.  The
    primary context is retained once more and never released: it lives as long as the process anyway."""
    driver = _context_driver()
    if driver is None:
        return False
    device_get, retain, set_current = driver
    device = ctypes.c_int(0)
    context = ctypes.c_void_p(0)
    if device_get(ctypes.byref(device), index) != 0 or retain(ctypes.byref(context), device.value) != 0:
        return False
    return set_current(context) == 0


def _again_with_context(code: int, index: int, call: Any, *args: Any) -> int:
    """After a driver call returned `code`: the call made again with device `index`'s primary context bound to this
    thread when `code` says the thread had none (`_bind_primary_context`), else `code` itself."""
    if code != _INVALID_CONTEXT or not _bind_primary_context(index):
        return code
    if _current_device() != index:
        with torch.cuda.device(index):
            return call(*args)
    return call(*args)


_env = environ_value(ENV_VAR)


#: (the raw value of $TEDEBUG_LAUNCH, the mode it gives) of the last `launch_mode` call: every launch asks, and the
#: answer changes only with the variable (its raw value is the same object while it is unchanged)
_mode_of: Tuple[Any, str] = (object(), "")


def launch_mode() -> str:
    """``"driver"`` or ``"cupy"``: ``$TEDEBUG_LAUNCH`` when set (``ctypes`` is the driver mode without the compiled
    launches, `compiled_launches`), else driver when libcuda loads."""
    global _mode_of
    raw = _env.raw()
    if raw is _mode_of[0]:
        return _mode_of[1]
    requested = _env.text(raw).strip().lower()
    if requested:
        if requested not in _MODES:
            raise ValueError(f"environment variable {ENV_VAR}={requested!r}: expected one of {_MODES}")
        if requested != "cupy" and _driver() is None:
            raise RuntimeError(f"{ENV_VAR}={requested} was requested but libcuda could not be loaded through ctypes")
        mode = "cupy" if requested == "cupy" else "driver"
    else:
        mode = "driver" if _driver() is not None else "cupy"
    _mode_of = (raw, mode)
    return mode


#: (the raw value of $TEDEBUG_LAUNCH, what `compiled_launches` answers for it)
_compiled_of: Tuple[Any, Any] = (object(), None)


def compiled_launches() -> Any:
    """The compiled launches (`tedebug.backends.host_launch`'s module) where launches may use them: in the driver
    mode unless ``$TEDEBUG_LAUNCH`` is ``ctypes``, and where the extension builds (at the first call of the
    process); None otherwise, and the launches then take the ctypes (or CuPy) path.  Asked at every launch, so it
    costs one read of the variable."""
    global _compiled_of
    raw = _env.raw()
    if raw is _compiled_of[0]:
        return _compiled_of[1]
    compiled = None
    if launch_mode() == "driver" and _env.text(raw).strip().lower() != "ctypes":
        from tedebug.backends import host_launch  # (builds with the C compiler: only where a launch needs it)

        compiled = _configured(host_launch.load())
    _compiled_of = (raw, compiled)
    return compiled


def _configured(compiled: Any) -> Any:
    """`compiled` told the driver's entry points, torch's current-device and raw-current-stream calls (the latter
    None where torch lacks it) and the argument types (None when there is no module, or no address to give it)."""
    if compiled is None:
        return None
    try:
        address = ctypes.cast(_driver()[0], ctypes.c_void_p).value  # type: ignore[index]
        cooperative = _cooperative_driver()
        cooperative_address = ctypes.cast(cooperative[0], ctypes.c_void_p).value if cooperative is not None else 0
    except (ctypes.ArgumentError, TypeError):  # (entry points that are not C functions: nothing to call from C)
        return None
    if not address:
        return None
    compiled.configure(address, cooperative_address or 0, _current_device, _RAW_STREAM, _KIND_TYPES)
    return compiled


def compiled_target(kernel: "Kernel", index: int) -> Optional[int]:
    """The CUfunction of `kernel` on device `index` for the compiled statistics group launch, which takes torch's raw
    current stream from the call `compiled_launches` told the module; None where torch lacks that call (the Python
    path then makes every such launch)."""
    if _RAW_STREAM is None:
        return None
    return kernel.handle(index)


class _ArgBlock:
    """The parameter block of one argument signature: one 8-byte slot per argument and the array of pointers to the
    slots that ``cuLaunchKernel`` takes (fixed addresses: a launch only packs the values)."""

    __slots__ = ("pack_into", "slots", "params")

    def __init__(self, signature: Tuple[type, ...], kernel_name: str) -> None:
        formats = []
        for position, kind in enumerate(signature):
            fmt = _SLOT_FORMAT.get(kind)
            if fmt is None:
                raise TypeError(
                    f"kernel {kernel_name!r}, argument {position}: {kind.__name__} has no fixed C type; pass a "
                    f"device pointer as int or a numpy scalar (np.int64 / np.int32 / np.uint32 / np.float32 / "
                    f"np.float64)"
                )
            formats.append(fmt)
        count = max(len(signature), 1)
        self.pack_into = struct.Struct("<" + "".join(formats)).pack_into
        self.slots = (ctypes.c_uint64 * count)()
        base = ctypes.addressof(self.slots)
        self.params = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])


_THREAD_BLOCKS = threading.local()  # per thread: argument signature -> _ArgBlock


def _arg_block(args: Sequence[Any], kernel_name: str) -> _ArgBlock:
    """This thread's parameter block for `args`' signature, with `args` packed into it."""
    return _packed_block(tuple(map(type, args)), args, kernel_name)


def _packed_block(signature: Tuple[type, ...], args: Sequence[Any], kernel_name: str) -> _ArgBlock:
    """This thread's parameter block for `signature`, with `args` packed into it (a plain int or float packs into
    the C type its signature entry names)."""
    blocks = getattr(_THREAD_BLOCKS, "blocks", None)
    if blocks is None:
        blocks = _THREAD_BLOCKS.blocks = {}
    block = blocks.get(signature)
    if block is None:
        block = blocks[signature] = _ArgBlock(signature, kernel_name)
    try:
        block.pack_into(block.slots, 0, *args)
    except struct.error as err:
        raise ValueError(f"kernel {kernel_name!r}: an argument does not fit its C type: {err}") from err
    return block


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    _, error_name = _driver()
    if error_name(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


# ------------------------------------------------------------------------------------------------ cupy path
class _StreamHandle:
    """A raw cudaStream_t exposed through the CUDA stream protocol (what CuPy's Stream.from_external takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.handle)


_CUPY_STREAMS: Dict[Tuple[int, int], Any] = {}


def _cupy_stream(cp, device_index: int, handle: int):
    key = (device_index, handle)
    stream = _CUPY_STREAMS.get(key)
    if stream is None:
        from_external = getattr(cp.cuda.Stream, "from_external", None)
        with cp.cuda.Device(device_index):
            if from_external is not None:
                stream = from_external(_StreamHandle(handle))
            else:  # CuPy before Stream.from_external
                stream = cp.cuda.ExternalStream(handle, device_index)
        _CUPY_STREAMS[key] = stream
    return stream


# ------------------------------------------------------------------------------------------------ kernels
class Kernel:
    """One kernel function of a compiled CuPy RawModule, launchable on any device the module loads on."""

    __slots__ = ("name", "_module", "_raw", "_handles")

    def __init__(self, module, name: str) -> None:
        self.name = name
        self._module = module
        self._raw: Dict[int, Any] = {}
        self._handles: Dict[int, int] = {}

    def raw(self, device_index: int):
        """CuPy's RawKernel of this function on `device_index` (loads the module there on first use)."""
        raw = self._raw.get(device_index)
        if raw is None:
            import cupy as cp

            with cp.cuda.Device(device_index):
                raw = self._module.get_function(self.name)
                handle = int(getattr(raw, "kernel", raw).ptr)  # RawKernel.kernel is the loaded cuda Function
            self._raw[device_index] = raw
            self._handles[device_index] = handle
        return raw

    def handle(self, device_index: int) -> int:
        """The CUfunction of this kernel on `device_index`."""
        handle = self._handles.get(device_index)
        if handle is None:
            self.raw(device_index)
            handle = self._handles[device_index]
        return handle


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def launch(
    kernel: Kernel, grid: int, block: int, args: Sequence[Any], device: torch.device, shared_mem: int = 0
) -> None:
    """Launch `kernel` with a 1-D `grid` x `block` on torch's current stream of `device`."""
    index = _device_index(device)
    launch_on(kernel, index, raw_stream(index), int(grid), int(block), args, shared_mem)


def launch_on(
    kernel: Kernel, index: int, stream: int, grid: int, block: int, args: Sequence[Any], shared_mem: int = 0
) -> None:
    """`launch` for a caller that already holds the device index and the raw stream (`raw_stream(index)`, torch's
    current stream there): the per-tensor statistics launch.  `grid` and `block` must be ints."""
    compiled = compiled_launches()
    if compiled is not None and not compiled.launch(
        kernel.handle(index), index, grid, block, shared_mem, stream, args, None, False
    ):
        return  # (launched from C: the same parameter block, the same driver call)
    if launch_mode() == "driver":
        _launch_driver(kernel, index, grid, block, _arg_block(args, kernel.name).params, stream, shared_mem)
    else:
        _launch_cupy(kernel, index, grid, block, args, stream, shared_mem)


def launch_signed(
    kernel: Kernel,
    index: int,
    stream: int,
    grid: int,
    block: int,
    signature: Tuple[type, ...],
    values: Sequence[Any],
) -> None:
    """`launch_on` for a caller whose argument types never change: `signature` gives each argument's type as
    `launch_on`'s `args` would carry it (int for a pointer, np.int64, np.uint32, ...) and `values` the arguments as
    plain Python numbers, packed straight into the parameter block, so a launch makes no numpy scalar per argument
    and does not work the signature out again (the statistics group launch: 14 arguments, every GEMM call)."""
    compiled = compiled_launches()
    if compiled is not None and not compiled.launch(
        kernel.handle(index), index, grid, block, 0, stream, values, signature, False
    ):
        return
    if launch_mode() == "driver":
        _launch_driver(kernel, index, grid, block, _packed_block(signature, values, kernel.name).params, stream, 0)
    else:
        args = tuple(v if kind is int else kind(v) for kind, v in zip(signature, values))
        _launch_cupy(kernel, index, grid, block, args, stream, 0)


def _launch_driver(
    kernel: Kernel, index: int, grid: int, block: int, params: Any, stream: int, shared_mem: int
) -> None:
    launch_fn, _ = _driver()
    function = kernel.handle(index)
    if _current_device() != index:
        with torch.cuda.device(index):
            code = launch_fn(function, grid, 1, 1, block, 1, 1, shared_mem, stream, params, None)
    else:
        code = launch_fn(function, grid, 1, 1, block, 1, 1, shared_mem, stream, params, None)
    if code != 0:
        code = _again_with_context(
            code, index, launch_fn, function, grid, 1, 1, block, 1, 1, shared_mem, stream, params, None
        )
    if code != 0:
        raise KernelLaunchError(
            f"tedebug: cuLaunchKernel({kernel.name!r}, grid={grid}, block={block}, shared_mem={shared_mem}) on "
            f"cuda:{index} failed with {_error_name(code)}"
        )


#: CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
_ATTRIBUTE_COOPERATIVE_LAUNCH = 95


def cooperative_blocks_per_sm(kernel: Kernel, index: int, block: int) -> int:
    """How many blocks of `block` threads of `kernel` (no dynamic shared memory) can be resident on one SM of device
    `index` at once: times the SMs, the most a cooperative launch (`launch_cooperative_on`) may ask for; 0 where
    cooperative launches are unavailable (the ``cupy`` launch mode, no libcuda, a device without them) or the
    driver says no."""
    driver = _cooperative_driver() if launch_mode() == "driver" else None
    if driver is None:
        return 0
    _, occupancy, attribute = driver
    supported = ctypes.c_int(0)
    if attribute(ctypes.byref(supported), _ATTRIBUTE_COOPERATIVE_LAUNCH, index) != 0 or not supported.value:
        return 0
    per_sm = ctypes.c_int(0)
    function = kernel.handle(index)
    if _current_device() != index:
        with torch.cuda.device(index):
            code = occupancy(ctypes.byref(per_sm), function, block, 0)
    else:
        code = occupancy(ctypes.byref(per_sm), function, block, 0)
    if code != 0:
        code = _again_with_context(code, index, occupancy, ctypes.byref(per_sm), function, block, 0)
    return per_sm.value if code == 0 else 0


def launch_cooperative_on(kernel: Kernel, index: int, stream: int, grid: int, block: int, args: Sequence[Any]) -> None:
    """`launch_on` through ``cuLaunchCooperativeKernel``: every block of the grid is resident at the same time (a
    kernel with a grid-wide barrier needs that).  `grid` must not exceed `cooperative_blocks_per_sm` times the SMs;
    only where that is above 0."""
    function = kernel.handle(index)
    compiled = compiled_launches()
    if compiled is not None and not compiled.launch(function, index, grid, block, 0, stream, args, None, True):
        return
    launch_fn = _cooperative_driver()[0]  # type: ignore[index]  # (`cooperative_blocks_per_sm` checked it loads)
    params = _arg_block(args, kernel.name).params
    if _current_device() != index:
        with torch.cuda.device(index):
            code = launch_fn(function, grid, 1, 1, block, 1, 1, 0, stream, params)
    else:
        code = launch_fn(function, grid, 1, 1, block, 1, 1, 0, stream, params)
    if code != 0:
        code = _again_with_context(code, index, launch_fn, function, grid, 1, 1, block, 1, 1, 0, stream, params)
    if code != 0:
        raise KernelLaunchError(
            f"tedebug: cuLaunchCooperativeKernel({kernel.name!r}, grid={grid}, block={block}) on cuda:{index} "
            f"failed with {_error_name(code)}"
        )


def _launch_cupy(
    kernel: Kernel, index: int, grid: int, block: int, args: Sequence[Any], stream: int, shared_mem: int
) -> None:
    import cupy as cp

    raw = kernel.raw(index)
    cupy_args = tuple(np.uint64(a) if type(a) is int else a for a in args)
    cupy_stream = _cupy_stream(cp, index, stream)
    if cp.cuda.runtime.getDevice() == index:
        raw((grid,), (block,), cupy_args, stream=cupy_stream, shared_mem=shared_mem)
        return
    with cp.cuda.Device(index):
        raw((grid,), (block,), cupy_args, stream=cupy_stream, shared_mem=shared_mem)
