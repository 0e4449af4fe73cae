// Per-tensor FP8 (tedebug.quantization.float8, bit-identical): a NaN-ignoring amax pass, the current-scaling scale
// rule on the device, and a cast + transpose that reads x [M, K] once and writes the rowwise codes [M, K] and the
// transposed columnwise codes [K, M], with fused statistics: underflows (count_nonzero(x) - non-zero codes), squared
// error (x - decode(q) * scale_inv)^2 (fp32 per element and per 32-element chunk, fp64 sums) and overflows
// (|x| > fp8_max * scale_inv in fp32), then the scale_inv partials of the decode scale and the element count
// (`ted_scale_partials_into`), so that a quantization statistics row needs nothing else.
// Fast path (used by tedebug/backends/cupy_fp8_tensor.py): `ted_fp8_amax_scale` (one launch: packed amax, atomic max,
// the last block writes amax and, for current scaling, scale and scale_inv) and `ted_fp8_cast_transpose16` (bf16 /
// fp16, M % 64 == 0, K % 128 == 0: 64 x 128 tiles, 16-byte loads, 8-byte row stores, 4x4 byte transposes in
// registers, chunk-swizzled shared memory, 16-byte transposed stores, the stats finished by the last block).
// `ted_fp8_current_cast16` is the two in one cooperative launch (a grid-wide barrier between the amax and the
// cast; the same bytes), which current scaling takes where the device holds the cast's grid at once, and
// `ted_fp8_current_stats_cast16` the same with stats.cu's statistics pass (stats_pass.cuh) as its first phase, for a
// tensor that is also logged (its basic statistics row is a lone `ted_stats` launch's, bit for bit);
// `ted_fp8_delayed_cast16` is delayed scaling's recording pass and cast in one ordinary launch (the cast needs no
// amax, so no barrier), and `ted_fp8_delayed_stats_cast16` the same with the statistics pass recording the amax.
// `ted_fp8_cast_transpose` (general) handles every other shape and fp32 inputs.  `ted_fp8_current_scale` is still
// used for empty tensors.
#include "common.cuh"
#include "stats_pass.cuh"  // stats_run: the statistics pass of the two *_stats_cast16 kernels

// TE's compute_scale_from_amax for current scaling (amax < epsilon -> epsilon; 0 / Inf / NaN amax -> 1; else
// fp8_max / amax rounded once, Inf -> FLT_MAX; pow2 rounds down to a power of two): writes scale and
// scale_inv = 1 / scale.
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

// Delayed scaling's end-of-use update (Float8Quantizer.update_scale), one block of 256 threads, in one launch:
// amax = max over the history (`algo` 0; NaN if any entry is NaN, as torch's max) or history[0] (`algo` 1), then
// the roll (entry i <- entry i+1, last <- old entry 0, entry 0 <- 0), then scale = scaled_max / amax (IEEE, an
// infinite quotient -> FLT_MAX) when amax is finite and > 0, else the scale is kept.  `scaled_max` is the fp32
// fp8_max * 2^-margin.  History entries are non-negative amaxes, NaN or +Inf: their maximum is taken on the bits.
extern "C" __global__ void __launch_bounds__(256)
ted_fp8_delayed_update(float* __restrict__ history, int len, float* __restrict__ scale, float scaled_max, int algo) {
    __shared__ unsigned int s_max;
    __shared__ int s_nan;
    if (threadIdx.x == 0) { s_max = 0u; s_nan = 0; }
    __syncthreads();
    const float first = history[0];
    unsigned int local = 0u;
    int nan = 0;
    for (int i = threadIdx.x; i < len; i += 256) {
        const float h = history[i];
        if (isnan(h)) nan = 1; else local = max(local, __float_as_uint(h) & 0x7FFFFFFFu);
    }
    atomicMax(&s_max, local);
    if (nan) atomicOr(&s_nan, 1);
    __syncthreads();
    float amax = algo == 0 ? (s_nan ? __uint_as_float(0x7FC00000u) : __uint_as_float(s_max)) : first;
    // roll: read the entries this thread rewrites before any write (entry i reads i + 1, a stride-256 walk)
    // (len <= 8 * 256, launched with 256 threads: the caller checks; fixed, unrolled indices keep `next` in
    // registers - a local-memory array makes the driver resize its local memory pool, which blocks the launch)
    float next[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int i = threadIdx.x + 256 * k;
        next[k] = i < len ? (i + 1 < len ? history[i + 1] : first) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int i = threadIdx.x + 256 * k;
        if (i < len) history[i] = i == 0 ? 0.0f : next[k];
    }
    if (threadIdx.x == 0) {
        if (isfinite(amax) && ted_nonzero(amax)) {
            float q = ted_div(scaled_max, amax);
            scale[0] = isinf(q) ? 3.402823466e+38f : q;
        }
    }
}

// out[3..7] of a cast's statistics vector: the scale_inv partials of the one decode scale s, and out[8] the number
// of elements (torch_ref.scale_inv_partials of a one-element tensor: count 1, sum s, m2 (s - s/1)^2, smallest
// non-zero s (+inf if zero), max s), so that LogFp8TensorStats builds its whole row from the vector
// (tedebug.backends.fused_stats.FP8_STATS_WITH_SCALE).  Written by one thread of the block that finished the
// vector's first three entries, in both casts.  The conversion to double is exact (ted_f2d): a subnormal scale_inv
// (a tiny amax) would be flushed to zero by the compiler's own conversion under -ftz=true.
__device__ __forceinline__ void ted_scale_partials_into(double* out, float sinv, long long numel) {
    const double s = ted_f2d(sinv);
    const double d = s - s;
    const double inf = __longlong_as_double(0x7FF0000000000000ll);
    out[3] = 1.0; out[4] = s; out[5] = d * d; out[6] = (s != 0.0) ? s : inf; out[7] = s;
    out[8] = (double)numel;  // the row's count column (exact below 2^53)
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
                       double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out) {
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
    // the last block adds the partials up (as ted_sum_columns would in a second launch: the same order)
    if (!ted_last_block(ticket)) return;
    ted_finish_columns(partial, gridDim.x, 3, out, ticket);
    if (threadIdx.x == 0) ted_scale_partials_into(out, sinv, M * K);
}


// ------------------------------------------------------------------------------------------------ fast path
// ws[0]: running amax bits (0 between launches), ws[1]: ticket, ws[2..3]: running 64-bit non-zero count (0 between
// launches).  mode 0: write amax_out[0] only; mode 1: also the current-scaling scale / scale_inv; mode 2:
// amax_out[0] = amax_out[1] = amax (NVFP4's rowwise and columnwise global amaxes); mode 3 (delayed scaling):
// amax_out[0] = maximum(amax_out[0], amax) and scale_inv_out[0] = 1 / scale_out[0].  Each thread keeps AM_ILP
// 16-byte loads in flight (predicated, so the last round is as parallel as the others); packed bf16x2 / f16x2
// maxima of |x| drop NaN.  `ted_amax_count` (NVFP4's fast kernel) also writes *nz_out = count_nonzero(x) (NaN
// counts, -0 does not), which the NVFP4 kernel needs for its underflow counts: counted here, in a pass that waits
// on memory, it costs nothing, while the quantize pass is bound by instruction issue.
#define AM_ILP 8
#if TED_DTYPE != 0
#define AM_FOLD(v) pk = ted_pmax(pk, ted_pmax(ted_pmax((v).x & 0x7FFF7FFFu, (v).y & 0x7FFF7FFFu), \
                                          ted_pmax((v).z & 0x7FFF7FFFu, (v).w & 0x7FFF7FFFu)))
#define AM_COUNT(v) (ted_pk_nonzero((v).x) + ted_pk_nonzero((v).y) + ted_pk_nonzero((v).z) + ted_pk_nonzero((v).w))
#else
#define AM_FOLD(v) am = ted_max(am, ted_max(ted_max(ted_abs(__uint_as_float((v).x)), ted_abs(__uint_as_float((v).y))), \
                                        ted_max(ted_abs(__uint_as_float((v).z)), ted_abs(__uint_as_float((v).w)))))
#define AM_COUNT(v) (((v).x & 0x7FFFFFFFu ? 1u : 0u) + ((v).y & 0x7FFFFFFFu ? 1u : 0u) + \
                     ((v).z & 0x7FFFFFFFu ? 1u : 0u) + ((v).w & 0x7FFFFFFFu ? 1u : 0u))
#endif

// Non-zero elements counted by AM_COUNT (a packed per-half count for 16-bit inputs) as one number.
__device__ __forceinline__ unsigned int am_total(unsigned int c) {
#if TED_DTYPE != 0
    return ted_pk_total(c);
#else
    return c;
#endif
}

template <bool COUNT>
__device__ __forceinline__ void am_run(const ted_raw_t* __restrict__ x, long long n, unsigned int* __restrict__ ws,
                                       float* __restrict__ amax_out, int mode, float fp8_max, float epsilon,
                                       int pow2, float* __restrict__ scale_out, float* __restrict__ scale_inv_out,
                                       unsigned long long* __restrict__ nz_out) {
    __shared__ float warp_max[32];
    __shared__ unsigned int warp_nz[32];
    const long long nvec = n / (16 / TED_ELEM_BYTES);
    const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    float am = 0.0f;
    unsigned int nz = 0u;  // per thread: < 2^32 for any tensor below 2^40 elements
#if TED_DTYPE != 0
    unsigned int pk = 0u;
#endif
    long long i = gtid;
    for (; i + (AM_ILP - 1) * stride < nvec; i += AM_ILP * stride) {  // full rounds: AM_ILP loads in flight
        uint4 v[AM_ILP];
#pragma unroll
        for (int u = 0; u < AM_ILP; ++u) v[u] = __ldcs(xv + i + u * stride);
        unsigned int c = 0u;  // <= 4 * AM_ILP per half
#pragma unroll
        for (int u = 0; u < AM_ILP; ++u) {
            AM_FOLD(v[u]);
            if (COUNT) c += AM_COUNT(v[u]);
        }
        if (COUNT) nz += am_total(c);
    }
    if (i < nvec) {  // the last, partial round (loads still issued together)
        uint4 v[AM_ILP - 1];
#pragma unroll
        for (int u = 0; u < AM_ILP - 1; ++u) {
            const long long j = i + u * stride;
            v[u] = __ldcs(xv + (j < nvec ? j : i));  // re-reading element i does not change the max (nor the count)
        }
        unsigned int c = 0u;
#pragma unroll
        for (int u = 0; u < AM_ILP - 1; ++u) {
            AM_FOLD(v[u]);
            if (COUNT && i + u * stride < nvec) c += AM_COUNT(v[u]);
        }
        if (COUNT) nz += am_total(c);
    }
#if TED_DTYPE != 0
    am = ted_max(ted_lo(pk), ted_hi(pk));
#endif
    for (long long j = nvec * (16 / TED_ELEM_BYTES) + gtid; j < n; j += stride) {
        const float v = ted_load(x, j);
        am = ted_max(am, ted_abs(v));
        if (COUNT) nz += ted_nonzero(v) ? 1u : 0u;  // bits: a subnormal counts (no flush under -ftz)
    }
    for (int off = 16; off > 0; off >>= 1) {
        am = ted_max(am, __shfl_down_sync(0xFFFFFFFFu, am, off));
        if (COUNT) nz += __shfl_down_sync(0xFFFFFFFFu, nz, off);
    }
    if ((threadIdx.x & 31) == 0) {
        warp_max[threadIdx.x >> 5] = am;
        if (COUNT) warp_nz[threadIdx.x >> 5] = nz;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long total = nz;
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            am = ted_max(am, warp_max[w]);
            if (COUNT) total += warp_nz[w];
        }
        atomicMax(ws, __float_as_uint(am));  // non-negative floats order like their bits
        if (COUNT) atomicAdd(reinterpret_cast<unsigned long long*>(ws + 2), total);
    }
    if (!ted_last_block(ws + 1)) return;
    if (threadIdx.x == 0) {
        const float amax = __uint_as_float(atomicExch(ws, 0u));
        ted_amax_outputs(amax, amax_out, mode, fp8_max, epsilon, pow2, scale_out, scale_inv_out);
        if (COUNT) *nz_out = atomicExch(reinterpret_cast<unsigned long long*>(ws + 2), 0ull);
        ws[1] = 0u;
    }
}

extern "C" __global__ void __launch_bounds__(256, 4)  // 4 blocks/SM (cupy_runtime.grid_for): 8 loads in flight
ted_fp8_amax_scale(const ted_raw_t* __restrict__ x, long long n, unsigned int* __restrict__ ws,
                   float* __restrict__ amax_out, int mode, float fp8_max, float epsilon, int pow2,
                   float* __restrict__ scale_out, float* __restrict__ scale_inv_out) {
    am_run<false>(x, n, ws, amax_out, mode, fp8_max, epsilon, pow2, scale_out, scale_inv_out, nullptr);
}

extern "C" __global__ void __launch_bounds__(256, 4)
ted_amax_count(const ted_raw_t* __restrict__ x, long long n, unsigned int* __restrict__ ws,
               float* __restrict__ amax_out, int mode, float fp8_max, float epsilon, int pow2,
               float* __restrict__ scale_out, float* __restrict__ scale_inv_out, unsigned long long* __restrict__ nz_out) {
    am_run<true>(x, n, ws, amax_out, mode, fp8_max, epsilon, pow2, scale_out, scale_inv_out, nz_out);
}

#if TED_DTYPE != 0
#define CT_M 64    // tile rows
#define CT_K 128   // tile columns

// Word address in the transposed code tile (CT_K rows of 64 bytes = 16 words): 16-byte chunk q of row k is
// stored at chunk q ^ ((k >> 3) & 3), which spreads the writers of one instruction over more banks.
__device__ __forceinline__ int ct_word(int k, int word) {
    return k * 16 + ((((word >> 2) ^ (k >> 3)) & 3) << 2) + (word & 3);
}

// A thread's 4 x 8 chunk of the tile (raw words) and its codes (row-major, 4 codes per word).
struct CtChunk { uint4 v[4]; };
struct CtCodes { unsigned int c[4][2]; double err; };

// Rare path of a chunk: exact codes (NaN -> 0x7F) and the fp64 squared error.  By value and not inlined, so the
// hot loop keeps its arrays in registers.
__device__ __noinline__ CtCodes ct_redo_chunk(const CtChunk ch, float scale, float sinv) {
    CtCodes r;
    r.err = 0.0;
    for (int i = 0; i < 4; ++i) {
        const unsigned int w[4] = {ch.v[i].x, ch.v[i].y, ch.v[i].z, ch.v[i].w};
        r.c[i][0] = 0u; r.c[i][1] = 0u;
        for (int e = 0; e < 8; ++e) {
            const float f = (e & 1) ? ted_hi(w[e >> 1]) : ted_lo(w[e >> 1]);
            const unsigned int c = ted_encode_fp8(ted_mul(f, scale));
            r.c[i][e >> 2] |= c << (8 * (e & 3));
            const double d = ted_f2d(f) - ted_f2d(ted_mul(ted_decode_fp8(c), sinv));
            r.err += d * d;
        }
    }
    return r;
}

// Rare path: elements of the chunk with thr < |x| <= Inf (fp32 bit compare; NaN excluded).
__device__ __noinline__ unsigned long long ct_count_over(const CtChunk ch, unsigned int thr_bits) {
    unsigned long long of = 0ull;
    for (int i = 0; i < 4; ++i) {
        const unsigned int w[4] = {ch.v[i].x, ch.v[i].y, ch.v[i].z, ch.v[i].w};
        for (int e = 0; e < 8; ++e) {
            const float f = (e & 1) ? ted_hi(w[e >> 1]) : ted_lo(w[e >> 1]);
            const unsigned int ab = __float_as_uint(f) & 0x7FFFFFFFu;
            of += (ab > thr_bits && ab <= 0x7F800000u) ? 1ull : 0ull;
        }
    }
    return of;
}

// The cast of `ted_fp8_cast_transpose16` and `ted_fp8_current_cast16` with the decode scale `scale` and its inverse
// `sinv`.  Thread (tx = tid % 16, ty = tid / 16) of a 256-thread block owns tile rows 4 ty .. 4 ty + 3 and columns
// 8 tx .. 8 tx + 7 of the tiles blockIdx.x, blockIdx.x + gridDim.x, ...  partial: [gridDim.x][3] = (underflows,
// sq_err, overflows); out[0..2]: the column sums; out[3..7]: the scale_inv partials, out[8] = M * K (see the end).
// Returns true in the one block that finished the statistics (the last to arrive at `ticket`, which it reset).
// With AMAX each block also folds max|x| of the words it cast (ted_pmax drops NaN, as in am_run: the same amax bit
// for bit) into *amax_bits before it takes its ticket, so the block that returns true reads the tensor's amax there.
template <bool AMAX = false>
__device__ __forceinline__ bool ct16_cast(const ted_raw_t* __restrict__ x, long long M, long long K, float scale,
                                          float sinv, float fp8_max, int do_row, int do_col,
                                          unsigned char* __restrict__ row_codes, unsigned char* __restrict__ col_codes,
                                          double* __restrict__ partial, unsigned int* __restrict__ ticket,
                                          double* __restrict__ out, unsigned int* __restrict__ amax_bits = nullptr) {
    __shared__ __align__(16) unsigned int tile_t[CT_K * 16];
    __shared__ double scratch[32];
    const float sinv_abs = ted_abs(sinv);
    const unsigned int thr_bits = __float_as_uint(ted_mul(sinv, fp8_max));
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const long long n_tk = K / CT_K;
    const long long n_tiles = (M / CT_M) * n_tk;

    unsigned long long nzx = 0ull, nzc = 0ull, of = 0ull;
    double err = 0.0;
    unsigned int tmax = 0u;  // AMAX: packed max |x| of this thread's words
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const long long m0 = (tile / n_tk) * CT_M, k0 = (tile % n_tk) * CT_K;
        const ted_raw_t* src = x + (m0 + 4 * ty) * K + k0 + 8 * tx;
        CtChunk ch;
        uint4* v = ch.v;
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = __ldcs(reinterpret_cast<const uint4*>(src + i * K));
        unsigned int codes[4][2];
        unsigned int xcnt = 0u, amx = 0u;
        float e32 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
            unsigned int q[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                xcnt += ted_pk_nonzero(w[k]);
                amx = ted_pmax(amx, w[k] & 0x7FFF7FFFu);
                const float f0 = ted_lo(w[k]), f1 = ted_hi(w[k]);
                q[k] = ted_encode_fp8x2(ted_mul(f0, scale), ted_mul(f1, scale));
                // (x - deq)^2 = (|x| - |deq|)^2: deq has the sign of x (or is 0), |deq| = |decode(q)| * |scale_inv|
                const float d0 = ted_abs_sub(f0, ted_mul(ted_mul(ted_fp8_mag(q[k], 0), TED_FP8_MAG_SCALE), sinv_abs));
                const float d1 = ted_abs_sub(f1, ted_mul(ted_mul(ted_fp8_mag(q[k], 1), TED_FP8_MAG_SCALE), sinv_abs));
                e32 = ted_fma(d0, d0, e32);
                e32 = ted_fma(d1, d1, e32);
            }
            codes[i][0] = q[0] | (q[1] << 16);
            codes[i][1] = q[2] | (q[3] << 16);
        }
        if (isfinite(e32)) {
            err += ted_f2d(e32);
        } else {  // rare: NaN / Inf (or fp32 overflow): exact NaN codes (0x7F) and the error in fp64
            const CtCodes r = ct_redo_chunk(ch, scale, sinv);
#pragma unroll
            for (int i = 0; i < 4; ++i) { codes[i][0] = r.c[i][0]; codes[i][1] = r.c[i][1]; }
            err += r.err;
        }
        // overflow: only when some |x| of this thread exceeds the threshold (amx drops NaN, keeps Inf)
        if (__float_as_uint(ted_max(ted_lo(amx), ted_hi(amx))) > thr_bits) of += ct_count_over(ch, thr_bits);
        if (AMAX) tmax = ted_pmax(tmax, amx);
        unsigned int ccnt = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) ccnt += ted_fp8x4_nonzero(codes[i][0]) + ted_fp8x4_nonzero(codes[i][1]);
        nzx += ted_pk_total(xcnt);
        nzc += ted_byte_total(ccnt);
        if (do_row) {
            unsigned char* dst = row_codes + (m0 + 4 * ty) * K + k0 + 8 * tx;
#pragma unroll
            for (int i = 0; i < 4; ++i) *reinterpret_cast<uint2*>(dst + i * K) = make_uint2(codes[i][0], codes[i][1]);
        }
        if (do_col) {
            __syncthreads();  // the previous tile's readers are done with tile_t
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned int a = codes[0][hh], b = codes[1][hh], c = codes[2][hh], d = codes[3][hh];
                const unsigned int t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(a, b, 0x7362);
                const unsigned int u0 = __byte_perm(c, d, 0x5140), u1 = __byte_perm(c, d, 0x7362);
                const int kb = 8 * tx + 4 * hh;  // tile column of byte 0
                tile_t[ct_word(kb + 0, ty)] = __byte_perm(t0, u0, 0x5410);
                tile_t[ct_word(kb + 1, ty)] = __byte_perm(t0, u0, 0x7632);
                tile_t[ct_word(kb + 2, ty)] = __byte_perm(t1, u1, 0x5410);
                tile_t[ct_word(kb + 3, ty)] = __byte_perm(t1, u1, 0x7632);
            }
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int idx = threadIdx.x + 256 * j;
                const int k = idx >> 2, q = idx & 3;
                const uint4 val = *reinterpret_cast<const uint4*>(&tile_t[ct_word(k, 4 * q)]);
                *reinterpret_cast<uint4*>(col_codes + (k0 + k) * M + m0 + 16 * q) = val;
            }
        }
    }
    if (AMAX) ted_block_amax_into(ted_max(ted_lo(tmax), ted_hi(tmax)), amax_bits);
    const double t0 = ted_block_sum((double)nzx - (double)nzc, scratch);
    const double t1 = ted_block_sum(err, scratch);
    const double t2 = ted_block_sum((double)of, scratch);
    if (threadIdx.x == 0) {
        double* p = partial + (long long)blockIdx.x * 3;
        p[0] = t0; p[1] = t1; p[2] = t2;
    }
    if (!ted_last_block(ticket)) return false;
    ted_finish_columns(partial, gridDim.x, 3, out, ticket);
    if (threadIdx.x == 0) ted_scale_partials_into(out, sinv, M * K);
    return true;
}

// The cast + transpose of a 16-bit [M, K] tensor (M % 64 == 0, K % 128 == 0) with the scale and scale_inv the
// amax pass wrote (current scaling) or the quantizer holds (delayed scaling).
extern "C" __global__ void __launch_bounds__(256)
ted_fp8_cast_transpose16(const ted_raw_t* __restrict__ x, long long M, long long K,
                         const float* __restrict__ scale_p, const float* __restrict__ scale_inv_p, float fp8_max,
                         int do_row, int do_col, unsigned char* __restrict__ row_codes,
                         unsigned char* __restrict__ col_codes, double* __restrict__ partial,
                         unsigned int* __restrict__ ticket, double* __restrict__ out) {
    ct16_cast(x, M, K, scale_p[0], scale_inv_p[0], fp8_max, do_row, do_col, row_codes, col_codes, partial, ticket,
              out);
}

// The grid-wide barrier of the cooperative one-launch kernels (every block resident at once): thread 0 of each
// block takes a ticket at ws[1]; the last one to arrive, which every other block's writes before the barrier are
// visible to, runs `last()`, resets the ticket and releases the others through the flag ws[2], on which they wait.
// The block that finishes the cast's statistics clears the flag afterwards (ct16_cast returns true there), so
// ws[1..2] are 0 between launches.
template <typename Last>
__device__ __forceinline__ void ct_grid_barrier(unsigned int* ws, Last last) {
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(ws + 1, 1u) == gridDim.x - 1) {
            last();
            ws[1] = 0u;
            __threadfence();
            atomicExch(ws + 2, 1u);
        } else {
            while (atomicAdd(ws + 2, 0u) == 0u) __nanosleep(64);
            __threadfence();
        }
    }
    __syncthreads();
}

// Current scaling in one launch: the amax pass and the cast of `ted_fp8_amax_scale` + `ted_fp8_cast_transpose16`,
// with a grid-wide barrier between them instead of a second launch (a launch costs the host 15-30 us on the lent
// H200 hosts; a small tensor's quantization is bound by that, not by the GPU).
// 1. Each block folds max|x| over the words of its own tiles (the words the cast reads: ted_pmax drops NaN, as in
//    am_run; the maximum does not depend on the order, so the amax is bit for bit the amax pass's) into ws[0]
//    (atomicMax on the bits of a non-negative float).  Loads keep the lines in L2 for the cast's second read.
// 2. Barrier: thread 0 of each block takes a ticket at ws[1]; the last one computes amax, scale and scale_inv
//    (ted_amax_outputs, mode 1: vector[0] = amax, vector[1] = scale, vector[4] = scale_inv, as the amax pass
//    writes them), resets ws[0] and ws[1], and releases the others through the flag ws[2]; they wait on it.
//    Every block must be resident at once: the host launches this kernel cooperatively (cuLaunchCooperativeKernel)
//    with the cast's own grid, and only where the occupancy allows it (cupy_fp8_tensor._fused_current).
// 3. The cast (ct16_cast) with the same grid, so the codes and the statistics are those of the two launches; the
//    block that finishes the statistics has seen every block pass the barrier, and clears the flag.
// ws[0..2] are 0 between launches (a zeroed workspace, as the other kernels' tickets).
extern "C" __global__ void __launch_bounds__(256, 4)
ted_fp8_current_cast16(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int* __restrict__ ws,
                       float* __restrict__ vector, float fp8_max, float epsilon, int pow2, int do_row, int do_col,
                       unsigned char* __restrict__ row_codes, unsigned char* __restrict__ col_codes,
                       double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out) {
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const long long n_tk = K / CT_K;
    const long long n_tiles = (M / CT_M) * n_tk;
    unsigned int pk = 0u;
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const long long m0 = (tile / n_tk) * CT_M, k0 = (tile % n_tk) * CT_K;
        const ted_raw_t* src = x + (m0 + 4 * ty) * K + k0 + 8 * tx;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 v = __ldcg(reinterpret_cast<const uint4*>(src + i * K));
            AM_FOLD(v);
        }
    }
    ted_block_amax_into(ted_max(ted_lo(pk), ted_hi(pk)), ws);
    ct_grid_barrier(ws, [&] {
        const float amax = __uint_as_float(atomicExch(ws, 0u));
        ted_amax_outputs(amax, vector, 1, fp8_max, epsilon, pow2, vector + 1, vector + 4);
    });
    const float scale = __ldcg(vector + 1), sinv = __ldcg(vector + 4);  // written by another block: through L2
    if (ct16_cast(x, M, K, scale, sinv, fp8_max, do_row, do_col, row_codes, col_codes, partial, ticket, out) &&
        threadIdx.x == 0)
        ws[2] = 0u;
}

// Current scaling in one launch for a tensor that is also logged: the statistics pass that is also the amax pass
// (`ted_stats_amax` of stats.cu) and the cast of `ted_fp8_cast_transpose16`, with the grid-wide barrier of
// `ted_fp8_current_cast16` between them.  The host launches it cooperatively with the cast's grid.
// 1. The statistics pass runs as `stats_blocks` blocks, the grid of a lone `ted_stats` launch on x: this kernel's
//    block b runs its blocks b, b + gridDim.x, ... (`stats_run` takes the block index and count it works as), so
//    every partial and the row written at stats_out are bit for bit those of `ted_stats_amax`.  The last of those
//    blocks to finish writes the row and what the amax pass writes in mode 1 (vector[0] = amax, vector[1] = scale,
//    vector[4] = scale_inv) before its own block reaches the barrier.
// 2. Barrier: thread 0 of each block takes a ticket at ws[1]; the last one resets it and releases the others
//    through the flag ws[2].  The statistics partials are all read before the release, so the cast may write its
//    own partials into the same workspace rows.
// 3. The cast (ct16_cast) with this grid, the cast's own: the codes and the statistics vector of the two launches;
//    the block that finishes the cast's statistics clears the flag.
// ws[1..2] are 0 between launches (ws[0], the amax slot of `ted_fp8_current_cast16`, is not used).
// __launch_bounds__(256, 3), the statistics pass's own: within the cast's 64 registers the pass spills to local
// memory, so at most 3 blocks per SM are resident and a cast grid above that takes the two launches.
extern "C" __global__ void __launch_bounds__(256, 3)
ted_fp8_current_stats_cast16(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int* __restrict__ ws,
                             float* __restrict__ vector, float fp8_max, float epsilon, int pow2, int do_row,
                             int do_col, unsigned char* __restrict__ row_codes, unsigned char* __restrict__ col_codes,
                             double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out,
                             unsigned int* __restrict__ stats_ticket, double* __restrict__ stats_out,
                             unsigned int stats_blocks) {
    Acc* stats_partial = reinterpret_cast<Acc*>(partial);
    for (unsigned int b = blockIdx.x; b < stats_blocks; b += gridDim.x)
        stats_run<true>(x, M * K, stats_partial, stats_ticket, stats_out, vector, 1, fp8_max, epsilon, pow2,
                        vector + 1, vector + 4, nullptr, b, stats_blocks);
    ct_grid_barrier(ws, [] {});
    const float scale = __ldcg(vector + 1), sinv = __ldcg(vector + 4);  // written by another block: through L2
    if (ct16_cast(x, M, K, scale, sinv, fp8_max, do_row, do_col, row_codes, col_codes, partial, ticket, out) &&
        threadIdx.x == 0)
        ws[2] = 0u;
}

// Delayed scaling in one launch: the recording pass (`ted_fp8_amax_scale` in mode 3) and the cast of
// `ted_fp8_cast_transpose16` together.  The cast needs only the quantizer's scale, known before the launch, and
// its inverse, which every block computes as the recording pass does (ted_div(1, scale): the same bits), so no
// block waits for another and the launch is an ordinary one.  The cast folds max|x| into ws[0] (ct16_cast<true>),
// and the block that finishes the statistics, which every other block has reached, writes what the recording pass
// writes: history[0] = maximum(history[0], amax) (NaN kept, as torch.maximum) and scale_inv_out[0] = 1 / scale;
// it resets ws[0].  ws[0] is 0 between launches.
extern "C" __global__ void __launch_bounds__(256, 4)  // the cast's 4 blocks per SM (CT_BLOCKS_PER_SM)
ted_fp8_delayed_cast16(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int* __restrict__ ws,
                       float* __restrict__ history, float* __restrict__ scale_p, float* __restrict__ scale_inv_out,
                       float fp8_max, int do_row, int do_col, unsigned char* __restrict__ row_codes,
                       unsigned char* __restrict__ col_codes, double* __restrict__ partial,
                       unsigned int* __restrict__ ticket, double* __restrict__ out) {
    const float scale = scale_p[0];
    const float sinv = ted_div(1.0f, scale);
    if (ct16_cast<true>(x, M, K, scale, sinv, fp8_max, do_row, do_col, row_codes, col_codes, partial, ticket, out,
                        ws) &&
        threadIdx.x == 0) {
        const float amax = __uint_as_float(atomicExch(ws, 0u));
        ted_amax_outputs(amax, history, 3, fp8_max, 0.0f, 0, scale_p, scale_inv_out);
    }
}

// Delayed scaling in one launch for a tensor that is also logged: the statistics pass that records the amax
// (`ted_stats_amax` in mode 3) and the cast of `ted_fp8_cast_transpose16`.  The cast needs only the quantizer's
// scale, so, as in `ted_fp8_delayed_cast16`, no block waits for another and the launch is an ordinary one:
// 1. the statistics pass as the `stats_blocks` blocks of a lone `ted_stats` launch on x (block b of this kernel runs
//    its blocks b, b + gridDim.x, ...: the row at stats_out bit for bit that launch's), whose last block writes the
//    row, history[0] = maximum(history[0], amax) and scale_inv_out[0] = 1 / scale, as the recording pass does;
// 2. the cast (ct16_cast) with this grid, the cast's own, and scale_inv = 1 / scale computed as the recording pass
//    computes it: the codes and the statistics vector of the two launches.
// The two phases run side by side in different blocks, so their partials take different workspace rows: the
// statistics pass's Acc rows first, the cast's rows after them (stats_blocks x 88 + gridDim.x x 24 bytes fit the
// workspace's 4 x 128 bytes per SM).  `ws` is not used (the signature is ted_fp8_delayed_cast16's, then the
// statistics pass's arguments).  __launch_bounds__(256, 3): the statistics pass's register budget, as in
// `ted_fp8_current_stats_cast16` (here no residency is needed: a larger grid runs in waves).
extern "C" __global__ void __launch_bounds__(256, 3)
ted_fp8_delayed_stats_cast16(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int* __restrict__ ws,
                             float* __restrict__ history, float* __restrict__ scale_p,
                             float* __restrict__ scale_inv_out, float fp8_max, int do_row, int do_col,
                             unsigned char* __restrict__ row_codes, unsigned char* __restrict__ col_codes,
                             double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out,
                             unsigned int* __restrict__ stats_ticket, double* __restrict__ stats_out,
                             unsigned int stats_blocks) {
    Acc* stats_partial = reinterpret_cast<Acc*>(partial);
    for (unsigned int b = blockIdx.x; b < stats_blocks; b += gridDim.x)
        stats_run<true>(x, M * K, stats_partial, stats_ticket, stats_out, history, 3, 0.0f, 0.0f, 0, scale_p,
                        scale_inv_out, nullptr, b, stats_blocks);
    const float scale = scale_p[0];
    const float sinv = ted_div(1.0f, scale);
    ct16_cast(x, M, K, scale, sinv, fp8_max, do_row, do_col, row_codes, col_codes,
              reinterpret_cast<double*>(stats_partial + stats_blocks), ticket, out);
}
#endif
