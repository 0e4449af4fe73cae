"""CuPy launchers of ``kernels/dequant.cu``: exact bf16 operands of the emulated GEMMs and their bf16 epilogue.

Each returns what the torch path of `tedebug.quantization.gemm_values` returns, bit for bit, in one launch and with
no host synchronisation; `dispatch.kernels_for(tensor)` decides whether they run.  Inputs are the stored
(contiguous) codes and scales; the callers check the layouts.
"""

from __future__ import annotations

import numpy as np
import torch

from tedebug.backends.cupy_kernels import BLOCKS_PER_SM, THREADS, _device_index, _launch, _sm_count, get_kernel

_FP8_OPTION = {"E4M3": ("-DTED_FP8=0",), "E5M2": ("-DTED_FP8=1",)}


def _grid(device: torch.device, items: int) -> int:
    return max(1, min(BLOCKS_PER_SM * _sm_count(_device_index(device)), (items + THREADS - 1) // THREADS))


def mxfp8_values(codes: torch.Tensor, scales: torch.Tensor, row_blocks: bool, fp8_format: str,
                 lift: int) -> torch.Tensor:
    """bf16 [rows, cols] of MXFP8 `codes` (uint8 [rows, cols], cols % 32 == 0) and E8M0 `scales`."""
    rows, cols = codes.shape
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device=codes.device)
    kernel = get_kernel("dequant.cu", "ted_dequant_mxfp8", _FP8_OPTION[fp8_format])
    args = (codes.data_ptr(), scales.data_ptr(), np.int64(rows), np.int64(cols), np.int32(row_blocks),
            np.int32(lift), out.data_ptr())
    _launch(kernel, _grid(codes.device, rows * cols // 8), THREADS, args, codes.device)
    return out


def fp8_block_values(codes: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, fp8_format: str,
                     lift: int) -> torch.Tensor:
    """bf16 [rows, cols] of FP8 block `codes` (uint8 [rows, cols], cols % 8 == 0) and fp32 `scale_inv`."""
    rows, cols = codes.shape
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device=codes.device)
    kernel = get_kernel("dequant.cu", "ted_dequant_fp8_block", _FP8_OPTION[fp8_format])
    args = (codes.data_ptr(), scale_inv.data_ptr(), np.int64(rows), np.int64(cols), np.int32(block_rows),
            np.float32(2.0 ** lift), out.data_ptr())
    _launch(kernel, _grid(codes.device, rows * cols // 8), THREADS, args, codes.device)
    return out


def nvfp4_values(packed: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """bf16 [rows, cols] of NVFP4 `packed` bytes ([rows, cols/2]) and E4M3 block `scales` ([rows, cols/16])."""
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device=packed.device)
    kernel = get_kernel("dequant.cu", "ted_dequant_nvfp4", _FP8_OPTION["E4M3"])
    args = (packed.data_ptr(), scales.data_ptr(), np.int64(rows), np.int64(cols), out.data_ptr())
    _launch(kernel, _grid(packed.device, rows * cols // 16), THREADS, args, packed.device)
    return out


def epilogue_bf16(acc: torch.Tensor, fa: torch.Tensor, fb: torch.Tensor, bias) -> torch.Tensor:
    """bf16((acc * (fa * fb)) + bias) of a contiguous fp32 [M, N] `acc` (numel % 4 == 0), 0-d fp32 device factors
    and an optional bf16 bias [N]."""
    out = torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device)
    kernel = get_kernel("dequant.cu", "ted_epilogue_bf16", _FP8_OPTION["E4M3"])
    args = (acc.data_ptr(), np.int64(acc.numel()), np.int64(acc.shape[-1]), fa.data_ptr(), fb.data_ptr(),
            bias.data_ptr() if bias is not None else 0, out.data_ptr())
    _launch(kernel, _grid(acc.device, acc.numel() // 4), THREADS, args, acc.device)
    return out
