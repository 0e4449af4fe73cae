"""Per-tensor FP8: `Float8CurrentScalingQuantizer` / `Float8Quantizer` (delayed scaling) -> `Float8Tensor`.

One fp32 scale for the whole tensor.  Elements are `RNE-satfinite-FP8(fp32(x) · scale)` and decode as
`code_value · scale_inv` with `scale_inv = fp32(1 / scale)`.

- Current scaling: amax = max|x| of the tensor being quantized, scale = `compute_scale_from_amax` (epsilon,
  optional power-of-two rounding, FLT_MAX for an infinite quotient, 1 for amax 0 / Inf).
- Delayed scaling: the quantizer owns `scale` (0-d or 1-element fp32) and `amax_history` ([L] or [L, 1] fp32);
  quantizing uses the current `scale` and records max|x| into `amax_history[0]`; `update_scale()` rolls the history
  and derives the next scale.  State tensors are updated in place, so `copy()`s share them.

The amax ignores NaN elements (TE reduces with `fmaxf`); NaN elements are stored as the FP8 NaN code.

Storage of `Float8Tensor`: `rowwise_data` uint8 codes in the logical shape `[..., K]`; `columnwise_data` uint8 = the
same codes of the 2-D view `[M, K]` (M = product of the leading dims) transposed to `[K, M]` (TE's `_transpose`);
`scale_inv` 0-d fp32 shared by both.  Since the scale is shared, either direction can be derived from the other.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch

from tedebug.host_numpy import PerThreadTable, compiling, host_view

from tedebug.backends import dispatch
from tedebug.backends.dispatch import KernelChoice
from tedebug.backends.host_kernels import HostFp8, host_fp8
from tedebug.backends.fused_stats import (
    FP8_STATS,
    FP8_STATS_WITH_SCALE,
    FusedStats,
    attach_fused,
    attach_high_precision,
)

from .formats import (
    FLT_MAX,
    FP8_MAX,
    TORCH_FP8_DTYPE,
    _scale_of,
    compute_scale_from_amax,
    decode_fp8,
    encode_fp8,
    fp8_decode_table,
    fp8_format_of,
    fp8_is_zero,
    host_amax_and_nan,
    tensor_amax,
)
from .gemm_values import GemmValues, fp8_codes_to_bf16
from .tensor import QuantizedTensor, Quantizer, check_high_precision_input, matrix_shape

AMAX_ALGOS = ("max", "most_recent")


# ------------------------------------------------------------------------------------------------ tensor
class Float8Tensor(QuantizedTensor):
    """Per-tensor scaled FP8 data (E4M3 or E5M2) with an optional transposed copy for columnwise use."""

    #: the numpy views of the buffers the CPU host cast made (`_host_cast`): (rowwise_data, its array,
    #: columnwise_data, its array, scale_inv, its 0-d array); an array stands for its field while the field still
    #: holds that very tensor (an in-place refresh writes through the shared memory; a new tensor is not its array)
    _host_arrays: Optional[tuple] = None
    #: (scale_inv as a Python float, the 256 code values times it): `_scaled_table`'s last table
    _table: Optional[Tuple[float, np.ndarray]] = None

    def __init__(
        self,
        shape: Iterable[int],
        dtype: torch.dtype,
        device,
        quantizer: Optional[Quantizer],
        *,
        fp8_format: str,
        scale_inv: torch.Tensor,
        rowwise_data: Optional[torch.Tensor] = None,
        columnwise_data: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__(shape, dtype, device, quantizer)
        self.fp8_format = fp8_format_of(fp8_format)
        self._mk = matrix_shape(self._shape)
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        self.scale_inv = scale_inv
        self._check_layout()

    @classmethod
    def _assemble(
        cls,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        quantizer: Optional[Quantizer],
        fp8_format: str,
        mk: Tuple[int, int],
        scale_inv: torch.Tensor,
        rowwise_data: Optional[torch.Tensor],
        columnwise_data: Optional[torch.Tensor],
    ) -> "Float8Tensor":
        """The tensor the quantizers of this module build: their codes have the layout `_check_layout` asks for by
        construction (rowwise in the input's shape, columnwise its [K, M] transpose, one scale_inv) and the
        format is already a checked name, so nothing is checked again (a quantization per GEMM operand and step)."""
        self = cls.__new__(cls)
        QuantizedTensor.__init__(self, shape, dtype, device, quantizer)
        self.fp8_format = fp8_format
        self._mk = mk
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        self.scale_inv = scale_inv
        return self

    def _check_layout(self) -> None:
        m, k = self._mk
        name = type(self).__name__
        for field, want in (("rowwise_data", tuple(self._shape)), ("columnwise_data", (k, m))):
            data = getattr(self, field)
            if data is not None and (data.dtype != torch.uint8 or tuple(data.shape) != want):
                raise ValueError(
                    f"{name}.{field}: expected uint8 of shape {want}, got {data.dtype} of shape {tuple(data.shape)}"
                )
        if self.scale_inv is not None and self.scale_inv.numel() != 1:
            raise ValueError(f"{name}.scale_inv: expected one element, got shape {tuple(self.scale_inv.shape)}")

    def _codes_2d(self, usage: str) -> torch.Tensor:
        """The codes of the 2-D view `[M, K]`, from either representation."""
        m, k = self._mk
        if usage == "rowwise":
            return self.rowwise_data.reshape(m, k)  # type: ignore[union-attr]  # callers checked it exists
        return self.columnwise_data.t()  # type: ignore[union-attr]  # callers checked it exists

    def _dequantize(self, usage: str) -> torch.Tensor:
        data = self.rowwise_data if usage == "rowwise" else self.columnwise_data
        if data is None:  # `dequantize` checks that the representation exists before it calls this
            raise RuntimeError(f"{type(self).__name__}: the {usage} representation is not available")
        if data.is_cpu and data.is_contiguous() and self.scale_inv.is_cpu and not compiling():
            return self._dequantize_on_host(usage, data)
        values = decode_fp8(self._codes_2d(usage), self.fp8_format) * self.scale_inv.float().reshape(())
        return values.reshape(self._shape)

    def _dequantize_on_host(self, usage: str, data: torch.Tensor) -> torch.Tensor:
        """`_dequantize` of CPU codes by numpy: one table look-up (the fp32 values `decode_fp8` gives) and the
        IEEE fp32 products with scale_inv, in the same layout as the torch expression (the columnwise values are
        the transposed view of a contiguous [K, M] array, as ``columnwise_data.t()`` decodes)."""
        result = torch.from_numpy(_host_decode(self.fp8_format, data, self.scale_inv))
        if usage == "columnwise":
            result = result.t()
            if self._mk[1] == 1:  # [M, 1]: the strides the torch expression's reshapes give the size-1 dim
                result = result.reshape(-1)
        return result.reshape(self._shape)

    def fp32_matrix(self, usage: str) -> torch.Tensor:
        """The fp32 values of the 2-D view `[M, K]` from the `usage` representation: ``dequantize(usage=usage,
        dtype=torch.float32)`` flattened to 2-D, the same values with the same strides (the emulated GEMM's operand).

        CPU codes of a 2-D tensor are decoded by one table look-up and one product with scale_inv, the columnwise
        values as the transposed view of the decoded `[K, M]` array; anything else goes through `dequantize`."""
        rowwise = usage == "rowwise"
        data = self.rowwise_data if rowwise else self.columnwise_data
        host = self._host_arrays
        if host is not None and data is not None and len(self._shape) == 2 and not compiling():
            # the host cast's own buffers, still in place: their numpy views, without asking the tensors again
            if data is host[0 if rowwise else 2] and self.scale_inv is host[4]:
                decoded = _decode_array(self.fp8_format, host[1 if rowwise else 3], host[5][()])
                return _as_matrix(torch.from_numpy(decoded), rowwise, self._mk)
        if (
            data is not None
            and len(self._shape) == 2
            and data.is_cpu
            and self.scale_inv.is_cpu
            and data.is_contiguous()
            and not compiling()
        ):
            result = torch.from_numpy(_host_decode(self.fp8_format, data, self.scale_inv))
            return _as_matrix(result, rowwise, self._mk)
        values = self.dequantize(dtype=torch.float32, usage=usage)
        return values.reshape(1, -1) if values.dim() == 1 else values.reshape(-1, values.shape[-1])

    def host_decoded(self, usage: str, out: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """The fp32 values of the `usage` codes of a 2-D tensor in the layout they are stored in (rowwise `[M, K]`,
        columnwise `[K, M]`), as a new numpy array (or written into `out`, a C-contiguous fp32 array of that
        shape, and returned): the values ``dequantize(usage=usage)`` gives, decoded by one
        look-up in the 256 code values times scale_inv (`_scaled_table`; each entry is the IEEE fp32 product that
        the element-wise decode computes, so the values are the same bits).  None, for the caller to take
        `fp32_matrix`, when the codes are absent, not on the CPU or not contiguous, when M or K is 1 (whose
        strides the reshapes of `dequantize` choose) or while torch.compile traces.

        The CPU emulated GEMM's operands: op_A is this array of A transposed, op_B the one of B, for every layout
        (`tedebug.nn.gemm`), with the values and strides of the dequantize-and-flatten expression."""
        rowwise = usage == "rowwise"
        data = self.rowwise_data if rowwise else self.columnwise_data
        m, k = self._mk
        if data is None or m == 1 or k == 1 or len(self._shape) != 2 or compiling():
            return None
        host = self._host_arrays
        if host is not None and data is host[0 if rowwise else 2] and self.scale_inv is host[4]:
            codes, factor = host[1 if rowwise else 3], host[5][()]  # the host cast's own buffers, still in place
        elif data.is_cpu and self.scale_inv.is_cpu and data.is_contiguous():  # (other strides: `dequantize`'s own)
            codes, factor = data.numpy(), np.float32(self.scale_inv.item())
        else:
            return None
        return self._scaled_table(factor).take(codes, mode="wrap", out=out)  # (uint8 codes: see `_decode_array`)

    def _scaled_table(self, factor: np.float32) -> np.ndarray:
        """The 256 fp32 values of the codes of this format times the decode scale `factor`, made once per value of
        scale_inv (a tensor's two directions share it; a zero or NaN factor, whose key cannot tell its sign or
        itself, is never reused)."""
        cached = self._table
        key = float(factor)
        if cached is not None and cached[0] == key and key != 0.0:
            return cached[1]
        table = _table_times(self.fp8_format, factor)
        self._table = (key, table)
        return table

    def gemm_values(self, usage: str) -> GemmValues:
        """The codes as bf16 (exact) with the 0-d fp32 scale_inv as the factor: see `gemm_values`."""
        self._require(usage)
        return GemmValues(fp8_codes_to_bf16(self._codes_2d(usage), self.fp8_format), self.scale_inv.float().reshape(()))

    def _create(self, usage: str) -> None:
        m, k = self._mk
        if usage == "columnwise" and self.rowwise_data is not None:
            self.columnwise_data = self.rowwise_data.reshape(m, k).t().contiguous()
        elif usage == "rowwise" and self.columnwise_data is not None:
            self.rowwise_data = self.columnwise_data.t().contiguous().reshape(self._shape)
        else:
            super()._create(usage)

    def _drop(self, usage: str) -> None:
        setattr(self, f"{usage}_data", None)
        self._host_arrays = None  # (the arrays would keep the dropped buffer alive)

    def prepare_for_saving(self) -> Tuple[List[Optional[torch.Tensor]], "QuantizedTensor"]:
        # autograd holds the buffers from here on, and its saved-tensor hooks may replace (offload) them: the
        # host arrays must not keep them alive
        self._host_arrays = None
        return super().prepare_for_saving()

    def _tensor_fields(self) -> Tuple[str, ...]:
        return ("rowwise_data", "columnwise_data", "scale_inv")

    def nonzero_code_count(self, usage: str) -> torch.Tensor:
        data = getattr(self, f"{self._require(usage)}_data")
        return (~fp8_is_zero(data)).sum(dtype=torch.int64)

    def scale_inv_values(self, usage: str) -> torch.Tensor:
        self._require(usage)
        return self.scale_inv.float().reshape(1)


def _table_times(fmt: str, factor: np.float32) -> np.ndarray:
    """The 256 fp32 values of the FP8 codes of `fmt` times `factor` (IEEE fp32 products, a new array): what
    `_decode_array` gives the codes 0..255, with one product and no look-up."""
    if math.isfinite(factor) and factor != 0.0:
        return np.multiply(fp8_decode_table(fmt), factor)
    # 0 · Inf makes NaN: of a zero code with an infinite factor, of E5M2's infinite codes with a zero one (a delayed
    # scale of Inf), as torch's product does, without numpy's warning in the user's run
    with np.errstate(invalid="ignore"):
        return np.multiply(fp8_decode_table(fmt), factor)


def _host_decode(fmt: str, data: torch.Tensor, scale_inv: torch.Tensor) -> np.ndarray:
    """The fp32 values of contiguous CPU codes: `_decode_array` of their numpy view."""
    return _decode_array(fmt, data.numpy(), np.float32(scale_inv.item()))


def _decode_array(fmt: str, codes: np.ndarray, factor: np.float32) -> np.ndarray:
    """The fp32 values of FP8 `codes` (numpy): one table look-up (the values `decode_fp8` gives) and the IEEE fp32
    products with the decode scale `factor`, in the codes' layout (an infinite factor makes NaN of a zero code
    silently, as torch's product does)."""
    # uint8 codes index the 256-entry table in range, so "wrap" changes nothing and skips numpy's per-index bounds
    # check (faster than "clip" too: callgrind counts 12 % fewer instructions on 4096 codes); other index arrays
    # keep the check (an out-of-range code raises)
    values = fp8_decode_table(fmt).take(codes, mode="wrap" if codes.dtype == np.uint8 else "raise")
    if math.isfinite(factor):
        np.multiply(values, factor, out=values)
    else:
        with np.errstate(invalid="ignore"):
            np.multiply(values, factor, out=values)
    return values


def _as_matrix(values: torch.Tensor, rowwise: bool, mk: Tuple[int, int]) -> torch.Tensor:
    """The decoded values of a 2-D tensor's codes as `fp32_matrix` returns them: rowwise as they are, columnwise
    (decoded `[K, M]`) as the transposed view, with the strides `dequantize`'s reshapes give a size-1 dim."""
    if rowwise:
        return values
    m, k = mk
    if k == 1:  # as `_dequantize_on_host` gives an [M, 1] tensor
        return values.t().reshape(-1).reshape(m, k)
    if m == 1:
        return values.t().reshape(m, k).reshape(-1, k)
    return values.t()


# ------------------------------------------------------------------------------------------------ quantizers
def _cast_per_tensor(quantizer: Quantizer, tensor: torch.Tensor, scale: torch.Tensor, fp8_format: str) -> Float8Tensor:
    """Encode `tensor` with one fp32 `scale` into the directions enabled on `quantizer`."""
    scale = scale.float().reshape(()).to(tensor.device)
    mk = matrix_shape(tensor.shape)
    codes = encode_fp8(tensor.float() * scale, fp8_format)
    columnwise = codes.reshape(mk).t().contiguous() if quantizer.columnwise_usage else None
    return Float8Tensor._assemble(
        tensor.shape,
        tensor.dtype,
        tensor.device,
        quantizer,
        fp8_format_of(fp8_format),
        mk,
        torch.ones_like(scale) / scale,
        codes if quantizer.rowwise_usage else None,
        columnwise,
    )


def _from_kernel_buffers(
    quantizer: "Float8Quantizer | Float8CurrentScalingQuantizer", tensor: torch.Tensor, buffers
) -> Float8Tensor:
    """The Float8Tensor of the kernel path's `cupy_fp8_tensor.Float8Buffers`, carrying the statistics the kernel
    fused into the cast (one vector shared by both directions)."""
    row = buffers.rowwise_data
    shape = tensor.shape
    if row is not None and len(shape) != 2:
        row = row.reshape(shape)  # the kernel writes [M, K]
    out = Float8Tensor._assemble(
        shape,
        tensor.dtype,
        tensor.device,
        quantizer,
        quantizer.fp8_format,
        matrix_shape(shape),
        buffers.scale_inv,
        row,
        buffers.columnwise_data,
    )
    if buffers.high_precision_stats is not None:
        attach_high_precision(tensor, buffers.high_precision_stats)
    index = FP8_STATS_WITH_SCALE if buffers.stats.numel() == len(FP8_STATS_WITH_SCALE) else FP8_STATS
    per = FusedStats(buffers.stats, index)
    attach_fused(
        out,
        tensor,
        {u: per for u, on in (("rowwise", quantizer.rowwise_usage), ("columnwise", quantizer.columnwise_usage)) if on},
    )
    return out


def _empty_per_tensor(quantizer: Quantizer, shape, dtype, device, fp8_format: str) -> Float8Tensor:
    shape = torch.Size(int(s) for s in shape)
    m, k = matrix_shape(shape)
    device = torch.device(device) if device is not None else torch.device("cpu")
    return Float8Tensor(
        shape,
        dtype,
        device,
        quantizer,
        fp8_format=fp8_format,
        scale_inv=torch.ones((), dtype=torch.float32, device=device),
        rowwise_data=torch.empty(shape, dtype=torch.uint8, device=device) if quantizer.rowwise_usage else None,
        columnwise_data=torch.empty((k, m), dtype=torch.uint8, device=device) if quantizer.columnwise_usage else None,
    )


# ------------------------------------------------------------------------------------------------ CPU host path
def _fp32_source(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous fp32 CPU tensor of a contiguous CPU tensor's values, read without autograd: the tensor itself
    when it is fp32 (its memory is read through a pointer, never written), else its exact fp32 copy."""
    return tensor if tensor.dtype is torch.float32 else tensor.detach().float()


def _host_fp32(tensor: torch.Tensor) -> np.ndarray:
    """The fp32 values of a contiguous CPU tensor as a numpy array of its shape, read without autograd (a view of
    an fp32 tensor; the exact fp32 copy of a bfloat16 / float16 one)."""
    if tensor.dtype is not torch.float32:
        return tensor.detach().float().numpy()
    return host_view(tensor)  # (detached in one call; a CPU tensor's own memory, no copy)


#: the arrays of `_scaled_workspace`, per thread and shape: at most 32 shapes, the largest 65536 elements (a table
#: holds at most 32 x 256 KiB)
_WORKSPACES = PerThreadTable(32, max_numel=65536)


def _scaled_workspace(shape: torch.Size) -> Tuple[np.ndarray, torch.Tensor, Tuple[int, int]]:
    """The fp32 array of `shape` that receives |x| for the amax and then x·scale before the cast (its contents
    never leave the quantization: the cast copies them), the tensor sharing its memory, and the 2-D view's
    (M, K): made once per shape and thread, so a cast allocates and wraps no temporary."""
    entry = _WORKSPACES.get(shape)
    if entry is None:
        array = np.empty(tuple(shape), dtype=np.float32)
        entry = _WORKSPACES.keep(shape, (array, torch.from_numpy(array), matrix_shape(shape)), array.size)
    return entry


#: for each FP8 format, the fp32 magnitude from which torch's round-to-nearest-even cast no longer gives the
#: largest finite code: fp8_max plus half the spacing of the two largest codes (448 + (448 - 416) / 2 = 464 for E4M3,
#: 57344 + (57344 - 49152) / 2 = 61440 for E5M2, where the tie already goes up to Inf; older torch versions make NaN
#: of E4M3 values above 464).  Below it, the cast gives what saturating to fp8_max first gives.
_ROUNDS_TO_MAX = {"E4M3": 464.0, "E5M2": 61440.0}


def _saturates(largest: float, fmt: str) -> bool:
    """Whether a host cast whose largest product is `largest` (amax · scale, exact in double) must saturate
    first: not when no product rounds beyond ±fp8_max in fp32 (an amax whose scale rounded up lands just above it,
    and the cast rounds it to fp8_max, as the saturation would); below 2·fp8_max the fp32 rounding of `largest`
    cannot overflow."""
    fmax = FP8_MAX[fmt]
    return not (largest <= fmax or (largest < 2.0 * fmax and np.float32(largest) < _ROUNDS_TO_MAX[fmt]))


def _host_cast(
    quantizer: "Float8Quantizer | Float8CurrentScalingQuantizer",
    tensor: torch.Tensor,
    values: np.ndarray,
    amax: np.float32,
    has_nan: bool,
    scale: np.float32,
    workspace: Tuple[np.ndarray, torch.Tensor, Tuple[int, int]],
) -> Float8Tensor:
    """`_cast_per_tensor` of a contiguous CPU `tensor` (fp32 `values`, their NaN-ignoring `amax`, whether any is
    NaN) with the fp32 `scale`, computed by numpy where that is exact: x·scale (IEEE fp32 products), the
    saturation (skipped when the fp32 amax·scale stays below `_ROUNDS_TO_MAX`: rounding is monotone, so no product
    exceeds it, and the cast rounds whatever lies between fp8_max and it to fp8_max; the double product of two fp32
    values is exact), the NaN code, the transpose and 1/scale; only the fp32 -> FP8 rounding is torch's own cast.
    With `quantizer.error_stats` the tensor also carries the statistics vector of the cast (`_host_error_stats`).
    `workspace`: `_scaled_workspace` of the tensor's shape."""
    fmt = quantizer.fp8_format
    fmax = FP8_MAX[fmt]
    scaled, scaled_tensor, mk = workspace
    if not _saturates(float(amax) * float(scale), fmt):  # (nothing is clipped)
        np.multiply(values, scale, out=scaled)
    else:  # products may overflow to Inf (and saturate); a zero or infinite scale makes NaN of 0 · Inf
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(values, scale, out=scaled)
            np.clip(scaled, -fmax, fmax, out=scaled)  # NaN stays NaN, as with torch.clamp
        has_nan = has_nan or scale == 0.0 or not math.isfinite(scale)
    codes = scaled_tensor.to(dtype=TORCH_FP8_DTYPE[fmt]).view(torch.uint8)  # (a new tensor; dtype= parses faster)
    codes_np = codes.numpy()
    if has_nan:  # NaN elements store the canonical NaN code
        codes_np[np.isnan(scaled)] = 0x7F
    columnwise = columnwise_np = None
    if quantizer.columnwise_usage:
        columnwise_np = codes_np.reshape(mk).T.copy()  # (C order: the contiguous [K, M] transpose)
        columnwise = torch.from_numpy(columnwise_np)
    rowwise = codes if quantizer.rowwise_usage else None
    values_read = values if quantizer.error_stats else None
    return _host_result(quantizer, tensor, values_read, amax, scale, mk, rowwise, codes_np, columnwise, columnwise_np)


def _compiled_cast(
    quantizer: "Float8Quantizer | Float8CurrentScalingQuantizer",
    tensor: torch.Tensor,
    source: torch.Tensor,
    amax: float,
    scale: np.float32,
    helpers: HostFp8,
) -> Float8Tensor:
    """`_host_cast` by the compiled helpers (`tedebug.backends.host_kernels`): the product, the saturation (under
    the same condition), the rounding, the NaN code and the transposed copy in one call that writes the codes
    straight into the tensors' memory.  `source`: the contiguous fp32 tensor of `tensor`'s values (itself when it
    is fp32); `amax`: their NaN-ignoring max|x| as a Python float.  The same bytes as `_host_cast` (the compiled
    rounding matches torch's cast for every fp32 value: tests/backends/test_host_kernels.py)."""
    fmt = quantizer.fp8_format
    fmax = FP8_MAX[fmt]
    shape = tensor.shape
    mk = matrix_shape(shape)
    clip = _saturates(amax * float(scale), fmt)
    codes_np = np.empty(shape, dtype=np.uint8)  # (the rowwise codes are always written: the transpose's source)
    codes = torch.from_numpy(codes_np)
    columnwise = columnwise_np = None
    col = 0
    if quantizer.columnwise_usage:
        columnwise_np = np.empty((mk[1], mk[0]), dtype=np.uint8)
        columnwise = torch.from_numpy(columnwise_np)
        col = columnwise.data_ptr()
    helpers.cast(source.data_ptr(), mk[0], mk[1], float(scale), fmt, clip, fmax, codes.data_ptr(), col)
    values = host_view(source) if quantizer.error_stats else None  # (a weight requires grad: detached)
    rowwise = codes if quantizer.rowwise_usage else None
    return _host_result(
        quantizer, tensor, values, np.float32(amax), scale, mk, rowwise, codes_np, columnwise, columnwise_np
    )


def _host_result(
    quantizer: "Float8Quantizer | Float8CurrentScalingQuantizer",
    tensor: torch.Tensor,
    values: Optional[np.ndarray],
    amax,
    scale: np.float32,
    mk: Tuple[int, int],
    rowwise: Optional[torch.Tensor],
    codes_np: np.ndarray,
    columnwise: Optional[torch.Tensor],
    columnwise_np: Optional[np.ndarray],
) -> Float8Tensor:
    """The Float8Tensor of a host cast (`_host_cast`, `_compiled_cast`) from its codes (`codes_np`: the rowwise
    codes' array, made even when `rowwise` is None; `columnwise_np` the transpose's): scale_inv = 1/scale in fp32,
    the numpy views kept for the GEMMs' decode, and the statistics vector of the cast of `values` (the fp32 input,
    given exactly when `quantizer.error_stats` asks for the vector) with NaN-ignoring `amax`."""
    fmt = quantizer.fp8_format
    if scale != 0.0:
        inverse = np.float32(1.0) / scale
    else:  # a delayed-scaling state may hold a zero scale: 1/0 = Inf, as torch divides
        with np.errstate(divide="ignore"):
            inverse = np.float32(1.0) / scale
    inverse_np = np.array(inverse)  # (0-d float32: the scalar's own dtype)
    scale_inv = torch.from_numpy(inverse_np)
    shape = tensor.shape
    out = Float8Tensor._assemble(shape, tensor.dtype, tensor.device, quantizer, fmt, mk, scale_inv, rowwise, columnwise)
    out._host_arrays = (rowwise, codes_np, columnwise, columnwise_np, scale_inv, inverse_np)
    if values is not None:
        # the decode table of scale_inv, made here for the statistics and kept on the tensor for its GEMMs
        table = out._scaled_table(inverse)
        per = FusedStats(_host_error_stats(values, codes_np, inverse, table, fmt, amax), FP8_STATS_WITH_SCALE)
        directions = (("rowwise", quantizer.rowwise_usage), ("columnwise", quantizer.columnwise_usage))
        attach_fused(out, tensor, {usage: per for usage, on in directions if on})
    return out


def _host_error_stats(
    values: np.ndarray, codes: np.ndarray, inverse: np.float32, table: np.ndarray, fmt: str, amax
) -> torch.Tensor:
    """The float64 statistics vector (`FP8_STATS_WITH_SCALE` order) of the host cast of `values` into `codes` with
    decode scale `inverse` (`table`: the 256 code values times it, `_table_times`), for the quantized tensor to
    carry (`fused_stats.attach_fused`): the values the torch reference (`torch_ref.underflow_partials`,
    `mse_partials`, `overflow_partials`, `scale_inv_partials`) computes from the tensor and its quantization, bit for
    bit, for either direction (both hold the same codes).

    Counts and the element-wise terms are order-free, so numpy computes them: underflows = non-zero inputs − codes
    other than ±0 (a NaN counts as non-zero on both sides); the squared errors (x − dequantized)² in float64 from
    the dequantized fp32 values `_dequantize` gives (decode table, fp32 product with scale_inv); overflows = |x| >
    fp32(scale_inv · fp8_max) (none when the amax is not above it).  The one sum that depends on an order, Σ
    squared errors, is torch's sum of the contiguous float64 terms in the tensor's element order, which is how
    the reference sums them.  The scale_inv partials of one value need no reduction."""
    if math.isfinite(inverse):
        return _host_error_vector(values, codes, inverse, table, fmt, amax)
    with np.errstate(all="ignore"):  # 0 · Inf and Inf − Inf make NaN, as in the reference
        return _host_error_vector(values, codes, inverse, table, fmt, amax)


def _host_error_vector(
    values: np.ndarray, codes: np.ndarray, inverse: np.float32, table: np.ndarray, fmt: str, amax
) -> torch.Tensor:
    flat = values.reshape(-1)
    codes = codes.reshape(-1)
    kept = np.count_nonzero(codes & 0x7F)  # codes other than ±0 (0x00 / 0x80; the NaN code is non-zero)
    # the non-zero inputs: all of them when every code is non-zero and the scale is finite and non-zero (a zero
    # input then encodes to ±0; a zero or infinite scale makes NaN of 0 · Inf), else counted
    if kept == flat.size and inverse != 0.0 and inverse - inverse == 0.0:
        nonzero = kept
    else:
        nonzero = np.count_nonzero(flat)
    decoded = table.take(codes, mode="wrap")  # the dequantized values, as `_dequantize` gives them
    terms = np.subtract(flat, decoded, dtype=np.float64)  # (both converted to float64 exactly, then subtracted)
    np.multiply(terms, terms, out=terms)
    sq_err = torch.from_numpy(terms).sum().item()
    fmax = FP8_MAX[fmt]
    threshold_double = float(inverse) * fmax  # exact: the fp32 product rounds it once
    if threshold_double > FLT_MAX:
        with np.errstate(over="ignore"):
            threshold = np.float32(threshold_double)
    else:
        threshold = np.float32(threshold_double)
    overflows = 0 if amax <= threshold else np.count_nonzero(np.abs(flat) > threshold)
    s = float(inverse)
    total = s + 0.0  # a one-element float64 sum (-0 sums to +0)
    spread = s - total
    vector = np.array(
        (
            float(nonzero - kept),
            sq_err,
            float(overflows),
            1.0,
            total,
            spread * spread,
            s if s != 0.0 else math.inf,
            s,
            float(flat.size),
        )
    )
    return torch.from_numpy(vector)


class Float8CurrentScalingQuantizer(Quantizer):
    """Per-tensor current scaling: the scale comes from the amax of the tensor being quantized."""

    recipe_name = "fp8_current_scaling"
    #: None, or for a tensor-parallel shard (`tedebug.nn.parallel.TPCurrentScalingQuantizer`) the callable that makes
    #: the shard's amax (a 1-element fp32 tensor on its device) the whole tensor's in place, before the scale
    reduce_amax: Optional[Callable[[torch.Tensor], None]] = None

    def __init__(
        self,
        fp8_format: str = "E4M3",
        *,
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = False,
        rowwise: bool = True,
        columnwise: bool = True,
        kernel: KernelChoice = None,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, kernel=kernel)
        self.fp8_format = fp8_format_of(fp8_format)
        if not amax_epsilon >= 0.0:
            raise ValueError(f"Float8CurrentScalingQuantizer: amax_epsilon must be >= 0, got {amax_epsilon!r}")
        self.amax_epsilon = float(amax_epsilon)
        self.force_pow_2_scales = bool(force_pow_2_scales)

    def compute_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """0-d fp32 scale for a given amax: fp8_max / max(amax, epsilon), 1 for amax 0 / Inf / NaN, FLT_MAX for an
        infinite quotient, optionally rounded down to a power of two."""
        return compute_scale_from_amax(
            amax, FP8_MAX[self.fp8_format], epsilon=self.amax_epsilon, pow2=self.force_pow_2_scales
        )

    def _quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        check_high_precision_input(tensor, type(self).__name__)
        # GPU dispatch hook: the CuPy kernel's buffers when it applies, else the torch path below
        buffers = dispatch.quantize_fp8_current(
            tensor,
            self.fp8_format,
            self.amax_epsilon,
            self.force_pow_2_scales,
            self.rowwise_usage,
            self.columnwise_usage,
            self.kernel,
            self.high_precision_stats,
            self.reduce_amax,
        )
        if buffers is not None:
            return _from_kernel_buffers(self, tensor, buffers)
        if self.reduce_amax is not None:  # a tensor-parallel shard: the scale of the whole tensor
            amax = tensor_amax(tensor).to(torch.float32).clone()
            self.reduce_amax(amax)
            return _cast_per_tensor(self, tensor, self.compute_scale(amax), self.fp8_format)
        if tensor.is_cpu and tensor.is_contiguous() and tensor.numel() and not compiling():
            return self._quantize_on_host(tensor)
        scale = self.compute_scale(tensor_amax(tensor))
        return _cast_per_tensor(self, tensor, scale, self.fp8_format)

    def _quantize_on_host(self, tensor: torch.Tensor) -> Float8Tensor:
        """The torch path above for a contiguous, non-empty CPU tensor, computed by numpy where that is exact: the
        amax (a maximum, order-free; the same pass tells whether a NaN is present) and the scale (`_scale_of`, fp32
        arithmetic), then `_host_cast`; where the compiled helpers are built (`tedebug.backends.host_kernels`) the
        amax and `_compiled_cast` are theirs.  The same bytes and scale_inv as `_cast_per_tensor`
        (tests/test_host_cost_cpu.py compares them)."""
        helpers = host_fp8()
        if helpers is not None:  # the compiled helpers: the amax in one call, the cast in another
            source = _fp32_source(tensor)
            largest, _ = helpers.amax_and_nan(source.data_ptr(), source.numel())
            scale = _scale_of(largest, FP8_MAX[self.fp8_format], self.amax_epsilon, self.force_pow_2_scales, FLT_MAX)
            return _compiled_cast(self, tensor, source, largest, scale, helpers)
        values = _host_fp32(tensor)
        workspace = _scaled_workspace(tensor.shape)
        amax, has_nan = host_amax_and_nan(values, workspace[0])  # (|x| goes to the workspace, overwritten below)
        scale = _scale_of(float(amax), FP8_MAX[self.fp8_format], self.amax_epsilon, self.force_pow_2_scales, FLT_MAX)
        return _host_cast(self, tensor, values, amax, has_nan, scale, workspace)

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None) -> Float8Tensor:
        return _empty_per_tensor(self, shape, dtype, device, self.fp8_format)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fp8_format={self.fp8_format}, amax_epsilon={self.amax_epsilon}, "
            f"force_pow_2_scales={self.force_pow_2_scales}, rowwise={self.rowwise_usage}, "
            f"columnwise={self.columnwise_usage})"
        )


AmaxAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]


class Float8Quantizer(Quantizer):
    """Per-tensor delayed scaling: quantize with the stored `scale`, record amaxes, `update_scale()` between steps.

    `amax_compute_algo` is ``"max"`` (max over the whole history, current amax included), ``"most_recent"``
    (history row 0), or a callable receiving the 1-D fp32 history *before* the roll and returning the amax.
    """

    recipe_name = "fp8_delayed_scaling"

    def __init__(
        self,
        scale: torch.Tensor,
        amax_history: torch.Tensor,
        fp8_format: str,
        *,
        margin: float = 0,
        amax_compute_algo: AmaxAlgo = "max",
        rowwise: bool = True,
        columnwise: bool = True,
        kernel: KernelChoice = None,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, kernel=kernel)
        self.fp8_format = fp8_format_of(fp8_format)
        self.scale = _check_state(scale, "scale", lambda t: t.numel() == 1, "one element")
        self.amax_history = _check_state(
            amax_history,
            "amax_history",
            lambda t: t.numel() >= 1 and (t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1)),
            "shape [L] or [L, 1] with L >= 1",
        )
        if not (isinstance(margin, (int, float)) and margin >= 0):
            raise ValueError(f"Float8Quantizer: margin must be a number >= 0, got {margin!r}")
        self.margin = margin
        if not (callable(amax_compute_algo) or amax_compute_algo in AMAX_ALGOS):
            raise ValueError(
                f"Float8Quantizer: amax_compute_algo must be one of {AMAX_ALGOS} or a callable, "
                f"got {amax_compute_algo!r}"
            )
        self.amax_compute_algo = amax_compute_algo

    @classmethod
    def from_recipe_defaults(
        cls,
        fp8_format: str,
        history_len: int = 1024,
        *,
        margin: float = 0,
        amax_compute_algo: AmaxAlgo = "max",
        device=None,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> "Float8Quantizer":
        """A delayed-scaling quantizer with fresh state: scale 1 and a zero history of `history_len` entries."""
        if int(history_len) < 1:
            raise ValueError(f"Float8Quantizer.from_recipe_defaults: history_len must be >= 1, got {history_len}")
        return cls(
            torch.ones((), dtype=torch.float32, device=device),
            torch.zeros(int(history_len), dtype=torch.float32, device=device),
            fp8_format,
            margin=margin,
            amax_compute_algo=amax_compute_algo,
            rowwise=rowwise,
            columnwise=columnwise,
        )

    @property
    def _history(self) -> torch.Tensor:
        """1-D view of the history (shares storage)."""
        return self.amax_history.view(-1)

    @property
    def amax(self) -> torch.Tensor:
        """History row 0, the amax being accumulated for the current step (a 1-element view)."""
        return self._history[:1]

    def state_to(self, device) -> None:
        """Move `scale` and `amax_history` to `device` (no-op when they are there).

        A recipe builds the state on the CPU; the first quantization moves it to the tensor's device, so that
        recording the amax and `update_scale` never cross between host and device.  Quantizers that share state
        (`copy`) each move their own reference.  The moved state is made outside ``torch.inference_mode`` (a
        first quantization may run in it): made in it, the training steps after it could not update it in place."""
        if self.scale.device != device:
            with torch.inference_mode(False):
                self.scale = self.scale.to(device)
        if self.amax_history.device != device:
            with torch.inference_mode(False):
                self.amax_history = self.amax_history.to(device)

    def _quantize(self, tensor: torch.Tensor) -> Float8Tensor:
        check_high_precision_input(tensor, type(self).__name__)
        self.state_to(tensor.device)
        # GPU dispatch hook: the CuPy kernel's buffers when it applies, else the torch path below
        buffers = dispatch.quantize_fp8_delayed(
            tensor,
            self._history,
            self.scale,
            self.fp8_format,
            self.rowwise_usage,
            self.columnwise_usage,
            self.kernel,
            self.high_precision_stats,
        )
        if buffers is not None:
            return _from_kernel_buffers(self, tensor, buffers)
        history = self._history
        if (
            tensor.is_cpu
            and tensor.is_contiguous()
            and tensor.numel()
            and not history.requires_grad
            and not compiling()
        ):
            return self._quantize_on_host(tensor, history)
        amax = tensor_amax(tensor).to(self.amax_history.device)
        history[0] = torch.maximum(history[0], amax)
        return _cast_per_tensor(self, tensor, self.scale, self.fp8_format)

    def _quantize_on_host(self, tensor: torch.Tensor, history: torch.Tensor) -> Float8Tensor:
        """The torch path above for a contiguous, non-empty CPU tensor (the state is on the CPU too, `state_to`):
        the amax by numpy (order-free), recorded into history[0] as ``torch.maximum`` does (NaN propagates), then
        `_host_cast` with the stored scale (the compiled helpers' amax and `_compiled_cast` where they are built).
        The same bytes, scale_inv and history as the torch path (tests/quantization/test_float8_host_stats.py
        compares them)."""
        recorded = history.numpy()
        helpers = host_fp8()
        if helpers is not None:  # the compiled helpers: the amax in one call, the cast in another
            source = _fp32_source(tensor)
            largest, _ = helpers.amax_and_nan(source.data_ptr(), source.numel())
            recorded[0] = np.maximum(recorded[0], np.float32(largest))
            return _compiled_cast(self, tensor, source, largest, np.float32(self.scale.item()), helpers)
        values = _host_fp32(tensor)
        workspace = _scaled_workspace(tensor.shape)
        amax, has_nan = host_amax_and_nan(values, workspace[0])  # (|x| goes to the workspace, overwritten below)
        recorded[0] = np.maximum(recorded[0], amax)
        return _host_cast(self, tensor, values, amax, has_nan, np.float32(self.scale.item()), workspace)

    def compute_amax(self, history: torch.Tensor) -> torch.Tensor:
        """The amax the next scale is derived from, from the 1-D history before the roll: its maximum ("max"), its
        newest entry ("most_recent"), or what a user callable returns."""
        if callable(self.amax_compute_algo):
            return torch.as_tensor(self.amax_compute_algo(history), dtype=torch.float32).reshape(())
        if self.amax_compute_algo == "max":
            return history.max()
        return history[0]

    def update_scale(self) -> None:
        """Roll the history (row i <- row i+1, last <- old row 0, row 0 <- 0) and recompute `scale` in place.

        scale = fp32(fp8_max · 2^-margin) / amax; the previous scale is kept when amax is 0 or not finite, and an
        infinite quotient becomes FLT_MAX.
        """
        # fp32(fp8_max · 2^-margin) is exact in a Python float, which a fp32 tensor op uses as that fp32 value
        scaled_max = _scaled_max(FP8_MAX[self.fp8_format], self.margin)
        # GPU: the whole update in one kernel (same values)
        if dispatch.fp8_delayed_update(self._history, self.scale, self.amax_compute_algo, scaled_max, self.kernel):
            return
        history = self._history
        amax = self.compute_amax(history.clone()).to(device=self.scale.device, dtype=torch.float32)
        rolled = torch.roll(history, -1)
        rolled[0] = 0.0
        history.copy_(rolled)
        usable = torch.isfinite(amax) & (amax > 0)
        # (full_like, not `scaled_max / amax`: torch divides a scalar by a tensor as reciprocal times scalar)
        quotient = torch.clamp(torch.full_like(amax, scaled_max) / amax, max=FLT_MAX)  # Inf becomes FLT_MAX
        previous = self.scale.float().reshape(())
        self.scale.copy_(torch.where(usable, quotient, previous).reshape(self.scale.shape))

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None) -> Float8Tensor:
        return _empty_per_tensor(self, shape, dtype, device, self.fp8_format)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fp8_format={self.fp8_format}, scale={float(self.scale.reshape(())):g}, "
            f"history_len={self._history.numel()}, margin={self.margin}, "
            f"amax_compute_algo={self.amax_compute_algo!r}, rowwise={self.rowwise_usage}, "
            f"columnwise={self.columnwise_usage})"
        )


@functools.lru_cache(maxsize=None)
def _scaled_max(fp8_max: float, margin: float) -> float:
    """fp32(fp8_max · 2^-margin), computed in fp32 as TE does."""
    return float(
        torch.tensor(fp8_max, dtype=torch.float32) * torch.exp2(torch.tensor(-float(margin), dtype=torch.float32))
    )


def _check_state(t, name: str, ok: Callable[[torch.Tensor], bool], want: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"Float8Quantizer: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or not ok(t):
        raise ValueError(
            f"Float8Quantizer: {name} must be float32 with {want}, got {t.dtype} of shape {tuple(t.shape)}"
        )
    return t
