// Philox4x32-10 (Salmon et al., SC 2011) for the tedebug kernels: the same function as
// tedebug/quantization/philox.py (see its docstring for the layout).  Block j of draw `offset` under `seed` is
// Philox of counter (j lo, j hi, offset lo, offset hi) and key (seed lo, seed hi); its 16 bytes are bytes 16 j ..
// 16 j + 15 of the draw, little-endian words (byte i = byte i % 4 of word i / 4): exactly what a uint4 load of those
// 16 bytes from a buffer holding the draw returns.  Integer arithmetic only (exact by construction).
#pragma once

struct TedPhilox { unsigned int seed_lo, seed_hi, off_lo, off_hi; };

__device__ __forceinline__ uint4 ted_philox_block(const TedPhilox& p, unsigned long long j) {
    unsigned int c0 = (unsigned int)j, c1 = (unsigned int)(j >> 32), c2 = p.off_lo, c3 = p.off_hi;
    unsigned int k0 = p.seed_lo, k1 = p.seed_hi;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    return make_uint4(c0, c1, c2, c3);
}
