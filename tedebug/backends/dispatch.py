"""Which implementation computes statistics partials and quantizations: the CuPy kernels or the torch reference.

The choice is a `KernelPreference` (``AUTO`` / ``TORCH`` / ``CUPY``, values ``"auto"`` / ``"torch"`` / ``"cupy"``).
A caller that cares passes it: every dispatch function takes ``kernel=`` (a `KernelPreference` or its name), and
the quantizers take ``kernel=`` at construction and pass it on.  Where no caller chose (``kernel=None``), the
default is, in priority order:

1. `use_backend(name)` - sets the default for this process; used as a context manager it restores the previous
   choice on exit (``with use_backend("torch"): ...``);
2. the environment variable ``TEDEBUG_BACKEND`` (read at each call);
3. ``"auto"``.

Meanings: ``"auto"`` (kernels for CUDA tensors when CuPy imports, torch otherwise), ``"torch"`` (always the torch
reference), ``"cupy"`` (always the kernels; a CPU tensor or a missing CuPy is a clear error, never a silent
fallback).  Inputs the kernels do not take (empty tensors, float64, a shape NVFP4 rejects) always use the torch
reference.
"""

from __future__ import annotations

import enum
import importlib
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from tedebug.backends import torch_ref
from tedebug.backends.environ import environ_value


class KernelPreference(str, enum.Enum):
    """Which implementation a caller asks for; the values are the names `use_backend` and ``TEDEBUG_BACKEND`` take
    (a member equals its name: ``KernelPreference.TORCH == "torch"``)."""

    AUTO = "auto"  # the kernels for CUDA tensors when CuPy imports, else the torch reference
    TORCH = "torch"  # always the torch reference
    CUPY = "cupy"  # always the kernels (an error where they cannot run)


BACKENDS = tuple(member.value for member in KernelPreference)
#: what every dispatch function takes as ``kernel=``: a preference, its name, or None for the default
KernelChoice = Union[KernelPreference, str, None]
ENV_VAR = "TEDEBUG_BACKEND"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_override: Optional[str] = None


def _check_name(name: str, where: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of {BACKENDS}")
    return name.lower()


def kernel_preference(kernel: KernelChoice, where: str = "kernel") -> Optional[KernelPreference]:
    """`kernel` as a `KernelPreference` (a name in any case is accepted), None staying None ("use the default");
    anything else is a ValueError naming `where`."""
    if kernel is None or isinstance(kernel, KernelPreference):
        return kernel
    return KernelPreference(_check_name(kernel, where))


def _name_of(kernel: KernelChoice) -> str:
    """The backend name in force for a call that passed `kernel`: its own choice, else `requested_backend()`."""
    if kernel is None:
        return requested_backend()
    if isinstance(kernel, KernelPreference):
        return kernel.value
    return _check_name(kernel, "kernel")


class use_backend:  # noqa: N801 - reads as a function at call sites
    """Select the default backend ("auto" | "torch" | "cupy" or a `KernelPreference`) of calls that pass no
    ``kernel=``; as a context manager, restore the previous one on exit."""

    def __init__(self, name: str) -> None:
        global _override
        self.name = _check_name(name, "use_backend")
        self._previous = _override
        _override = self.name

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc) -> None:
        global _override
        _override = self._previous


#: (the raw value of $TEDEBUG_BACKEND last seen, its checked name): re-checked only when the variable changes
_env_parsed: Tuple[Any, str] = (None, "auto")
_env = environ_value(ENV_VAR)


def requested_backend() -> str:
    """The default backend name (for calls that pass no ``kernel=``): `use_backend`'s choice, else
    ``$TEDEBUG_BACKEND`` (read at every call; unset or empty: ``"auto"``)."""
    global _env_parsed
    if _override is not None:
        return _override
    raw = _env.raw()
    if raw is not _env_parsed[0]:  # (the same object while the variable is unchanged: `tedebug.backends.environ`)
        _env_parsed = (
            raw,
            _check_name(_env.text(raw) or "auto", f"environment variable {ENV_VAR}"),
        )
    return _env_parsed[1]


def cupy_available() -> bool:
    """True when CUDA is available to torch and CuPy imports."""
    if not torch.cuda.is_available():
        return False
    from tedebug.backends import cupy_runtime

    return cupy_runtime.cupy_importable()


def use_kernels(tensor: torch.Tensor, kernel: KernelChoice = None) -> bool:
    """Whether `tensor` goes to the CuPy kernels under `kernel` (None: the default, `requested_backend()`); errors
    for an impossible "cupy".  (Every quantization asks: the default is read without `_name_of`'s frame.)"""
    name = requested_backend() if kernel is None else _name_of(kernel)
    if name == "torch":
        return False
    if name == "cupy":
        asked = "kernel=" if kernel is not None else f"use_backend / {ENV_VAR}"
        if not tensor.is_cuda:
            raise RuntimeError(
                f"tedebug backend 'cupy' was requested ({asked}) but the tensor is on "
                f"{tensor.device}; the CuPy kernels only run on CUDA tensors (use 'auto' or 'torch')"
            )
        if not cupy_available():
            raise RuntimeError(
                f"tedebug backend 'cupy' was requested ({asked}) but CuPy or CUDA is not "
                f"available (torch.cuda.is_available()={torch.cuda.is_available()}); install cupy-cuda12x/13x"
            )
        return True
    # "auto": a CUDA tensor implies that CUDA is available, so only CuPy needs probing.
    return tensor.is_cuda and _cupy_importable()


_cupy_found = False  # CuPy imported once: it stays importable for the rest of the process


def _cupy_importable() -> bool:
    global _cupy_found
    if not _cupy_found:
        from tedebug.backends import cupy_runtime

        _cupy_found = cupy_runtime.cupy_importable()
    return _cupy_found


#: the launcher modules `_kernel_module` imported so far, by name
_KERNEL_MODULES: Dict[str, ModuleType] = {}


def _kernel_module(name: str) -> ModuleType:
    """The launcher module ``tedebug.backends.<name>``, imported on first use (CuPy loads only where a kernel runs)
    and then found by one dict look-up: an import statement in the function body would run importlib's
    ``_handle_fromlist`` at every quantization and GEMM."""
    module = _KERNEL_MODULES.get(name)
    if module is None:
        module = _KERNEL_MODULES[name] = importlib.import_module(f"tedebug.backends.{name}")
    return module


def _kernel_input(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _KERNEL_DTYPES and tensor.numel() > 0


def stats_backend(tensor: Optional[torch.Tensor], kernel: KernelChoice = None) -> ModuleType:
    """The module whose family functions compute statistics partials of `tensor` (called for every logged tensor,
    so the usual answers take one look at the backend name and at the tensor: "torch", a tensor that is not on a
    CUDA device under "auto" and None (scale-only statistics of a weight kept only in quantized form) get the torch
    reference, a CUDA tensor the kernels take under "auto" gets them; "cupy" goes through `use_kernels`, which
    raises where the kernels cannot run).  The usual answers are written out here rather than asked of the helpers
    below: every logged tensor asks."""
    if tensor is None:
        return torch_ref
    name = requested_backend() if kernel is None else _name_of(kernel)
    if name == "auto":
        if tensor.is_cuda and (_cupy_found or _cupy_importable()) and tensor.dtype in _KERNEL_DTYPES:
            if tensor.numel() > 0:
                return _KERNEL_MODULES.get("cupy_stats") or _kernel_module("cupy_stats")
        return torch_ref
    if name == "torch":
        return torch_ref
    if use_kernels(tensor, kernel) and _kernel_input(tensor):
        return _kernel_module("cupy_stats")
    return torch_ref


def _matrix(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-D view [M, K] of a non-empty tensor (M = product of the leading dims, 1 for a 1-D tensor) for the
    quantize kernels, which read it by address only: a 2-D tensor (every GEMM operand of the layers) is passed as
    it is, without a view op."""
    return tensor if tensor.dim() == 2 else tensor.detach().reshape(-1, tensor.shape[-1])


def quantize_mxfp8(tensor: torch.Tensor, fp8_format: str, rowwise: bool, columnwise: bool, kernel: KernelChoice = None):
    """The kernel's `cupy_mxfp8.MXFP8Buffers` of `tensor` (a valid MXFP8 shape), or None to let the torch reference
    quantize."""
    if not (use_kernels(tensor, kernel) and _kernel_input(tensor)):
        return None
    cupy_mxfp8 = _kernel_module("cupy_mxfp8")
    return cupy_mxfp8.mxfp8_quantize_raw(_matrix(tensor), fp8_format, rowwise, columnwise)


def quantize_fp8_current(
    tensor: torch.Tensor,
    fp8_format: str,
    epsilon: float,
    pow2: bool,
    rowwise: bool,
    columnwise: bool,
    kernel: KernelChoice = None,
    high_precision_stats: bool = False,
    reduce_amax: Optional[Callable[[torch.Tensor], None]] = None,
):
    """The kernel's `cupy_fp8_tensor.Float8Buffers` of `tensor` under current scaling, or None for the torch
    reference; `high_precision_stats`: the amax comes from the statistics pass, which also writes the tensor's basic
    statistics row (`Float8Buffers.high_precision_stats`); `reduce_amax`: `tensor` is a tensor-parallel shard, and
    this callable makes its amax (a 1-element fp32 tensor on its device) the whole tensor's in place."""
    if not (use_kernels(tensor, kernel) and _kernel_input(tensor)):
        return None
    cupy_fp8_tensor = _kernel_module("cupy_fp8_tensor")
    return cupy_fp8_tensor.fp8_current_quantize(
        _matrix(tensor), fp8_format, epsilon, pow2, rowwise, columnwise, high_precision_stats, reduce_amax
    )


def quantize_fp8_delayed(
    tensor: torch.Tensor,
    history: torch.Tensor,
    scale: torch.Tensor,
    fp8_format: str,
    rowwise: bool,
    columnwise: bool,
    kernel: KernelChoice = None,
    high_precision_stats: bool = False,
):
    """The kernel's `cupy_fp8_tensor.Float8Buffers` of `tensor` under delayed scaling (max|x| recorded into
    history[0], the cast with `scale`; both state tensors on tensor's device), or None for the torch reference;
    `high_precision_stats` as in `quantize_fp8_current`."""
    if not (use_kernels(tensor, kernel) and _kernel_input(tensor)):
        return None
    cupy_fp8_tensor = _kernel_module("cupy_fp8_tensor")
    return cupy_fp8_tensor.fp8_delayed_quantize(
        _matrix(tensor), history, scale, fp8_format, rowwise, columnwise, high_precision_stats
    )


def quantize_fp8_block(
    tensor: torch.Tensor,
    fp8_format: str,
    block_scaling_dim: int,
    epsilon: float,
    pow2: bool,
    value_for_inf: float,
    rowwise: bool,
    columnwise: bool,
    kernel: KernelChoice = None,
):
    """The kernel's `cupy_fp8_block.Float8BlockBuffers` of `tensor` (1x128 / 128x128 blocks), or None for the torch
    reference."""
    if not (use_kernels(tensor, kernel) and _kernel_input(tensor)):
        return None
    cupy_fp8_block = _kernel_module("cupy_fp8_block")
    return cupy_fp8_block.fp8_block_quantize_raw(
        _matrix(tensor),
        fp8_format,
        block_scaling_dim,
        epsilon=epsilon,
        pow2=pow2,
        value_for_inf=value_for_inf,
        rowwise=rowwise,
        columnwise=columnwise,
    )


def quantize_nvfp4(quantizer, tensor: torch.Tensor, kernel: KernelChoice = None):
    """The kernel's `cupy_nvfp4.NVFP4Buffers` of `tensor`, or None for the torch reference (also for calls the kernel
    does not take: shapes NVFP4 rejects, which the reference then reports).  `quantizer` supplies the options and
    the Philox offsets of stochastic rounding (`cupy_nvfp4.nvfp4_quantize`)."""
    if not (use_kernels(tensor, kernel) and _kernel_input(tensor)):
        return None
    cupy_nvfp4 = _kernel_module("cupy_nvfp4")
    if not cupy_nvfp4.supports(quantizer, tensor):
        return None
    return cupy_nvfp4.nvfp4_quantize(quantizer, tensor)


def philox_bytes(
    seed: int, offset: int, n: int, device: torch.device, kernel: KernelChoice = None
) -> Optional[torch.Tensor]:
    """Philox random bytes on a CUDA `device` from the kernel, or None for the torch reference
    (`tedebug.quantization.philox`): unless `kernel` (or the default) is "torch", whenever CuPy imports."""
    if n <= 0 or device.type != "cuda" or _name_of(kernel) == "torch" or not _cupy_importable():
        return None
    cupy_philox = _kernel_module("cupy_philox")
    return cupy_philox.philox_bytes(seed, offset, n, device)


def gemm_kernels(tensor: torch.Tensor, kernel: KernelChoice = None) -> Optional[ModuleType]:
    """`tedebug.backends.cupy_dequant` when the kernels take `tensor`'s operands (a CUDA tensor under `kernel` or
    the default), else None for the torch path of `tedebug.quantization.gemm_values`."""
    if not use_kernels(tensor, kernel):
        return None
    cupy_dequant = _kernel_module("cupy_dequant")
    return cupy_dequant


def fp8_delayed_update(
    history: torch.Tensor, scale: torch.Tensor, amax_compute_algo, scaled_max: float, kernel: KernelChoice = None
) -> bool:
    """Run a delayed-scaling update (`Float8Quantizer.update_scale`) as one kernel when it applies (CUDA state under
    the current backend choice, "max" / "most_recent", contiguous fp32 history of at most 2048 entries); False for
    the torch path."""
    if amax_compute_algo not in ("max", "most_recent") or not use_kernels(history, kernel):
        return False
    cupy_fp8_tensor = _kernel_module("cupy_fp8_tensor")
    if (
        history.numel() > cupy_fp8_tensor.DELAYED_UPDATE_MAX_LEN
        or not history.is_contiguous()
        or scale.device != history.device
        or scale.numel() != 1
        or not scale.is_contiguous()
    ):
        return False
    cupy_fp8_tensor.fp8_delayed_update(history, scale, scaled_max, amax_compute_algo == "most_recent")
    return True
