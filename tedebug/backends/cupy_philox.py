"""CuPy launcher of ``kernels/philox.cu``: Philox4x32-10 random bytes on the GPU, the same bytes as the CPU path of
`tedebug.quantization.philox` (stochastic rounding draws)."""

from __future__ import annotations

import numpy as np
import torch

from tedebug.backends.cupy_runtime import BLOCKS_PER_SM, THREADS, device_index, get_kernel, sm_count
from tedebug.backends.launch import launch


def philox_bytes(seed: int, offset: int, n: int, device: torch.device) -> torch.Tensor:
    """`n` Philox4x32-10 bytes of (seed, offset) on a CUDA device (`tedebug.quantization.philox`, same bytes)."""
    out = torch.empty(n, dtype=torch.uint8, device=device)
    blocks = (n + 15) // 16
    grid = max(1, min(BLOCKS_PER_SM * sm_count(device_index(device)), (blocks + THREADS - 1) // THREADS))
    args = (
        out.data_ptr(),
        np.int64(n),
        np.uint32(seed & 0xFFFFFFFF),
        np.uint32(seed >> 32),
        np.uint32(offset & 0xFFFFFFFF),
        np.uint32(offset >> 32),
    )
    launch(get_kernel("philox.cu", "ted_philox_bytes", ()), grid, THREADS, args, device)
    return out
