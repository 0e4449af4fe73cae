// MXFP8 quantize (tedebug.quantization.mxfp8, bit-identical): rowwise 1x32 and columnwise 32x1 blocks from one
// read of x [M, K] (M, K multiples of 32), with fused error statistics per direction.
// A warp owns a tile of 32 rows x (32 * CPL) columns; each lane holds CPL consecutive columns of all 32 rows in
// registers (4- or 8-byte loads).  Column amax = per-lane max over the 32 rows; row amax = max over the LPB = 32/CPL lanes
// of one 32-column block (xor shuffles).  Per element and direction: q = satfinite-RNE-FP8(x * 2^(127-code)),
// deq = decode(q) * 2^(code-127) in fp32, error (x - deq)^2 summed in fp32 per 32 elements then in fp64, and an
// underflow when x != 0 but q is +-0.  Outputs: codes (uint8 [M, K] each), scales (row [M, K/32], col [M/32, K]),
// and per-block partials [grid, 4] = (row underflows, row sq_err, col underflows, col sq_err) for ted_sum_columns.
#include "common.cuh"

#define CPL 2   // columns per lane (64 fp32 values of a 32-row tile in registers)
#define LPB (32 / CPL)
#define TILE_W (32 * CPL)

__device__ __forceinline__ void load_row(const ted_raw_t* p, float* f) {
#if TED_DTYPE == 0
    uint2 w = __ldcs(reinterpret_cast<const uint2*>(p));
    f[0] = __uint_as_float(w.x); f[1] = __uint_as_float(w.y);
#else
    ted_unpack_word(__ldcs(reinterpret_cast<const unsigned int*>(p)), f);
#endif
}

__device__ __forceinline__ float quant_err(float v, float mult, float sinv, unsigned int& code, unsigned int& uf) {
    code = ted_encode_fp8(ted_mul(v, mult));
    float deq = ted_mul(ted_decode_fp8(code), sinv);
    uf += (ted_nonzero(v) && ted_fp8_is_zero(code)) ? 1u : 0u;
    float d = ted_sub(v, deq);
    return ted_mul(d, d);
}

// Recompute a direction's squared error in fp64 when the fp32 sum is not finite (Inf / NaN / overflow).
__device__ __forceinline__ double err64(float v, unsigned int code, float sinv) {
    double d = ted_f2d(v) - ted_f2d(ted_mul(ted_decode_fp8(code), sinv));
    return d * d;
}

extern "C" __global__ void __launch_bounds__(256)
ted_mxfp8_quantize(const ted_raw_t* __restrict__ x, long long M, long long K, float inv_fp8_max,
                   int do_row, int do_col,
                   unsigned char* __restrict__ row_codes, unsigned char* __restrict__ row_scales,
                   unsigned char* __restrict__ col_codes, unsigned char* __restrict__ col_scales,
                   double* __restrict__ partial) {
    __shared__ double scratch[32];
    const int lane = threadIdx.x & 31;
    const long long warps_total = (long long)gridDim.x * (blockDim.x >> 5);
    const long long warp_id = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long n_tc = (K + TILE_W - 1) / TILE_W;
    const long long n_tiles = (M / 32) * n_tc;

    double row_err = 0.0, col_err = 0.0;
    unsigned long long row_uf = 0ull, col_uf = 0ull;

    for (long long tile = warp_id; tile < n_tiles; tile += warps_total) {
        const long long r0 = (tile / n_tc) * 32;
        const long long c0 = (tile % n_tc) * TILE_W + (long long)lane * CPL;
        const bool active = c0 < K;   // K % 32 == 0: a 32-column block is either all in or all out
        float v[32][CPL];
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            if (active) load_row(x + (r0 + r) * K + c0, v[r]);
            else {
#pragma unroll
                for (int c = 0; c < CPL; ++c) v[r][c] = 0.0f;
            }
        }
        // ---- columnwise: scales from the per-lane amax over 32 rows
        float col_mult[CPL], col_sinv[CPL];
        unsigned int col_code_s[CPL];
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
            float am = 0.0f;
#pragma unroll
            for (int r = 0; r < 32; ++r) am = ted_max(am, ted_abs(v[r][c]));  // max drops NaN
            col_code_s[c] = ted_e8m0_rceil(ted_mul(am, inv_fp8_max));
            col_mult[c] = ted_e8m0_encode_multiplier(col_code_s[c]);
            col_sinv[c] = ted_e8m0_to_float(col_code_s[c]);
        }
        if (do_col && active) {
            unsigned int packed = 0u;
#pragma unroll
            for (int c = 0; c < CPL; ++c) packed |= col_code_s[c] << (8 * c);
            unsigned char* dst = col_scales + (r0 / 32) * K + c0;
#if CPL == 4
            *reinterpret_cast<unsigned int*>(dst) = packed;
#else
            *reinterpret_cast<unsigned short*>(dst) = (unsigned short)packed;
#endif
        }
        float col_e32[CPL];
        unsigned int cuf = 0u;
#pragma unroll
        for (int c = 0; c < CPL; ++c) col_e32[c] = 0.0f;
        unsigned int ruf = 0u;
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            // ---- rowwise block amax across the LPB lanes of this 32-column block
            float am = 0.0f;
#pragma unroll
            for (int c = 0; c < CPL; ++c) am = ted_max(am, ted_abs(v[r][c]));
#pragma unroll
            for (int off = 1; off < LPB; off <<= 1) am = ted_max(am, __shfl_xor_sync(0xFFFFFFFFu, am, off));
            const unsigned int rcode = ted_e8m0_rceil(ted_mul(am, inv_fp8_max));
            const float rmult = ted_e8m0_encode_multiplier(rcode);
            const float rsinv = ted_e8m0_to_float(rcode);
            unsigned int rpacked = 0u, cpacked = 0u;
            float re = 0.0f;
#pragma unroll
            for (int c = 0; c < CPL; ++c) {
                unsigned int q;
                if (do_row) {
                    re = ted_add(re, quant_err(v[r][c], rmult, rsinv, q, ruf));
                    rpacked |= q << (8 * c);
                }
                if (do_col) {
                    col_e32[c] = ted_add(col_e32[c], quant_err(v[r][c], col_mult[c], col_sinv[c], q, cuf));
                    cpacked |= q << (8 * c);
                }
            }
            if (do_row) {
                if (isfinite(re)) row_err += ted_f2d(re);
                else {  // Inf / NaN element or fp32 overflow: redo this lane's share of the row in fp64
#pragma unroll
                    for (int c = 0; c < CPL; ++c) row_err += err64(v[r][c], (rpacked >> (8 * c)) & 0xFFu, rsinv);
                }
            }
            if (active) {
                const long long off = (r0 + r) * K + c0;
                if (do_row) {
#if CPL == 4
                    *reinterpret_cast<unsigned int*>(row_codes + off) = rpacked;
#else
                    *reinterpret_cast<unsigned short*>(row_codes + off) = (unsigned short)rpacked;
#endif
                    if ((lane % LPB) == 0) row_scales[(r0 + r) * (K / 32) + c0 / 32] = (unsigned char)rcode;
                }
                if (do_col) {
#if CPL == 4
                    *reinterpret_cast<unsigned int*>(col_codes + off) = cpacked;
#else
                    *reinterpret_cast<unsigned short*>(col_codes + off) = (unsigned short)cpacked;
#endif
                }
            }
        }
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
            if (!do_col) continue;
            if (isfinite(col_e32[c])) col_err += ted_f2d(col_e32[c]);
            else {  // Inf / NaN element or fp32 overflow: redo the column block in fp64
#pragma unroll
                for (int r = 0; r < 32; ++r)
                    col_err += err64(v[r][c], ted_encode_fp8(ted_mul(v[r][c], col_mult[c])), col_sinv[c]);
            }
        }
        row_uf += ruf;
        col_uf += cuf;
    }
    double t0 = ted_block_sum((double)row_uf, scratch);
    double t1 = ted_block_sum(row_err, scratch);
    double t2 = ted_block_sum((double)col_uf, scratch);
    double t3 = ted_block_sum(col_err, scratch);
    if (threadIdx.x == 0) {
        double* p = partial + (long long)blockIdx.x * 4;
        p[0] = t0; p[1] = t1; p[2] = t2; p[3] = t3;
    }
}
