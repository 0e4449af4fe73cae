"""Base classes of the quantization core: `Quantizer` and `QuantizedTensor`.

A `Quantizer` turns a high-precision tensor into a `QuantizedTensor` holding a *rowwise* representation (what a
GEMM that reduces over the last dimension consumes) and/or a *columnwise* representation (what a GEMM reducing over
the first dimension consumes), each with its own scale-inverse data.  Which directions are produced is controlled by
the quantizer's usage flags (`set_usage`).  Concrete formats live in their own modules (float8, mxfp8, nvfp4,
float8_block, identity, hybrid).

A `QuantizedTensor` is a plain Python object (not a `torch.Tensor` subclass): the autograd functions of `tedebug.nn`
handle it explicitly.  It always remembers the logical high-precision `shape`, `dtype` and `device`.
"""

from __future__ import annotations

import abc
from typing import Iterable, List, Optional, Tuple, TypeVar

import torch

from tedebug.backends.dispatch import KernelChoice, KernelPreference, kernel_preference

USAGES = ("rowwise", "columnwise")
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPU = torch.device("cpu")


class UnsupportedShapeError(ValueError):
    """A tensor shape a block-scaled format cannot quantize (MXFP8's 32-element blocks, NVFP4's 16-element ones).
    A ValueError, which these checks raised before the class existed; `tedebug.nn`'s layers raise it again with
    the layer's name and what to do about it, since a model-wide recipe meets such shapes in layers the user did
    not write (a LoRA adapter of rank 8, a small router)."""


def check_high_precision_input(tensor: torch.Tensor, who: str) -> None:
    """Raise unless `tensor` is a float32 / bfloat16 / float16 tensor with at least one dim.

    TypeError for a wrong dtype, ValueError for a 0-d tensor; `who` names the caller in the message.
    """
    if tensor.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{who}: expected a float32/bfloat16/float16 tensor, got dtype {tensor.dtype}")
    if tensor.dim() == 0:
        raise ValueError(f"{who}: expected a tensor with at least 1 dim, got a 0-d tensor")


def matrix_shape(shape: Iterable[int]) -> Tuple[int, int]:
    """The 2-D view `(M, K)` of a logical shape: M = product of the leading dims (1 for a 1-D shape), K = last."""
    if type(shape) is not torch.Size:
        shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("a quantized tensor needs at least 1 dim, got shape ()")
    if len(shape) == 2:
        return shape[0], shape[1]
    m = 1
    for s in shape[:-1]:
        m *= s
    return m, shape[-1]


_Q = TypeVar("_Q", bound="Quantizer")


class Quantizer(abc.ABC):
    """Base of every quantizer.

    Subclasses implement `_quantize(tensor)` (honouring `rowwise_usage` / `columnwise_usage`), `make_empty` and
    `recipe_name` (the statistic-prefix name of the format, e.g. ``"mxfp8"``; ``""`` when there is none).
    """

    #: name used by the statistics grammar (``fp8_delayed_scaling``, ``fp8_current_scaling``, ``mxfp8``,
    #: ``fp8_block_scaling``, ``nvfp4``); empty for formats without one (identity, hybrid).
    recipe_name: str = ""
    #: which implementation quantizes (`KernelPreference`: auto, torch or the CuPy kernels); None follows the
    #: default (`tedebug.backends.dispatch.use_backend`, else ``TEDEBUG_BACKEND``, else auto)
    kernel: Optional[KernelPreference] = None
    #: whether the quantize kernels also compute the quantization-error statistics (underflows, squared error)
    #: that the statistics features read (`tedebug.backends.fused_stats`).  Only costly ones honour False (NVFP4's
    #: random-Hadamard columnwise kernel skips its inverse rotation); a layer's quantizers are False outside the
    #: debug path, and `DebugQuantizer` sets True for the quantizations it inspects.
    error_stats: bool = True
    #: whether the quantizer's amax pass also computes the input's basic statistics (min, max, sums, ...) for the
    #: statistics feed of that input (`tedebug.backends.fused_stats.attach_high_precision`), so that a tensor logged
    #: and quantized is read once for both.  Honoured on the kernel path by per-tensor FP8 (current and delayed
    #: scaling) and by NVFP4 without RHT on the columnwise direction; others ignore it.  `DebugQuantizer` sets it
    #: for the quantizations whose inspection feeds basic statistics.
    high_precision_stats: bool = False

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True, kernel: KernelChoice = None) -> None:
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.kernel = kernel_preference(kernel, f"{type(self).__name__}(kernel=...)")
        # TE compatibility knobs; tedebug always returns full QuantizedTensor objects.
        self.internal = False
        self.optimize_for_gemm = False

    # ---------------------------------------------------------------- usage
    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Choose which representations `quantize` produces (None leaves a flag unchanged)."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    # ---------------------------------------------------------------- quantize
    def quantize(self, tensor: torch.Tensor, *, out: Optional["QuantizedTensor"] = None) -> "QuantizedTensor":
        """Quantize `tensor`; with `out`, refresh `out` in place and return it."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.quantize expects a torch.Tensor, got {type(tensor).__name__}")
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: both rowwise and columnwise usage are off; nothing to produce")
        if out is not None:
            return self.update_quantized(tensor, out)
        return self._quantize(tensor)

    def __call__(self, tensor: torch.Tensor) -> "QuantizedTensor":
        return self.quantize(tensor)

    @abc.abstractmethod
    def _quantize(self, tensor: torch.Tensor) -> "QuantizedTensor":
        """Produce a new QuantizedTensor with the directions selected by the usage flags."""

    def update_quantized(self, src: torch.Tensor, dst: "QuantizedTensor") -> "QuantizedTensor":
        """Re-quantize `src` into `dst` in place (the directions `dst` holds).  Returns `dst`."""
        fresh = self._quantize_like(src, dst)
        dst._copy_from(fresh)
        return dst

    def _quantize_like(self, src: torch.Tensor, dst: "QuantizedTensor") -> "QuantizedTensor":
        saved = (self.rowwise_usage, self.columnwise_usage)
        try:
            self.set_usage(rowwise=dst.has_rowwise, columnwise=dst.has_columnwise)
            return self._quantize(src)
        finally:
            self.rowwise_usage, self.columnwise_usage = saved

    @abc.abstractmethod
    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None) -> "QuantizedTensor":
        """Allocate an uninitialised QuantizedTensor of logical `shape` for the enabled directions."""

    def copy(self: _Q) -> _Q:
        """A shallow copy with its own usage flags (state tensors are shared)."""
        import copy as _copy

        return _copy.copy(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage})"


class QuantizedTensor(abc.ABC):
    """A tensor stored in a low-precision format, in up to two directions.

    Subclasses keep their raw data in attributes of their own (e.g. ``rowwise_data``, ``rowwise_scale_inv``,
    ``columnwise_data``, ``columnwise_scale_inv``) and implement the abstract methods below.
    """

    def __init__(self, shape, dtype: torch.dtype, device, quantizer: Optional[Quantizer]) -> None:
        # (the quantizers pass a tensor's own torch.Size and torch.device: kept as they are)
        self._shape = shape if type(shape) is torch.Size else torch.Size(shape)
        if type(device) is not torch.device:
            device = torch.device(device) if device is not None else _CPU
        self._device = device
        self._dtype = dtype
        self.quantizer = quantizer

    # ---------------------------------------------------------------- metadata
    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, *dim: int):
        return self._shape if not dim else self._shape[dim[0]]

    def dim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        n = 1
        for s in self._shape:
            n *= s
        return n

    @property
    def dtype(self) -> torch.dtype:
        """The nominal high-precision dtype (what `dequantize()` returns by default)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    # Formats store each representation's codes in ``rowwise_data`` / ``columnwise_data`` (None when absent);
    # a format that stores them otherwise (hybrid) overrides these two properties.
    @property
    def has_rowwise(self) -> bool:
        """True when the rowwise representation is present."""
        return getattr(self, "rowwise_data", None) is not None

    @property
    def has_columnwise(self) -> bool:
        """True when the columnwise representation is present."""
        return getattr(self, "columnwise_data", None) is not None

    # ---------------------------------------------------------------- values
    def dequantize(self, *, dtype: Optional[torch.dtype] = None, usage: Optional[str] = None) -> torch.Tensor:
        """High-precision values in the logical shape.

        `usage` picks the representation (``"rowwise"`` / ``"columnwise"``); by default rowwise is used when
        present, else columnwise.  Asking for an absent representation raises `RuntimeError`.
        """
        if usage is None:
            usage = "rowwise" if self.has_rowwise else "columnwise"
        self._require(usage)
        return self._dequantize(usage).to(dtype or self._dtype)

    @abc.abstractmethod
    def _dequantize(self, usage: str) -> torch.Tensor:
        """fp32 values of the logical shape from the given representation."""

    def _require(self, usage: str) -> str:
        """Validate a usage name and check that representation is present (ValueError / RuntimeError)."""
        if usage not in USAGES:
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        present = self.has_rowwise if usage == "rowwise" else self.has_columnwise
        if not present:
            raise RuntimeError(f"{type(self).__name__}: the {usage} representation is not available")
        return usage

    def gemm_values(self, usage: str):
        """The `usage` representation as an exact bf16 matrix and a factor (`gemm_values.GemmValues`), or None
        when the format has no such form (then an emulated GEMM dequantizes to fp32).  Formats override this."""
        self._require(usage)
        return None

    # ---------------------------------------------------------------- statistics helpers
    @abc.abstractmethod
    def nonzero_code_count(self, usage: str) -> torch.Tensor:
        """0-d int64 tensor: how many elements of the `usage` representation have a stored code other than +-0."""

    @abc.abstractmethod
    def scale_inv_values(self, usage: str) -> torch.Tensor:
        """1-D fp32 tensor: every stored decode scale of the `usage` representation as a real value, no padding."""

    def code_domain(self, x: torch.Tensor, usage: str) -> torch.Tensor:
        """The high-precision values whose codes the `usage` representation stores, as many as it has codes.

        That is `x` itself for every format except a representation stored after a transform of the input (NVFP4
        columnwise with the random Hadamard transform), whose codes encode the transformed values.  Statistics that
        compare codes with inputs element for element (underflows) use this.
        """
        return x

    # ---------------------------------------------------------------- usage
    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Drop (False) or require (True) a representation.

        Requiring a missing one calls `_create(usage)`, which formats that can derive it (per-tensor FP8 transposes
        its bytes) override; the default raises `RuntimeError`.
        """
        if rowwise_usage is False and columnwise_usage is False:
            raise ValueError("update_usage would drop both representations")
        if rowwise_usage and not self.has_rowwise:
            self._create("rowwise")
        if columnwise_usage and not self.has_columnwise:
            self._create("columnwise")
        if rowwise_usage is False:
            self._drop("rowwise")
        if columnwise_usage is False:
            self._drop("columnwise")

    def _create(self, usage: str) -> None:
        raise RuntimeError(
            f"{type(self).__name__}: cannot create the {usage} representation from the other one; "
            f"quantize again with {usage} usage enabled"
        )

    @abc.abstractmethod
    def _drop(self, usage: str) -> None:
        """Forget the data of one representation."""

    # ---------------------------------------------------------------- autograd saving
    @abc.abstractmethod
    def _tensor_fields(self) -> Tuple[str, ...]:
        """Names of the attributes holding torch tensors (None allowed), in a fixed order."""

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "QuantizedTensor"]:
        """Hand the raw tensors to autograd's `save_for_backward` and clear them here."""
        fields = self._tensor_fields()
        tensors = [getattr(self, f) for f in fields]
        for f in fields:
            setattr(self, f, None)
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Inverse of `prepare_for_saving`; returns the tensors it did not consume."""
        fields = self._tensor_fields()
        for f, t in zip(fields, tensors):
            setattr(self, f, t)
        return list(tensors[len(fields) :])

    def _copy_from(self, other: "QuantizedTensor") -> None:
        """In-place refresh used by `Quantizer.update_quantized` (both must have the same logical shape)."""
        if other.shape != self._shape:
            raise ValueError(
                f"{type(self).__name__}: cannot refresh a tensor of shape {tuple(self._shape)} "
                f"from one of shape {tuple(other.shape)}"
            )
        for f in self._tensor_fields():
            src = getattr(other, f)
            dst = getattr(self, f)
            if dst is not None and src is not None and dst.shape == src.shape:
                dst.copy_(src)
            else:
                setattr(self, f, src)

    def detach(self) -> "QuantizedTensor":
        return self

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={tuple(self._shape)}, dtype={self._dtype}, device={self._device}, "
            f"rowwise={'present' if self.has_rowwise else None}, "
            f"columnwise={'present' if self.has_columnwise else None})"
        )
