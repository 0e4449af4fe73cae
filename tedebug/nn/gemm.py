"""The one GEMM entry point of `tedebug.nn`: operand selection by layout, unwrapping, and execution.

TE convention (A = first operand): ``out = op_B(B) · op_A(A)`` with ``op_A = Aᵀ`` iff ``layout[0] == "T"`` and
``op_B = Bᵀ`` iff ``layout[1] == "T"``.  A Linear layer with x ``[M, K]``, W ``[N, K]``, dy ``[M, N]`` runs

    fprop  "TN": gemm(W, x)  -> x · Wᵀ   (weight rowwise,    activation rowwise)
    dgrad  "NN": gemm(W, dy) -> dy · W   (weight columnwise, gradient rowwise)
    wgrad  "NT": gemm(x, dy) -> dyᵀ · x  (activation columnwise, gradient columnwise)

Operand A uses its rowwise representation iff ``layout[0] == "T"``; B uses its columnwise representation iff
``layout[1] == "T"``.  `gemm_operand` is the single place that turns whatever a layer holds (a plain tensor, a
`QuantizedTensor`, a hybrid, a debug wrapper) into the object that this GEMM consumes.

Execution: two per-tensor FP8 operands on a CUDA device with FP8 GEMM support run through ``torch._scaled_mm``
(bias in its epilogue).  Everything else is emulated.  On CUDA, operands whose dequantized values are exact in bf16
(MXFP8, NVFP4, FP8 block scaling with power-of-two scales, per-tensor FP8, bf16 tensors; see
`tedebug.quantization.gemm_values`) run as one bf16 tensor-core GEMM with fp32 accumulation, the remaining
per-tensor factors and the bias applied to the fp32 result before the one rounding (`_on_tensor_cores`); the
others, and every CPU GEMM, dequantize to fp32 and multiply in fp32.  Both equal "dequantize to fp32, fp32 matmul"
up to the order of the fp32 additions, and neither reads anything back to the host.  Two plain tensors of one dtype
run as the plain torch op (so the high-precision path equals ``torch.nn.functional.linear`` bit for bit).  N-D
operands are flattened to 2-D (all leading dims folded into the first); the result is 2-D.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import numpy as np
import torch

from tedebug.backends import dispatch
from tedebug.host_numpy import PerThreadTable
from tedebug.quantization.float8 import Float8Tensor
from tedebug.quantization.float8_block import Float8BlockwiseTensor
from tedebug.quantization.formats import TORCH_FP8_DTYPE
from tedebug.quantization.gemm_values import GemmValues
from tedebug.quantization.hybrid import HybridQuantizedTensor
from tedebug.quantization.identity import IdentityTensor
from tedebug.quantization.mxfp8 import MXFP8Tensor
from tedebug.quantization.nvfp4 import NVFP4Tensor
from tedebug.quantization.tensor import QuantizedTensor

__all__ = ["gemm", "gemm_operand", "LAYOUTS"]

LAYOUTS = ("TN", "NN", "NT", "TT")
#: layout -> (usage of A, usage of B): A rowwise iff layout[0] == "T", B columnwise iff layout[1] == "T"
_USAGES = {
    layout: ("rowwise" if layout[0] == "T" else "columnwise", "columnwise" if layout[1] == "T" else "rowwise")
    for layout in LAYOUTS
}

Operand = Union[torch.Tensor, QuantizedTensor]


# ------------------------------------------------------------------------------------------------ operands
def _is_debug_tensor(obj) -> bool:
    # duck-typed (DebugQuantizedTensor lives in tedebug.debug_quantization, which needs the config stack)
    return callable(getattr(obj, "get_tensor", None)) and not isinstance(obj, torch.Tensor)


def _missing(gemm_name: str, usage: str, role: str) -> RuntimeError:
    return RuntimeError(f"GEMM '{gemm_name}' requested the {usage} representation of '{role}', but it is unavailable")


#: the quantized storages a recipe's quantizer returns (exact types: no wrapper to unwrap, no ABC check), whose
#: directions are their ``rowwise_data`` / ``columnwise_data`` (what `QuantizedTensor.has_rowwise` reads)
_PLAIN_STORAGES = frozenset((Float8Tensor, MXFP8Tensor, Float8BlockwiseTensor, NVFP4Tensor))


def gemm_operand(obj, usage: str, role: str, gemm_name: str) -> Operand:
    """The object GEMM `gemm_name` consumes for operand `role` in representation `usage`.

    Unwraps a DebugQuantizedTensor (by direction), then hybrids (by sub-storage, recursively), then an
    IdentityTensor (its values).  Returns a plain tensor or a QuantizedTensor that holds `usage`; raises
    RuntimeError naming the GEMM and the tensor role when that representation is missing.
    """
    if usage not in ("rowwise", "columnwise"):
        raise ValueError(f"gemm_operand: usage must be 'rowwise' or 'columnwise', got {usage!r}")
    while True:
        if type(obj) in _PLAIN_STORAGES:  # the common quantized operands (also once unwrapped from a debug tensor),
            # answered without the checks below
            if (obj.rowwise_data if usage == "rowwise" else obj.columnwise_data) is None:
                raise _missing(gemm_name, usage, role)
            return obj
        if obj is None:
            raise _missing(gemm_name, usage, role)
        if isinstance(obj, torch.Tensor):
            return obj
        if _is_debug_tensor(obj):
            obj = obj.get_tensor(usage == "columnwise")
            continue
        if isinstance(obj, HybridQuantizedTensor):
            obj = getattr(obj, f"{usage}_sub_storage")
            continue
        if not isinstance(obj, QuantizedTensor):
            raise TypeError(
                f"GEMM '{gemm_name}': operand '{role}' must be a torch.Tensor or a QuantizedTensor, "
                f"got {type(obj).__name__}"
            )
        present = obj.has_rowwise if usage == "rowwise" else obj.has_columnwise
        if not present:
            raise _missing(gemm_name, usage, role)
        if isinstance(obj, IdentityTensor):
            return obj.rowwise_data if usage == "rowwise" else obj.columnwise_data
        return obj


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 1:
        raise ValueError(f"GEMM operands must have at least 1 dimension, got shape {tuple(t.shape)}")
    if t.dim() == 1:
        return t.reshape(1, -1)
    return t.reshape(-1, t.shape[-1])


def _dequantized_2d(op: Operand, usage: str, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(op, torch.Tensor):
        op = _as_2d(op)
        return op if op.dtype is dtype else op.to(dtype)
    if dtype is torch.float32 and type(op) is Float8Tensor:
        return op.fp32_matrix(usage)  # the same values and strides, decoded in one step on the CPU
    return _as_2d(op.dequantize(dtype=dtype, usage=usage))


# ------------------------------------------------------------------------------------------------ native FP8
_FP8_GEMM_DEVICES: dict = {}  # device -> whether torch._scaled_mm runs there (asked once per device)


def _fp8_gemm_supported(device: torch.device) -> bool:
    supported = _FP8_GEMM_DEVICES.get(device)
    if supported is None:
        supported = _FP8_GEMM_DEVICES[device] = (
            device.type == "cuda"
            and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9)
        )
    return supported


def _fp8_data(op: Float8Tensor, usage: str) -> torch.Tensor:
    data = op.rowwise_data if usage == "rowwise" else op.columnwise_data
    if data.dim() != 2:  # (the layers' operands are 2-D already: no reshape call)
        data = _as_2d(data)
    return data.view(TORCH_FP8_DTYPE[op.fp8_format])


def _aligned_scale(scale_inv: torch.Tensor) -> torch.Tensor:
    """The 0-d fp32 scale as cuBLASLt accepts it: 16-byte aligned (a view into a larger buffer, e.g. the fused
    amax/scale/scale_inv output of the GPU kernels, is copied; cuBLASLt answers NOT_SUPPORTED otherwise)."""
    scale = scale_inv if scale_inv.dim() == 0 and scale_inv.dtype is torch.float32 else scale_inv.reshape(()).float()
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def _try_scaled_mm(
    a, b, a_usage: str, b_usage: str, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """``torch._scaled_mm`` for two per-tensor FP8 operands; None when this case must be emulated.

    ``_scaled_mm(mat1, mat2)`` wants mat1 row-major ``[M, K]`` and mat2 column-major ``[K, N]``.  mat1 = op_B(B):
    B's rowwise bytes (layout "?N") or its columnwise bytes, which are already the transpose (layout "?T").
    mat2 = op_A(A) column-major = (row-major ``[N, K]``)ᵀ: A's rowwise bytes (layout "T?") or its columnwise bytes
    (layout "N?"), transposed as a view.
    """
    if type(a) is not Float8Tensor or type(b) is not Float8Tensor:  # (exact types: no ABC instance checks)
        if not (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)):
            return None
    device = a._device
    if device.type != "cuda" or device != b._device or not _fp8_gemm_supported(device):
        return None
    if a.fp8_format == "E5M2" and b.fp8_format == "E5M2":
        return None  # cuBLAS has no E5M2 x E5M2 FP8 GEMM
    mat1 = _fp8_data(b, b_usage)
    mat2 = _fp8_data(a, a_usage).t()
    if any(d % 16 for d in (*mat1.shape, mat2.shape[1])):
        return None
    if bias is not None and (out_dtype not in (torch.bfloat16, torch.float16) or bias.dtype != out_dtype):
        # cuBLASLt's bias epilogue takes a bias of the (16-bit) output type: add it to an fp32 result instead
        res = torch._scaled_mm(
            mat1,
            mat2,
            scale_a=_aligned_scale(b.scale_inv),
            scale_b=_aligned_scale(a.scale_inv),
            out_dtype=torch.float32,
        )
        res = res[0] if isinstance(res, tuple) else res
        return (res + bias.float()).to(out_dtype)
    # the bias (if any) is added to the fp32 result in the GEMM's epilogue, before the one rounding
    res = torch._scaled_mm(
        mat1,
        mat2,
        scale_a=_aligned_scale(b.scale_inv),
        scale_b=_aligned_scale(a.scale_inv),
        bias=bias,
        out_dtype=out_dtype,
    )
    return res[0] if isinstance(res, tuple) else res


# ------------------------------------------------------------------------------------------------ emulation
#: ``torch.mm(a, b, out_dtype=torch.float32)`` for bf16 operands (aten::mm.dtype, torch >= 2.8 on CUDA)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _gemm_values(op, usage: str):
    """`op` as exact bf16 values and a factor (`GemmValues`), or None when it has no such form."""
    if isinstance(op, torch.Tensor):
        return GemmValues(_as_2d(op), 1.0) if op.dtype == torch.bfloat16 else None
    return op.gemm_values(usage)


def _on_tensor_cores(a, b, a_usage, b_usage, layout, out_dtype, bias) -> Optional[torch.Tensor]:
    """The emulated GEMM as one bf16 tensor-core GEMM with fp32 accumulation, or None when the pair has no exact
    bf16 form (then `_emulated` computes in fp32).

    Both operands are exact in bf16 (`tedebug.quantization.gemm_values`), so the sums are those of the fp32 GEMM
    of the dequantized operands up to the order of the fp32 additions.  The factors left over are applied to the
    fp32 result before the one rounding to `out_dtype`: Python-float factors (powers of two) and the bias inside
    the GEMM (``alpha`` and cuBLASLt's bias epilogue); device factors (NVFP4's global scales, per-tensor FP8) by a
    cuBLAS GEMM that reads alpha from device memory (CuPy's cuBLAS binding, bf16 output directly), else, and for
    outputs other than bf16, on an fp32 result (``torch.mm(..., out_dtype=torch.float32)``).  bf16
    reduced-precision split-K reductions are switched off for the call, so that the accumulation stays fp32.
    """
    ga = _gemm_values(a, a_usage)
    gb = _gemm_values(b, b_usage) if ga is not None else None
    if gb is None or ga.rotated != gb.rotated:
        return None  # no exact form, or one operand rotated by the RHT and the other not: dequantize to fp32
    op_a = ga.values.t() if layout[0] == "T" else ga.values  # [K, N]
    op_b = gb.values if layout[1] == "N" else gb.values.t()  # [M, K]
    host_factor = isinstance(ga.scale, float) and isinstance(gb.scale, float)
    if host_factor and out_dtype == torch.bfloat16:
        alpha = ga.scale * gb.scale
        with _fp32_reduction():
            if bias is not None:
                return torch.addmm(bias.to(torch.bfloat16), op_b, op_a, alpha=alpha)
            if alpha == 1.0:
                return torch.mm(op_b, op_a)
            out = torch.empty(op_b.shape[0], op_a.shape[1], dtype=torch.bfloat16, device=op_b.device)
            return out.addmm_(op_b, op_a, beta=0, alpha=alpha)
    if not _MM_OUT_DTYPE:
        return None
    kernels = dispatch.gemm_kernels(op_b) if out_dtype == torch.bfloat16 else None
    device_factors = isinstance(ga.scale, torch.Tensor) and isinstance(gb.scale, torch.Tensor)
    if kernels is not None and device_factors:
        # one cuBLAS GEMM reading its alpha (the product of the factors) from device memory: no fp32 output
        out = kernels.gemm_device_alpha(op_b, op_a, ga.scale * gb.scale, bias)
        if out is not None:
            return out
    out = torch.mm(op_b, op_a, out_dtype=torch.float32)  # [M, N] fp32
    if (
        kernels is not None
        and device_factors
        and out.numel() % 4 == 0
        and (bias is None or bias.dtype == torch.bfloat16)
    ):
        return kernels.epilogue_bf16(out, ga.scale, gb.scale, bias)  # the lines below, in one pass
    factor = ga.scale * gb.scale
    if not (isinstance(factor, float) and factor == 1.0):
        out.mul_(factor)
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)


class _fp32_reduction:  # noqa: N801 - used as a `with` block
    """Switch off cuBLAS's bf16 reduced-precision reductions for the block (restored on exit)."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        self._saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        if self._saved:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    def __exit__(self, *exc) -> None:
        if self._saved:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True


def _emulated(a, b, a_usage, b_usage, layout, out_dtype, bias) -> torch.Tensor:
    """Dequantize and multiply: on tensor cores where the operands are exact in bf16 (CUDA), else in fp32."""
    if type(a) is Float8Tensor and type(b) is Float8Tensor and a._device.type == "cpu":  # (the CPU FP8 GEMM)
        a2, b2 = a.fp32_matrix(a_usage), b.fp32_matrix(b_usage)
    else:
        if a.device.type == "cuda":
            out = _on_tensor_cores(a, b, a_usage, b_usage, layout, out_dtype, bias)
            if out is not None:
                return out
        a2 = _dequantized_2d(a, a_usage, torch.float32)
        b2 = _dequantized_2d(b, b_usage, torch.float32)
    op_a = a2.t() if layout[0] == "T" else a2
    op_b = b2 if layout[1] == "N" else b2.t()
    return _bias_and_cast(op_b @ op_a, bias, out_dtype)


def _bias_and_cast(out: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The epilogue of an emulated GEMM: `bias` added to the result in its dtype, then one cast to `out_dtype` (no
    call that would return its input)."""
    if bias is not None:
        out = out + (bias if bias.dtype is out.dtype else bias.to(dtype=out.dtype))
    return out if out_dtype is out.dtype else out.to(dtype=out_dtype)  # (a keyword dtype= parses faster)


def _host_fp8(
    a: Float8Tensor, b: Float8Tensor, layout: str, out_dtype: Optional[torch.dtype], bias: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """The emulated GEMM of two per-tensor FP8 CPU operands straight from their stored codes, or None for the
    general path (which also raises the errors: an unknown layout, a missing representation, reduction sizes that
    differ).

    For every layout op_A is the transpose of A's decoded stored array and op_B B's own (rowwise codes are `[M,
    K]`, columnwise ones `[K, M]`; `Float8Tensor.host_decoded`), so one table look-up per operand gives the
    operands of ``op_B(B) · op_A(A)`` with the values and strides that "dequantize, flatten to 2-D, transpose as
    the layout says" gives them, and the product, the bias and the cast are the same torch operations: the same
    result bits, with no torch call but the product and its epilogue."""
    usages = _USAGES.get(layout)
    if usages is None:
        return None
    (am, ak), (bm, bk) = a._mk, b._mk
    if (ak if layout[0] == "T" else am) != (bm if layout[1] == "T" else bk):
        return None
    # the decoded operands go to this thread's arrays for their shapes (`_operand_arrays`), already wrapped as the
    # tensors `mm` takes (A's as its transposed view)
    a_array, op_a = _operand_arrays(0, (am, ak) if usages[0] == "rowwise" else (ak, am))
    b_array, op_b = _operand_arrays(1, (bm, bk) if usages[1] == "rowwise" else (bk, bm))
    if a.host_decoded(usages[0], a_array) is None or b.host_decoded(usages[1], b_array) is None:
        return None
    out = torch.mm(op_b, op_a)
    return _bias_and_cast(out, bias, out_dtype if out_dtype is not None else b._dtype)


#: the arrays of `_operand_arrays`, per thread, operand and shape: at most 32, the largest 65536 elements
_OPERANDS = PerThreadTable(32, max_numel=65536)


def _operand_arrays(slot: int, shape: Tuple[int, int]) -> Tuple[np.ndarray, torch.Tensor]:
    """The fp32 array of `shape` that receives the decoded values of operand `slot` (0: A, 1: B) of the CPU FP8
    GEMM and the tensor `mm` takes for it (A's transposed view, B's as it is): made once per thread, operand and
    shape (a new pair above `_OPERANDS.max_numel` elements, where it costs little next to the product).  The values
    never outlive the call: `mm` has read them and written its own result before the next GEMM on the thread
    writes the arrays again."""
    key = (slot, shape)
    entry = _OPERANDS.get(key)
    if entry is None:
        array = np.empty(shape, dtype=np.float32)
        entry = _OPERANDS.keep(key, (array, torch.from_numpy(array.T if slot == 0 else array)), array.size)
    return entry


def _plain(
    a: torch.Tensor,
    b: torch.Tensor,
    layout: str,
    out_dtype: Optional[torch.dtype],
    bias: Optional[torch.Tensor],
    gemm_name: str,
    roles: Tuple[str, str],
) -> torch.Tensor:
    """The plain-operand entry: two plain tensors of one dtype, as the torch ops themselves (``F.linear`` for "TN",
    ``torch.mm`` otherwise: what ``@`` runs on 2-D operands), with the checks of `gemm` done on the 2-D views and no
    op that returns its input (a 2-D operand is not reshaped, an output of `out_dtype` is not converted).  This runs
    three times per GEMM call of a layer on the high-precision debug path, so each avoided call counts."""
    if layout not in _USAGES:
        raise ValueError(f"GEMM '{gemm_name}': layout must be one of {LAYOUTS}, got {layout!r}")
    a2 = a if a.dim() == 2 else _as_2d(a)
    b2 = b if b.dim() == 2 else _as_2d(b)
    if a2.device != b2.device:
        raise RuntimeError(f"GEMM '{gemm_name}': operands on different devices ({a.device} and {b.device})")
    a_shape, b_shape = a2.shape, b2.shape
    if (a_shape[1] if layout[0] == "T" else a_shape[0]) != (b_shape[0] if layout[1] == "T" else b_shape[1]):
        _check_shapes(a, b, layout, gemm_name, roles)  # raises, naming the operands' own shapes
    if layout == "TN":
        out = torch.nn.functional.linear(b2, a2, bias)
    else:
        out = torch.mm(b2 if layout[1] == "N" else b2.t(), a2.t() if layout[0] == "T" else a2)
        if bias is not None:
            out = out + bias
    if out_dtype is None:
        out_dtype = a.dtype
    return out if out.dtype is out_dtype else out.to(dtype=out_dtype)


# ------------------------------------------------------------------------------------------------ entry
def gemm(
    A,
    B,
    *,
    layout: str = "TN",
    out_dtype: Optional[torch.dtype] = None,
    gemm_name: str = "gemm",
    bias: Optional[torch.Tensor] = None,
    roles: Tuple[str, str] = ("A", "B"),
    use_native: bool = True,
) -> torch.Tensor:
    """``out = op_B(B) · op_A(A) (+ bias)`` as a 2-D tensor of `out_dtype` (see the module docstring).

    A and B may be plain tensors, QuantizedTensors, hybrids or DebugQuantizedTensors.  `roles` names the two
    operands in error messages (e.g. ``("weight", "activation")``).  `bias` (length N, high precision) is added
    to the fp32 result before the cast (plain operands: as ``F.linear`` does).  ``use_native=False`` forces emulation
    (for tests).
    """
    if isinstance(A, torch.Tensor) and isinstance(B, torch.Tensor) and A.dtype is B.dtype:
        return _plain(A, B, layout, out_dtype, bias, gemm_name, roles)
    if type(A) is Float8Tensor and type(B) is Float8Tensor and A._device.type == "cpu" and B._device.type == "cpu":
        out = _host_fp8(A, B, layout, out_dtype, bias)
        if out is not None:
            return out
    usages = _USAGES.get(layout)
    if usages is None:
        raise ValueError(f"GEMM '{gemm_name}': layout must be one of {LAYOUTS}, got {layout!r}")
    a_usage, b_usage = usages
    a = gemm_operand(A, a_usage, roles[0], gemm_name)
    b = gemm_operand(B, b_usage, roles[1], gemm_name)
    if (
        (a is not A or b is not B)  # (unwrapped from debug tensors: the CPU FP8 GEMM above, not asked twice)
        and type(a) is Float8Tensor
        and type(b) is Float8Tensor
        and a._device.type == "cpu"
        and b._device.type == "cpu"
    ):
        out = _host_fp8(a, b, layout, out_dtype, bias)
        if out is not None:
            return out
    if a.device != b.device:
        raise RuntimeError(f"GEMM '{gemm_name}': operands on different devices ({a.device} and {b.device})")
    _check_shapes(a, b, layout, gemm_name, roles)
    if out_dtype is None:
        out_dtype = a.dtype if isinstance(a, torch.Tensor) else b.dtype
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype:
        return _plain(a, b, layout, out_dtype, bias, gemm_name, roles)  # (unwrapped from a debug / identity tensor)
    if use_native:
        out = _try_scaled_mm(a, b, a_usage, b_usage, out_dtype, bias)
        if out is not None:
            return out
    return _emulated(a, b, a_usage, b_usage, layout, out_dtype, bias)


def _rows(shape: Tuple[int, ...]) -> int:
    """M of the 2-D view [M, K] of `shape` (the product of the leading dims, 1 for a 1-D shape)."""
    if len(shape) == 2:
        return shape[0]
    return math.prod(shape[:-1])


def _check_shapes(a, b, layout: str, gemm_name: str, roles: Tuple[str, str]) -> None:
    sa, sb = tuple(a.shape), tuple(b.shape)
    a_rows = _rows(sa)
    b_rows = _rows(sb)
    k_a = sa[-1] if layout[0] == "T" else a_rows
    k_b = b_rows if layout[1] == "T" else sb[-1]
    if k_a != k_b:
        raise ValueError(
            f"GEMM '{gemm_name}' (layout {layout}): reduction sizes differ: '{roles[0]}' {sa} gives {k_a}, "
            f"'{roles[1]}' {sb} gives {k_b}"
        )
