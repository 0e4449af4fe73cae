// Counter-based random bytes for NVFP4 stochastic rounding: Philox4x32-10, bit-identical to
// tedebug/quantization/philox.py (the torch reference used on the CPU and by the tests).
//
// The algorithm is in philox.cuh (shared with the NVFP4 kernels, which draw their bits in place).
// Algorithm (Salmon et al., SC 2011): counter (c0, c1, c2, c3), key (k0, k1); ten rounds of
//   hi0:lo0 = 0xD2511F53 * c0,  hi1:lo1 = 0xCD9E8D57 * c2   (full 64-bit products, __umulhi for the high words)
//   (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
// with the key advanced by (0x9E3779B9, 0xBB67AE85) between rounds (unsigned 32-bit wrap-around).
// Layout (the reference's): thread j computes block j with counter (j lo, j hi, offset lo, offset hi) under the key
// (seed lo, seed hi) and writes its four output words as 16 little-endian bytes at out[16 j]; the last block is cut
// at n.  Integer arithmetic only: no rounding question, so equality with the reference is exact by construction.
// Cost: one thread per 16 bytes, about 100 integer instructions per thread; one 16-byte store (n multiple of 16 and
// a 16-byte aligned output, which torch's allocator gives) or byte stores for the tail.

#include "philox.cuh"

extern "C" __global__ void __launch_bounds__(256)
ted_philox_bytes(unsigned char* __restrict__ out, long long n, unsigned int seed_lo, unsigned int seed_hi,
                 unsigned int offset_lo, unsigned int offset_hi) {
    const TedPhilox p = {seed_lo, seed_hi, offset_lo, offset_hi};
    const long long blocks = (n + 15) / 16;
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < blocks;
         j += (long long)gridDim.x * blockDim.x) {
        const uint4 w = ted_philox_block(p, (unsigned long long)j);
        const long long base = 16 * j;
        if (base + 16 <= n) {
            *reinterpret_cast<uint4*>(out + base) = w;
        } else {
            for (long long i = base; i < n; ++i) {  // (selects, not an indexed array: no local memory)
                const int q = (int)((i - base) / 4);
                const unsigned int v = q == 0 ? w.x : (q == 1 ? w.y : (q == 2 ? w.z : w.w));
                out[i] = (unsigned char)(v >> (8 * ((i - base) % 4)));
            }
        }
    }
}
