"""CuPy launchers of ``kernels/dequant.cu``: exact bf16 operands of the emulated GEMMs and their bf16 epilogue.

Each returns what the torch path of `tedebug.quantization.gemm_values` returns, bit for bit, in one launch and with
no host synchronisation; `dispatch.kernels_for(tensor)` decides whether they run.  Inputs are the stored
(contiguous) codes and scales; the callers check the layouts.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from tedebug.backends.cupy_runtime import FLAGS, THREADS, PlanCache, device_index, get_kernel, grid_for, grid_on
from tedebug.backends.cublaslt import as_cublas, gemm_bias_device_alpha
from tedebug.backends.launch import launch, launch_on, raw_stream

_FP8_OPTION = {"E4M3": ("-DTED_FP8=0",), "E5M2": ("-DTED_FP8=1",)}


#: (kernel name, FP8 format, device index, rows, cols, elements per thread) -> (kernel, grid, np.int64 rows,
#: np.int64 cols): worked out once per operand shape (a layer dequantizes the same shapes at every step)
_PLANS = PlanCache()


def _plan(kernel: str, fp8_format: str, index: int, rows: int, cols: int, per_thread: int):
    key = (kernel, fp8_format, index, rows, cols, per_thread)
    plan = _PLANS.get(key)
    if plan is None:
        grid = grid_on(index, rows * cols // per_thread)
        kernel_of = get_kernel("dequant.cu", kernel, _FP8_OPTION[fp8_format])
        plan = _PLANS.put(key, (kernel_of, grid, np.int64(rows), np.int64(cols)))
    return plan


def _dequantize(
    kernel: str,
    fp8_format: str,
    data: torch.Tensor,
    scales: torch.Tensor,
    rows: int,
    cols: int,
    middle: Tuple,
    per_thread: int,
) -> torch.Tensor:
    """The shape the dequantization kernels share: bf16 [rows, cols] from (data, scales, rows, cols, *`middle`, out),
    one thread per `per_thread` elements."""
    device = data.device
    index = data.get_device()
    function, grid, rows64, cols64 = _plan(kernel, fp8_format, index, rows, cols, per_thread)
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
    args = (data.data_ptr(), scales.data_ptr(), rows64, cols64) + middle + (out.data_ptr(),)
    launch_on(function, index, raw_stream(index), grid, THREADS, args)
    return out


def mxfp8_values(
    codes: torch.Tensor, scales: torch.Tensor, row_blocks: bool, fp8_format: str, lift: int
) -> torch.Tensor:
    """bf16 [rows, cols] of MXFP8 `codes` (uint8 [rows, cols], cols % 32 == 0) and E8M0 `scales`."""
    rows, cols = codes.shape
    return _dequantize(
        "ted_dequant_mxfp8", fp8_format, codes, scales, rows, cols, (FLAGS[bool(row_blocks)], np.int32(lift)), 8
    )


def fp8_block_values(
    codes: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, fp8_format: str, lift: int
) -> torch.Tensor:
    """bf16 [rows, cols] of FP8 block `codes` (uint8 [rows, cols], cols % 8 == 0) and fp32 `scale_inv`."""
    rows, cols = codes.shape
    return _dequantize(
        "ted_dequant_fp8_block",
        fp8_format,
        codes,
        scale_inv,
        rows,
        cols,
        (np.int32(block_rows), np.float32(2.0**lift)),
        8,
    )


def nvfp4_values(packed: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """bf16 [rows, cols] of NVFP4 `packed` bytes ([rows, cols/2]) and E4M3 block `scales` ([rows, cols/16])."""
    return _dequantize("ted_dequant_nvfp4", "E4M3", packed, scales, rows, cols, (), 8)


def epilogue_bf16(acc: torch.Tensor, fa: torch.Tensor, fb: torch.Tensor, bias) -> torch.Tensor:
    """bf16((acc * (fa * fb)) + bias) of a contiguous fp32 [M, N] `acc` (numel % 4 == 0), 0-d fp32 device factors
    and an optional bf16 bias [N]."""
    out = torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device)
    kernel = get_kernel("dequant.cu", "ted_epilogue_bf16", _FP8_OPTION["E4M3"])
    args = (
        acc.data_ptr(),
        np.int64(acc.numel()),
        np.int64(acc.shape[-1]),
        fa.data_ptr(),
        fb.data_ptr(),
        bias.data_ptr() if bias is not None else 0,
        out.data_ptr(),
    )
    launch(kernel, grid_for(acc.device, acc.numel() // 4), THREADS, args, acc.device)
    return out


# ------------------------------------------------------------------------------------------------ cuBLAS, device alpha
# cuBLAS enums (cublas_api.h, library_types.h)
_R_16BF, _R_32F = 14, 0
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_POINTER_MODE_DEVICE = 1
_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16

_HANDLES: Dict[int, int] = {}
_CONSTANTS: Dict[Tuple[int, float], torch.Tensor] = {}


def _handle(index: int) -> int:
    """A cuBLAS handle of device `index` that reads alpha / beta from device memory and never reduces in bf16."""
    handle = _HANDLES.get(index)
    if handle is None:
        from cupy_backends.cuda.libs import cublas

        with torch.cuda.device(index):
            handle = cublas.create()
        cublas.setPointerMode(handle, _POINTER_MODE_DEVICE)
        cublas.setMathMode(handle, _MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)
        _HANDLES[index] = handle
    return handle


def _constant(index: int, value: float) -> torch.Tensor:
    key = (index, value)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(value, dtype=torch.float32).to(torch.device("cuda", index))
    return t


def gemm_device_alpha(
    op_b: torch.Tensor, op_a: torch.Tensor, alpha: torch.Tensor, bias: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """bf16 ``alpha · (op_b @ op_a) + bias`` of bf16 op_b [M, K] and op_a [K, N], alpha a 0-d fp32 device tensor, in
    one cuBLAS GEMM: fp32 accumulation, alpha and the bias applied to the fp32 result, one rounding;
    reduced-precision reductions disallowed.  A bias goes through cuBLASLt's bias epilogue
    (`tedebug.backends.cublaslt`); where that path does not take the call, through cuBLAS's beta · C with C the bias
    broadcast to [M, N].  None when a stride layout does not fit."""
    from cupy_backends.cuda.libs import cublas

    m, k = op_b.shape
    n = op_a.shape[1]
    layout_a, layout_b = as_cublas(op_a), as_cublas(op_b)
    if layout_a is None or layout_b is None or min(m, n, k) == 0 or alpha.dtype != torch.float32:
        return None
    index = device_index(op_b.device)
    if bias is not None:
        # cuBLASLt's bias epilogue: no [M, N] copy of the bias (the branch below is the fallback)
        out = gemm_bias_device_alpha(op_b, op_a, alpha.contiguous(), _constant(index, 0.0), bias.to(torch.bfloat16))
        if out is not None:
            return out
        out = bias.to(torch.bfloat16).expand(m, n).contiguous()
        beta = _constant(index, 1.0)
    else:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=op_b.device)
        beta = _constant(index, 0.0)
    alpha = alpha.contiguous()
    handle = _handle(index)
    cublas.setStream(handle, raw_stream(index))
    # row-major out [M, N] is column-major outᵀ [N, M] = op_aᵀ [N, K] · op_bᵀ [K, M]
    cublas.gemmEx(
        handle,
        layout_a[0],
        layout_b[0],
        n,
        m,
        k,
        alpha.data_ptr(),
        op_a.data_ptr(),
        _R_16BF,
        layout_a[1],
        op_b.data_ptr(),
        _R_16BF,
        layout_b[1],
        beta.data_ptr(),
        out.data_ptr(),
        _R_16BF,
        n,
        _COMPUTE_32F,
        _GEMM_DEFAULT,
    )
    return out
