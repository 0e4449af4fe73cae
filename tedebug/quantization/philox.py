"""Counter-based random bytes (Philox4x32-10) for NVFP4 stochastic rounding, identical on every device.

Stochastic rounding needs 8 random bits per element.  Drawing them from a `torch.Generator` ties the stream to one
device's generator (CPU and CUDA generators differ) and, on a GPU, means drawing on the CPU and copying.  A
counter-based generator computes bits from (seed, offset, index) alone, so the torch reference here and the CUDA
kernel (`kernels/philox.cu`) produce the same bytes for the same seed, in any order, with nothing to copy.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a 128-bit counter
``(c0, c1, c2, c3)`` and a 64-bit key ``(k0, k1)``; ten rounds of

    (hi0, lo0) = mulhilo32(0xD2511F53, c0);  (hi1, lo1) = mulhilo32(0xCD9E8D57, c2)
    (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)

with the key advanced by the Weyl constants (0x9E3779B9, 0xBB67AE85) between rounds.  tedebug's layout: byte i of
a draw is byte (i mod 4) (little-endian) of output word (i // 4) mod 4 of the block with counter
``(j mod 2^32, j >> 32, offset mod 2^32, offset >> 32)``, j = i // 16, under the key ``(seed mod 2^32, seed >> 32)``.
A quantizer advances `offset` by one per draw, so successive draws are independent streams.

On the CPU the bytes come from numpy (uint64 arrays hold the 64-bit products exactly); on a GPU without CuPy from
int64 torch tensors holding 32-bit values, the 64-bit products split into 16-bit halves so that nothing overflows.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from tedebug.host_numpy import numpy_on

__all__ = ["PHILOX_M", "PHILOX_W", "philox4x32_10", "philox_bytes"]

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF
_ROUNDS = 10


def _mulhilo(m: int, c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product m · c for a 32-bit constant m and int64 c in [0, 2^32)."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    c_hi, c_lo = c >> 16, c & 0xFFFF
    low_part = m_lo * c_lo + ((m_hi * c_lo + m_lo * c_hi) << 16)  # < 2^50: exact in int64
    high = m_hi * c_hi + (low_part >> 32)
    return high & _MASK32, low_part & _MASK32


def philox4x32_10(counter: Tuple[torch.Tensor, ...], key: Tuple[int, int]) -> Tuple[torch.Tensor, ...]:
    """Philox4x32-10 of int64 counter words (each in [0, 2^32), broadcastable) under a 64-bit key: 4 int64 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_bytes(seed: int, offset: int, n: int, device=None, kernel=None) -> torch.Tensor:
    """`n` random bytes (uint8, 1-D) of draw `offset` under `seed`, in tedebug's layout (see the module docstring).

    CUDA tensors come from the kernel when CuPy is available (same bytes) unless `kernel` (a
    `tedebug.backends.dispatch.KernelPreference`; None: the default) is "torch", else from this torch path."""
    seed, offset, n = int(seed) & (2**64 - 1), int(offset) & (2**64 - 1), int(n)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        from tedebug.backends import dispatch

        fast = dispatch.philox_bytes(seed, offset, n, device, kernel)
        if fast is not None:
            return fast
    if numpy_on(device):
        return torch.from_numpy(_bytes_numpy(seed, offset, n))
    return _bytes_torch(seed, offset, n, device)


def _bytes_numpy(seed: int, offset: int, n: int) -> np.ndarray:
    """The CPU path: uint64 numpy arrays hold the full 32 x 32-bit products (12-25x faster than the torch path)."""
    blocks = -(-n // 16)
    j = np.arange(blocks, dtype=np.uint64)
    c0, c1 = j & np.uint64(_MASK32), j >> np.uint64(32)
    c2 = np.full(blocks, offset & _MASK32, dtype=np.uint64)
    c3 = np.full(blocks, offset >> 32, dtype=np.uint64)
    k0, k1 = seed & _MASK32, seed >> 32
    m0, m1, mask, shift = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1]), np.uint64(_MASK32), np.uint64(32)
    for r in range(_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
        p0, p1 = c0 * m0, c2 * m1
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & mask, (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & mask
    words = np.stack((c0, c1, c2, c3), axis=-1).astype("<u4")  # [blocks, 4] little-endian 32-bit words
    return words.view(np.uint8).reshape(-1)[:n].copy()


def _bytes_torch(seed: int, offset: int, n: int, device: torch.device) -> torch.Tensor:
    """The device path without the kernel: int64 tensors, products split into 16-bit halves."""
    blocks = -(-n // 16)
    j = torch.arange(blocks, dtype=torch.int64, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    counter = (j & _MASK32, j >> 32, zero + (offset & _MASK32), zero + (offset >> 32))
    words = torch.stack(philox4x32_10(counter, (seed & _MASK32, seed >> 32)), dim=-1)  # [blocks, 4]
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=device)
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)[:n]
