// Per-tensor FP8 (tedebug.quantization.float8, bit-identical): a NaN-ignoring amax pass, the current-scaling scale
// rule on the device, and a cast + transpose that reads x [M, K] once and writes the rowwise codes [M, K] and the
// transposed columnwise codes [K, M], with fused statistics: underflows (x != 0, code +-0), squared error
// (x - decode(q) * scale_inv)^2 (fp32 per element, fp64 sums) and overflows (|x| > fp8_max * scale_inv in fp32).
#include "common.cuh"

// amax_out must hold 0 (as uint bits) before the launch; non-negative floats order like their uint bits.
extern "C" __global__ void __launch_bounds__(256)
ted_fp8_amax(const ted_raw_t* __restrict__ x, long long n, unsigned int* __restrict__ amax_out) {
    __shared__ float warp_max[32];
    const long long nvec = n / (16 / TED_ELEM_BYTES);
    const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    float am = 0.0f;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (long long i = gtid; i < nvec; i += stride) {
        uint4 w = __ldcs(xv + i);
        float f[16 / TED_ELEM_BYTES];
        ted_unpack_word(w.x, f);
        ted_unpack_word(w.y, f + TED_PER_WORD);
        ted_unpack_word(w.z, f + 2 * TED_PER_WORD);
        ted_unpack_word(w.w, f + 3 * TED_PER_WORD);
#pragma unroll
        for (int e = 0; e < 16 / TED_ELEM_BYTES; ++e) am = ted_max(am, ted_abs(f[e]));  // max drops NaN
    }
    for (long long i = nvec * (16 / TED_ELEM_BYTES) + gtid; i < n; i += stride) am = ted_max(am, ted_abs(ted_load(x, i)));
    for (int off = 16; off > 0; off >>= 1) am = ted_max(am, __shfl_down_sync(0xFFFFFFFFu, am, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = am;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) am = ted_max(am, warp_max[w]);
        atomicMax(amax_out, __float_as_uint(am));
    }
}

// TE's compute_scale_from_amax (formats.md 2a) for current scaling: writes scale and scale_inv = 1 / scale.
extern "C" __global__ void ted_fp8_current_scale(const float* __restrict__ amax_in, float fp8_max, float epsilon,
                                                 int pow2, float* __restrict__ scale_out,
                                                 float* __restrict__ scale_inv_out) {
    float amax = amax_in[0];
    // amax >= 0 (bits compare: no flush of a subnormal amax)
    if (epsilon > 0.0f && __float_as_uint(amax) < __float_as_uint(epsilon)) amax = epsilon;
    float scale;
    if (!ted_nonzero(amax) || !isfinite(amax)) scale = 1.0f;
    else {
        scale = ted_div(fp8_max, amax);  // IEEE division, no flush
        if (isinf(scale)) scale = 3.402823466e+38f;
    }
    if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
    scale_out[0] = scale;
    scale_inv_out[0] = ted_div(1.0f, scale);
}

// scale_inv = 1 / scale for a given (delayed-scaling) scale.
extern "C" __global__ void ted_fp8_scale_inv(const float* __restrict__ scale, float* __restrict__ scale_inv_out) {
    scale_inv_out[0] = ted_div(1.0f, scale[0]);
}

#define TM 64   // tile rows (M)
#define TK 64   // tile columns (K)

// Block = 256 threads, one 64x64 tile per iteration (grid-stride over tiles).  Read: thread t handles row
// t / 16 (+16 j) and columns 4 * (t % 16) .. +3.  Write of the transpose: thread t handles output row (= input
// column) t / 16 (+16 j) and output columns (= input rows) 4 * (t % 16) .. +3.
extern "C" __global__ void __launch_bounds__(256)
ted_fp8_cast_transpose(const ted_raw_t* __restrict__ x, long long M, long long K,
                       const float* __restrict__ scale_p, const float* __restrict__ scale_inv_p, float fp8_max,
                       int do_row, int do_col,
                       unsigned char* __restrict__ row_codes, unsigned char* __restrict__ col_codes,
                       double* __restrict__ partial) {
    __shared__ unsigned char tile_codes[TM][TK + 4];
    __shared__ double scratch[32];
    const float scale = scale_p[0];
    const float sinv = scale_inv_p[0];
    const unsigned int threshold_bits = __float_as_uint(ted_mul(sinv, fp8_max));  // > 0
    const long long n_tk = (K + TK - 1) / TK;
    const long long n_tiles = ((M + TM - 1) / TM) * n_tk;
    const int tr = threadIdx.x >> 4, tc = (threadIdx.x & 15) * 4;
    const bool vec_ok = (K % 4) == 0;

    unsigned long long uf = 0ull, of = 0ull;
    double err = 0.0;
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const long long m0 = (tile / n_tk) * TM, k0 = (tile % n_tk) * TK;
#pragma unroll
        for (int j = 0; j < TM / 16; ++j) {
            const int r = tr + 16 * j;
            const long long m = m0 + r, k = k0 + tc;
            float f[4];
            int cnt = 0;
            if (m < M && vec_ok && k + 3 < K) {
                uint2 w;
                const uint2* src = reinterpret_cast<const uint2*>(x + m * K + k);
#if TED_DTYPE == 0
                const uint4 w4 = __ldcs(reinterpret_cast<const uint4*>(x + m * K + k));
                f[0] = __uint_as_float(w4.x); f[1] = __uint_as_float(w4.y);
                f[2] = __uint_as_float(w4.z); f[3] = __uint_as_float(w4.w);
                (void)w; (void)src;
#else
                w = __ldcs(src);
                ted_unpack_word(w.x, f); ted_unpack_word(w.y, f + 2);
#endif
                cnt = 4;
            } else if (m < M) {
#pragma unroll
                for (int e = 0; e < 4; ++e) f[e] = (k + e < K) ? ted_load(x, m * K + k + e) : 0.0f;
                cnt = (int)min((long long)4, max(K - k, 0ll));
            }
            unsigned int packed = 0u;
            float e32 = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = f[e];
                const unsigned int q = ted_encode_fp8(ted_mul(v, scale));
                packed |= q << (8 * e);
                const bool live = e < cnt;
                const unsigned int abits = __float_as_uint(v) & 0x7FFFFFFFu;  // |v| > thr, NaN excluded
                uf += (live && abits != 0u && ted_fp8_is_zero(q)) ? 1ull : 0ull;
                of += (live && abits <= 0x7F800000u && abits > threshold_bits) ? 1ull : 0ull;
                const float d = live ? ted_sub(v, ted_mul(ted_decode_fp8(q), sinv)) : 0.0f;
                e32 = ted_fma(d, d, e32);
            }
            if (isfinite(e32)) err += ted_f2d(e32);
            else {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (e >= cnt) break;
                    const double d = ted_f2d(f[e]) - ted_f2d(ted_mul(ted_decode_fp8((packed >> (8 * e)) & 0xFFu), sinv));
                    err += d * d;
                }
            }
            if (do_row && cnt > 0) {
                if (cnt == 4 && vec_ok) *reinterpret_cast<unsigned int*>(row_codes + m * K + k) = packed;
                else for (int e = 0; e < cnt; ++e) row_codes[m * K + k + e] = (unsigned char)(packed >> (8 * e));
            }
            *reinterpret_cast<unsigned int*>(&tile_codes[r][tc]) = packed;
        }
        if (do_col) {
            __syncthreads();
            const bool mvec = (M % 4) == 0;
#pragma unroll
            for (int j = 0; j < TK / 16; ++j) {
                const int oc = tr + 16 * j;          // tile column = output row
                const long long kk = k0 + oc, mm = m0 + tc;
                if (kk >= K || mm >= M) continue;
                unsigned int packed = 0u;
#pragma unroll
                for (int e = 0; e < 4; ++e) packed |= (unsigned int)tile_codes[tc + e][oc] << (8 * e);
                unsigned char* dst = col_codes + kk * M + mm;
                if (mvec && mm + 3 < M) *reinterpret_cast<unsigned int*>(dst) = packed;
                else for (int e = 0; e < 4 && mm + e < M; ++e) dst[e] = (unsigned char)(packed >> (8 * e));
            }
            __syncthreads();
        }
    }
    const double t0 = ted_block_sum((double)uf, scratch);
    const double t1 = ted_block_sum(err, scratch);
    const double t2 = ted_block_sum((double)of, scratch);
    if (threadIdx.x == 0) {
        double* p = partial + (long long)blockIdx.x * 3;
        p[0] = t0; p[1] = t1; p[2] = t2;
    }
}
