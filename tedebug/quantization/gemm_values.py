"""Exact bf16 forms of quantized operands, for emulating block-scaled GEMMs on tensor cores.

Hopper has no MXFP8 / NVFP4 / FP8-block GEMM, so tedebug emulates them.  Dequantizing to fp32 and multiplying in
fp32 is exact but runs on the SIMT units, 10-20x slower than a bf16 GEMM.  It is not needed: every dequantized
block-scaled value is a short-mantissa code times a power-of-two (or short-mantissa) block scale, which bf16 holds
exactly, so a bf16 GEMM with fp32 accumulation computes the same sums as the fp32 GEMM, up to the order of the
fp32 additions.  What does not fit in bf16 is factored out of the values and applied to the fp32 result:

    dequantize(usage) == values.float() * scale        (values: bf16, every element exact; scale: see below)

- **MXFP8** (E4M3 / E5M2 codes x 2^(E-127)): exact in bf16 down to the smallest E8M0 scales only after a fixed lift
  by 2^L (L = 3 for E4M3, 10 for E5M2: the smallest code step 2^-9 / 2^-16 times 2^-127 must reach bf16's subnormal
  step 2^-133).  `scale` = 2^-L, a Python float, so the GEMM undoes the lift through its `alpha` (no extra pass, no
  data read back).  The lift overflows only operands with |x| > 2^(128-L) (4.3e37 for E4M3, 3.3e35 for E5M2), where
  bf16 itself is at its end; such values give Inf where the fp32 GEMM would give a finite number.
- **FP8 block scaling with power-of-two scales** (the recipe's default): the same (scale_inv >= 2^-127, the
  quantizer's largest scale being the input dtype's max rounded down to a power of two), with the same lift.
  Non-power-of-two block scales have no exact bf16 form: such operands return None and the GEMM runs in fp32.
- **NVFP4**: E2M1 values (2 significant bits) times the E4M3 block scale (4 bits) are exact in bf16 with no lift;
  `scale` is the 0-d fp32 device tensor amax / 2688 of the representation (TE's global decode factor), applied to
  the fp32 result.  Columnwise data quantized after the random Hadamard transform stays rotated (`rotated=True`):
  a GEMM whose two operands are both rotated along the reduction dimension (NVFP4's wgrad) needs no inverse
  transform, since H·Hᵀ = I.
- **Per-tensor FP8**: the codes are exact in bf16; `scale` is the 0-d fp32 scale_inv (used only where
  ``torch._scaled_mm`` cannot run the pair natively).

Every form is built from the quantizer's configuration alone: nothing is read back from the device.  `values` is
the logical 2-D matrix ``[M, K]`` of the tensor (M = product of the leading dims); for representations stored
transposed it is a transposed view, which the GEMM consumes without a copy.  On CUDA the values come from one kernel
per operand (`kernels/dequant.cu`,
the same bits as the torch code here).
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Union

import torch

from .formats import E2M1_VALUES, E4M3, TORCH_FP8_DTYPE

__all__ = [
    "GemmValues",
    "MXFP8_LIFT",
    "e8m0_to_bf16",
    "fp8_block_values_bf16",
    "fp8_codes_to_bf16",
    "mxfp8_values_bf16",
    "nvfp4_values_bf16",
    "pow2_to_bf16",
]

#: log2 of the fixed lift of MXFP8 / FP8-block values (see the module docstring), by element format.
MXFP8_LIFT = {"E4M3": 3, "E5M2": 10}

_BF16_INF_BITS = 0x7F80
_BF16_NAN_BITS = 0x7FC0


class GemmValues(NamedTuple):
    """An operand in the form the tensor-core GEMM consumes: ``dequantized == values.float() * scale``."""

    #: bf16 logical 2-D matrix [M, K] (possibly a transposed view), every element exact
    values: torch.Tensor
    #: a Python float (a power of two, applied through the GEMM's alpha) or a 0-d fp32 tensor on the device
    scale: Union[float, torch.Tensor]
    #: the values carry NVFP4's random Hadamard transform along dim 0 (M)
    rotated: bool = False


def fp8_codes_to_bf16(codes: torch.Tensor, fp8_format: str) -> torch.Tensor:
    """FP8 codes (uint8) as bf16 values (exact: every E4M3 / E5M2 value is a bf16 value)."""
    return codes.view(TORCH_FP8_DTYPE[fp8_format]).to(torch.bfloat16)


def pow2_to_bf16(scales: torch.Tensor, lift: int) -> torch.Tensor:
    """fp32 powers of two (>= 2^-127, or Inf / NaN) times 2^lift as bf16, exact (NaN and Inf pass through)."""
    return (scales.float() * float(2.0**lift)).to(torch.bfloat16)


_dispatch = None  # `tedebug.backends.dispatch`, imported at the first GEMM (it imports this module's users)


def _kernels(t: torch.Tensor):
    """GPU dispatch hook: the CuPy launchers when they apply to `t`, else None for the torch path."""
    global _dispatch
    if _dispatch is None:
        from tedebug.backends import dispatch

        _dispatch = dispatch
    return _dispatch.gemm_kernels(t)


def e8m0_to_bf16(codes: torch.Tensor, lift: int) -> torch.Tensor:
    """E8M0 codes (uint8) as the bf16 powers of two 2^(code - 127 + lift), built from bits (no rounding).

    ``lift`` >= 1 keeps every finite code a bf16 normal; a code + lift above 254 gives +Inf; code 255 is NaN."""
    if lift < 1:
        raise ValueError(f"e8m0_to_bf16: lift must be >= 1 (code 0 would be a bf16 subnormal), got {lift}")
    biased = codes.to(torch.int16) + lift
    bits = torch.where(biased > 254, torch.full_like(biased, _BF16_INF_BITS), biased << 7)
    bits = torch.where(codes == 255, torch.full_like(biased, _BF16_NAN_BITS), bits)
    return bits.view(torch.bfloat16)


def mxfp8_values_bf16(
    codes: torch.Tensor, scales: torch.Tensor, row_blocks: bool, fp8_format: str, lift: int
) -> torch.Tensor:
    """MXFP8 values x 2^lift as bf16 [rows, cols] (exact) from codes [rows, cols] and E8M0 scales: [rows, cols/32]
    for 1x32 blocks along the rows (`row_blocks`), else [rows/32, cols] for 32x1 blocks."""
    rows, cols = codes.shape
    kernels = _kernels(codes)
    if kernels is not None:
        return kernels.mxfp8_values(codes.contiguous(), scales.contiguous(), row_blocks, fp8_format, lift)
    values = fp8_codes_to_bf16(codes, fp8_format)
    if row_blocks:
        values = values.reshape(rows, cols // 32, 32) * e8m0_to_bf16(scales, lift).unsqueeze(-1)
    else:
        values = values.reshape(rows // 32, 32, cols) * e8m0_to_bf16(scales, lift).unsqueeze(1)
    return values.reshape(rows, cols)


def fp8_block_values_bf16(
    codes: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, fp8_format: str, lift: int
) -> torch.Tensor:
    """FP8 block values x 2^lift as bf16 [rows, cols] (exact for power-of-two scales) from codes [rows, cols] and
    fp32 scale_inv per `block_rows` x 128 block."""
    rows, cols = codes.shape
    kernels = _kernels(codes)
    if kernels is not None and cols % 8 == 0:
        return kernels.fp8_block_values(codes.contiguous(), scale_inv.contiguous(), block_rows, fp8_format, lift)
    values = fp8_codes_to_bf16(codes, fp8_format)
    scales = pow2_to_bf16(scale_inv, lift)
    if rows % block_rows == 0 and cols % 128 == 0:
        values = values.reshape(rows // block_rows, block_rows, cols // 128, 128) * scales[:, None, :, None]
        return values.reshape(rows, cols)
    return values * scales.repeat_interleave(block_rows, dim=0).repeat_interleave(128, dim=1)[:rows, :cols]


_E2M1_TABLES: Dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 values by code, bf16, one copy per device (no host-to-device copy per call)."""
    table = _E2M1_TABLES.get(device)
    if table is None:
        values = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
        table = _E2M1_TABLES[device] = torch.tensor(values, dtype=torch.bfloat16).to(device)
    return table


def nvfp4_values_bf16(packed: torch.Tensor, scale_codes: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """E2M1 values times their E4M3 block scale, as bf16 [rows, cols] (exact), from packed [rows, cols/2] bytes
    (element 2i in the low nibble) and [rows, cols/16] scale codes."""
    kernels = _kernels(packed)
    if kernels is not None:
        return kernels.nvfp4_values(packed.contiguous(), scale_codes.contiguous(), rows, cols)
    table = _e2m1_table(packed.device)
    packed = packed.reshape(rows, cols // 2)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, cols // 16, 16)
    block = fp8_codes_to_bf16(scale_codes.reshape(rows, cols // 16), E4M3).unsqueeze(-1)
    return (table[codes.long()] * block).reshape(rows, cols)
