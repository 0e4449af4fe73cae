// FP8 block-scaling quantize (tedebug.quantization.float8_block, bit-identical): 1x128 blocks
// (`ted_fp8_block_quantize_1d`) or 128x128 tiles (`ted_fp8_block_quantize_2d`) of x [M, K] (any M, K >= 1; partial
// blocks are zero-padded for the amax, as the reference does), rowwise codes [M, K] and columnwise codes of the
// transposed view [K, M] from one read of x, fp32 scale_inv in the reference's unpadded layout, and the fused
// error statistics of each direction: underflows (count_nonzero(x) - non-zero codes) and Σ (x - deq)².
//
// Work unit: one 128 x 128 tile of x per block iteration (grid-stride over tiles), 256 threads (8 warps).  Every
// load is 16 bytes (FB_EPC elements: 8 bf16/fp16 or 4 fp32).  Warp w owns tile rows 16w .. 16w+15; a lane owns
// FB_R consecutive rows (8 for 16-bit inputs: lanes 0-15 rows 16w..16w+7, lanes 16-31 rows 16w+8..16w+15; 16 for
// fp32) and FB_EPC consecutive columns (chunk c = lane % FB_CPR), held in registers for the whole tile.
// - 1x128 rowwise: the lane's per-row partial maxima are reduce-scattered over the FB_CPR lanes of its row group
//   (lane ends with the amax of row (lane >> 1) & (FB_R - 1)), each lane computes that row's scale, and row i's
//   multiplier / decode scale are fetched with a shuffle when row i is quantized.
// - 1x128 columnwise (blocks of 128 along M = one tile column): per-lane column maxima go to shared memory, thread
//   t < 128 reduces column t over the 16 row groups and publishes the column's scale.
// - 128x128: one amax per tile (warp reduce + shared memory); the columnwise codes are the rowwise codes.
// - Scale rule (TE's current-scaling rule applied to each block, = formats.compute_scale_from_amax): amax <
//   epsilon -> epsilon; 0 / Inf / NaN amax -> 1; else fp8_max / amax (IEEE), Inf -> the input dtype's max; pow2
//   keeps sign + exponent bits; scale_inv = 1 / scale (IEEE).  Codes: satfinite-RNE-FP8(x * scale), NaN -> 0x7F.
// - Columnwise codes: 4x4 byte transposes in registers (__byte_perm); the lane's FB_R rows of one column become
//   FB_R contiguous bytes of the transposed output (8- or 16-byte stores).
// - Error: (|x| - |decode(q)| * scale_inv)² summed in fp32 over one chunk (FB_EPC elements) then in fp64; a
//   non-finite chunk sum (Inf / NaN input, fp32 overflow) is redone in fp64 with exact codes.  The last block
//   (atomic ticket) writes out[4] = (row underflows, row Σerr², col underflows, col Σerr²).
// All fp32 arithmetic that must match torch goes through common.cuh's inline-PTX helpers (CuPy adds -ftz=true).
#include "common.cuh"

#define FB_TILE 128
#define FB_THREADS 256
#if TED_DTYPE == 0
#define FB_EPC 4  // elements per 16-byte chunk: 8 (16-bit) or 4 (fp32); a preprocessor constant (no sizeof)
#else
#define FB_EPC 8
#endif
#define FB_CPR (FB_TILE / FB_EPC)     // chunks per tile row: 16 or 32
#define FB_GROUPS (32 / FB_CPR)       // row groups per warp: 2 or 1
#define FB_R (16 / FB_GROUPS)         // rows per lane: 8 or 16
#define FB_CW (FB_EPC / 4)            // code words per chunk: 2 or 1
#define FB_RG (8 * FB_GROUPS)         // row groups per tile: 16 or 8
// 16-bit inputs: the next tile's chunks stream into shared memory (cp.async, 32 KB per block) while this tile is
// processed; fp32 tiles (64 KB) load directly.
#ifndef FB_STAGE
#if TED_DTYPE != 0
#define FB_STAGE 1
#else
#define FB_STAGE 0
#endif
#endif
#ifndef FB_MIN_BLOCKS
#define FB_MIN_BLOCKS 2  // resident blocks per SM (register cap); cupy_fp8_block.FB_BLOCKS_PER_SM must match
#endif

// ------------------------------------------------------------------------------------------------ element access
__device__ __forceinline__ unsigned int fb_word(const uint4& v, int j) {
    return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}

// Element e (0 .. FB_EPC-1) of a 16-byte chunk, exactly, as fp32.
__device__ __forceinline__ float fb_elem(const uint4& v, int e) {
#if TED_DTYPE == 0
    return __uint_as_float(fb_word(v, e));
#else
    const unsigned int w = fb_word(v, e >> 1);
    return (e & 1) ? ted_hi(w) : ted_lo(w);
#endif
}

// Non-zero elements of a chunk (NaN counts, ±0 does not).
__device__ __forceinline__ unsigned int fb_nonzero(const uint4& v) {
#if TED_DTYPE == 0
    return (unsigned int)ted_nonzero(__uint_as_float(v.x)) + (unsigned int)ted_nonzero(__uint_as_float(v.y)) +
           (unsigned int)ted_nonzero(__uint_as_float(v.z)) + (unsigned int)ted_nonzero(__uint_as_float(v.w));
#else
    return ted_pk_total(ted_pk_nonzero(v.x) + ted_pk_nonzero(v.y) + ted_pk_nonzero(v.z) + ted_pk_nonzero(v.w));
#endif
}

// Whether the chunk of row m starting at column k lies inside x with 16-byte aligned rows (`vec`: K % FB_EPC == 0).
__device__ __forceinline__ bool fb_full(long long M, long long K, long long m, long long k, bool vec) {
    return m < M && vec && k + FB_EPC <= K;
}

// The chunk of row m starting at column k: one 16-byte streaming load when it is full (fb_full), else element by
// element; elements outside x read as +0.
__device__ __forceinline__ uint4 fb_load(const ted_raw_t* __restrict__ x, long long M, long long K, long long m,
                                         long long k, bool vec) {
    if (m >= M) return make_uint4(0u, 0u, 0u, 0u);
    const ted_raw_t* p = x + m * K + k;
    if (vec && k + FB_EPC <= K) return __ldcs(reinterpret_cast<const uint4*>(p));
    unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < FB_EPC; ++e) {
        if (k + e < K) w[e / TED_PER_WORD] |= (unsigned int)p[e] << (8 * TED_ELEM_BYTES * (e % TED_PER_WORD));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The lane's first row m and first column k in `tile` (row group rg, chunk c).
__device__ __forceinline__ void fb_origin(long long tile, long long n_kt, int rg, int c, long long& m, long long& k) {
    m = (tile / n_kt) * FB_TILE + (long long)rg * FB_R;
    k = (tile % n_kt) * FB_TILE + (long long)c * FB_EPC;
}

#if FB_STAGE
// Start the asynchronous copy of the lane's full chunks of the tile at (m, k) into its own slots stage[i][thread]
// (partial chunks are loaded directly by fb_fetch).  Each thread reads back only what it copied: no barrier.
__device__ __forceinline__ void fb_prefetch(const ted_raw_t* __restrict__ x, long long M, long long K, long long m,
                                            long long k, bool vec, uint4 (*stage)[FB_THREADS]) {
#pragma unroll
    for (int i = 0; i < FB_R; ++i) {
        if (!fb_full(M, K, m + i, k, vec)) continue;
        const unsigned int saddr = (unsigned int)__cvta_generic_to_shared(&stage[i][threadIdx.x]);
        const ted_raw_t* src = x + (m + i) * K + k;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(src) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
#endif

// The lane's FB_R chunks of the tile at (m, k): from its shared-memory slots when staged, else from global memory.
__device__ __forceinline__ void fb_fetch(const ted_raw_t* __restrict__ x, long long M, long long K, long long m,
                                         long long k, bool vec, uint4 (*stage)[FB_THREADS], uint4 (&v)[FB_R]) {
#if FB_STAGE
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < FB_R; ++i)
        v[i] = fb_full(M, K, m + i, k, vec) ? stage[i][threadIdx.x] : fb_load(x, M, K, m + i, k, vec);
#else
    (void)stage;
#pragma unroll
    for (int i = 0; i < FB_R; ++i) v[i] = fb_load(x, M, K, m + i, k, vec);
#endif
}

// After the current chunks have been consumed (their values used, so the shared-memory reads are complete): start
// the copy of the block's next tile.
__device__ __forceinline__ void fb_next(const ted_raw_t* __restrict__ x, long long M, long long K, long long n_kt,
                                        long long n_tiles, long long tile, int rg, int c, bool vec,
                                        uint4 (*stage)[FB_THREADS]) {
#if FB_STAGE
    const long long next = tile + gridDim.x;
    if (next < n_tiles) {
        long long m, k;
        fb_origin(next, n_kt, rg, c, m, k);
        fb_prefetch(x, M, K, m, k, vec, stage);
    }
#else
    (void)x; (void)M; (void)K; (void)n_kt; (void)n_tiles; (void)tile; (void)rg; (void)c; (void)vec; (void)stage;
#endif
}

// The block's first tile, staged before the loop.
__device__ __forceinline__ void fb_first(const ted_raw_t* __restrict__ x, long long M, long long K, long long n_kt,
                                         long long n_tiles, int rg, int c, bool vec, uint4 (*stage)[FB_THREADS]) {
    fb_next(x, M, K, n_kt, n_tiles, (long long)blockIdx.x - gridDim.x, rg, c, vec, stage);
}

// ------------------------------------------------------------------------------------------------ scales
__device__ __forceinline__ bool fb_finite(float a) { return (__float_as_uint(a) & 0x7FFFFFFFu) < 0x7F800000u; }

// formats.compute_scale_from_amax for one block amax (>= 0, never -0): scale and scale_inv = 1 / scale.
__device__ __forceinline__ void fb_scale(float amax, float fp8_max, float epsilon, int pow2, float value_for_inf,
                                         float& scale, float& sinv) {
    if (__float_as_uint(amax) < __float_as_uint(epsilon)) amax = epsilon;  // both >= 0: bit order = value order
    if (!ted_nonzero(amax) || !fb_finite(amax)) {
        scale = 1.0f;
    } else {
        scale = ted_div(fp8_max, amax);
        if (!fb_finite(scale)) scale = value_for_inf;
    }
    if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
    sinv = ted_div(1.0f, scale);
}

// ------------------------------------------------------------------------------------------------ quantize
struct FbMul { float mult[FB_EPC]; float sinv[FB_EPC]; };  // per element of a chunk
struct FbRedo { unsigned int c[FB_CW]; double err; };

// Codes of one chunk (FB_CW words, element e in byte e) and the fp32 sum of its squared errors.  (x - deq)² =
// (|x| - |deq|)² since deq has the sign of x or is 0; |deq| = |decode(q)| * scale_inv, decode(q) exact.  NaN inputs
// give hardware NaN codes and a NaN sum: the caller redoes such chunks with fb_redo.
__device__ __forceinline__ float fb_quant(const uint4& v, const FbMul& s, unsigned int* codes) {
    float err = 0.0f;
#pragma unroll
    for (int j = 0; j < FB_CW; ++j) codes[j] = 0u;
#pragma unroll
    for (int p = 0; p < FB_EPC / 2; ++p) {
        const float f0 = fb_elem(v, 2 * p), f1 = fb_elem(v, 2 * p + 1);
        const unsigned int q = ted_encode_fp8x2(ted_mul(f0, s.mult[2 * p]), ted_mul(f1, s.mult[2 * p + 1]));
        const float d0 = ted_abs_sub(f0, ted_mul(ted_mul(ted_fp8_mag(q, 0), TED_FP8_MAG_SCALE), s.sinv[2 * p]));
        const float d1 = ted_abs_sub(f1, ted_mul(ted_mul(ted_fp8_mag(q, 1), TED_FP8_MAG_SCALE), s.sinv[2 * p + 1]));
        err = ted_fma(d0, d0, err);
        err = ted_fma(d1, d1, err);
        codes[p >> 1] |= q << (16 * (p & 1));
    }
    return err;
}

// Rare path (a non-finite fp32 chunk sum): exact codes (NaN -> 0x7F) and the fp64 squared error.  By value and not
// inlined, so the hot loop keeps its arrays in registers.
__device__ __noinline__ FbRedo fb_redo(const uint4 v, const FbMul s) {
    FbRedo r;
    r.err = 0.0;
    for (int j = 0; j < FB_CW; ++j) r.c[j] = 0u;
    for (int e = 0; e < FB_EPC; ++e) {
        const float f = fb_elem(v, e);
        const unsigned int q = ted_encode_fp8(ted_mul(f, s.mult[e]));
        r.c[e >> 2] |= q << (8 * (e & 3));
        const double d = ted_f2d(f) - ted_f2d(ted_mul(ted_decode_fp8(q), s.sinv[e]));
        r.err += d * d;
    }
    return r;
}

// Quantize one chunk, fixing the codes and using fp64 when the fp32 sum is not finite; adds to err / nz.
__device__ __forceinline__ void fb_chunk(const uint4& v, const FbMul& s, unsigned int* codes, double& err,
                                         unsigned int& nz) {
    const float e32 = fb_quant(v, s, codes);
    if (fb_finite(e32)) {
        err += ted_f2d(e32);
    } else {
        const FbRedo r = fb_redo(v, s);
#pragma unroll
        for (int j = 0; j < FB_CW; ++j) codes[j] = r.c[j];
        err += r.err;
    }
#pragma unroll
    for (int j = 0; j < FB_CW; ++j) nz += ted_byte_total(ted_fp8x4_nonzero(codes[j]));
}

// ------------------------------------------------------------------------------------------------ stores
// Row codes of one chunk at row m, column k of [M, K] (8 / 4 bytes at once when aligned and inside).
__device__ __forceinline__ void fb_store_row(unsigned char* __restrict__ dst, long long M, long long K, long long m,
                                             long long k, bool vec, const unsigned int* codes) {
    if (m >= M || k >= K) return;
    unsigned char* p = dst + m * K + k;
    if (vec && k + FB_EPC <= K) {
#if FB_CW == 2
        *reinterpret_cast<uint2*>(p) = make_uint2(codes[0], codes[1]);
#else
        *reinterpret_cast<unsigned int*>(p) = codes[0];
#endif
        return;
    }
#pragma unroll
    for (int e = 0; e < FB_EPC; ++e) {
        if (k + e < K) p[e] = (unsigned char)(codes[e >> 2] >> (8 * (e & 3)));
    }
}

// 4x4 byte transpose: out[e] byte i = in[i] byte e.
__device__ __forceinline__ void fb_transpose4(unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                              unsigned int* out) {
    const unsigned int x0 = __byte_perm(a0, a1, 0x5140), x1 = __byte_perm(a0, a1, 0x7362);
    const unsigned int y0 = __byte_perm(a2, a3, 0x5140), y1 = __byte_perm(a2, a3, 0x7362);
    out[0] = __byte_perm(x0, y0, 0x5410);
    out[1] = __byte_perm(x0, y0, 0x7632);
    out[2] = __byte_perm(x1, y1, 0x5410);
    out[3] = __byte_perm(x1, y1, 0x7632);
}

// Columnwise codes: the lane's FB_R rows (starting at tile-global row m) x FB_EPC columns (starting at column k) of
// codes, written transposed into [K, M]: for each column, FB_R contiguous bytes at (k + e) * M + m.
__device__ __forceinline__ void fb_store_col(unsigned char* __restrict__ dst, long long M, long long K, long long m,
                                             long long k, const unsigned int (*cc)[FB_CW]) {
    // t[e][b]: column e, rows 4b .. 4b+3 (byte i = row 4b + i)
    unsigned int t[FB_EPC][FB_R / 4];
#pragma unroll
    for (int b = 0; b < FB_R / 4; ++b) {
#pragma unroll
        for (int j = 0; j < FB_CW; ++j) {
            unsigned int o[4];
            fb_transpose4(cc[4 * b][j], cc[4 * b + 1][j], cc[4 * b + 2][j], cc[4 * b + 3][j], o);
#pragma unroll
            for (int e = 0; e < 4; ++e) t[4 * j + e][b] = o[e];
        }
    }
    if (m >= M) return;
    const bool full = (M % FB_R) == 0 && m + FB_R <= M;
#pragma unroll
    for (int e = 0; e < FB_EPC; ++e) {
        if (k + e >= K) break;
        unsigned char* p = dst + (k + e) * M + m;
        if (full) {
#if FB_R == 8
            *reinterpret_cast<uint2*>(p) = make_uint2(t[e][0], t[e][1]);
#else
            *reinterpret_cast<uint4*>(p) = make_uint4(t[e][0], t[e][1], t[e][2], t[e][3]);
#endif
        } else {
#pragma unroll
            for (int i = 0; i < FB_R; ++i) {
                if (m + i < M) p[i] = (unsigned char)(t[e][i >> 2] >> (8 * (i & 3)));
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------ reductions
// Reduce-scatter of per-row maxima over the FB_CPR lanes of a row group (xor offsets < FB_CPR): returns the max
// over those lanes of row (lane >> 1) & (FB_R - 1).  Each step keeps half the rows (upper lanes the upper half).
__device__ __forceinline__ float fb_row_amax(float (&v)[FB_R], int lane) {
#pragma unroll
    for (int n = FB_R / 2, off = FB_CPR / 2; n >= 1; n >>= 1, off >>= 1) {
        const bool upper = (lane & off) != 0;
#pragma unroll
        for (int j = 0; j < n; ++j) {
            const float send = upper ? v[j] : v[j + n];
            const float keep = upper ? v[j + n] : v[j];
            v[j] = ted_max(keep, __shfl_xor_sync(0xFFFFFFFFu, send, off));
        }
    }
    return ted_max(v[0], __shfl_xor_sync(0xFFFFFFFFu, v[0], 1));  // FB_CPR == 2 * FB_R: the last offset is 1
}

// Per-block statistics, then the last block sums them: out = (row uf, row err, col uf, col err).
__device__ __forceinline__ void fb_finish(unsigned long long nzx, unsigned long long nz_row, double row_err,
                                          unsigned long long nz_col, double col_err, double* __restrict__ partial,
                                          unsigned int* __restrict__ ticket, double* __restrict__ out) {
    ted_store_dir_stats((double)nzx - (double)nz_row, row_err, (double)nzx - (double)nz_col, col_err, partial);
    if (ted_last_block(ticket)) ted_finish_columns(partial, gridDim.x, 4, out, ticket);
}

// ------------------------------------------------------------------------------------------------ kernels
// Arguments shared by both kernels.  row_sinv / col_sinv: fp32 scale_inv arrays; 1d: [M, ceil(K/128)] and
// [K, ceil(M/128)]; 2d: [ceil(M/128), ceil(K/128)] and its transpose.  Absent directions: null pointers, do_* = 0.
#if FB_STAGE
#define FB_STAGE_DECL __shared__ __align__(16) uint4 stage[FB_R][FB_THREADS];  // 32 KB
#else
#define FB_STAGE_DECL uint4 (*stage)[FB_THREADS] = nullptr;
#endif

#define FB_PARAMS                                                                                               \
    const ted_raw_t *__restrict__ x, long long M, long long K, float fp8_max, float epsilon, int pow2,          \
        float value_for_inf, int do_row, int do_col, unsigned char *__restrict__ row_codes,                     \
        float *__restrict__ row_sinv, unsigned char *__restrict__ col_codes, float *__restrict__ col_sinv,      \
        double *__restrict__ partial, unsigned int *__restrict__ ticket, double *__restrict__ out

extern "C" __global__ void __launch_bounds__(FB_THREADS, FB_MIN_BLOCKS) ted_fp8_block_quantize_1d(FB_PARAMS) {
    __shared__ __align__(16) float col_part[FB_RG][FB_TILE];  // per row group: column maxima of its FB_R rows
    __shared__ __align__(16) float col_mult[FB_TILE];
    __shared__ __align__(16) float col_scinv[FB_TILE];
    FB_STAGE_DECL
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int grp = lane / FB_CPR, c = lane % FB_CPR;
    const int rg = wid * FB_GROUPS + grp;
    const long long n_mt = (M + FB_TILE - 1) / FB_TILE, n_kt = (K + FB_TILE - 1) / FB_TILE;
    const long long n_tiles = n_mt * n_kt;
    const bool vec = (K % FB_EPC) == 0;

    unsigned long long nzx = 0ull, nz_row = 0ull, nz_col = 0ull;
    double row_err = 0.0, col_err = 0.0;
    fb_first(x, M, K, n_kt, n_tiles, rg, c, vec, stage);
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const long long mt = tile / n_kt, kt = tile % n_kt;
        long long m, k;  // the lane's first row and column
        fb_origin(tile, n_kt, rg, c, m, k);
        uint4 v[FB_R];
        fb_fetch(x, M, K, m, k, vec, stage, v);

        float rmax[FB_R], cmax[FB_EPC];
        unsigned int cnt = 0u;
#pragma unroll
        for (int e = 0; e < FB_EPC; ++e) cmax[e] = 0.0f;
#pragma unroll
        for (int i = 0; i < FB_R; ++i) {
            rmax[i] = 0.0f;
            cnt += fb_nonzero(v[i]);
#pragma unroll
            for (int e = 0; e < FB_EPC; ++e) {
                const float a = ted_abs(fb_elem(v[i], e));
                rmax[i] = ted_max(rmax[i], a);  // max drops NaN
                cmax[e] = ted_max(cmax[e], a);
            }
        }
        nzx += cnt;
        fb_next(x, M, K, n_kt, n_tiles, tile, rg, c, vec, stage);
#pragma unroll
        for (int e = 0; e < FB_EPC; e += 4)
            *reinterpret_cast<float4*>(&col_part[rg][c * FB_EPC + e]) =
                make_float4(cmax[e], cmax[e + 1], cmax[e + 2], cmax[e + 3]);

        // rowwise: this lane computes the scale of row (lane >> 1) & (FB_R - 1) of its group
        float my_mult = 1.0f, my_sinv = 1.0f;
        if (do_row) {
            const float am = fb_row_amax(rmax, lane);
            fb_scale(am, fp8_max, epsilon, pow2, value_for_inf, my_mult, my_sinv);
            const long long row = m + ((lane >> 1) & (FB_R - 1));
            if ((lane & 1) == 0 && row < M) row_sinv[row * n_kt + kt] = my_sinv;
        }
        __syncthreads();  // col_part complete; the previous tile's col_mult / col_scinv readers are done
        if (threadIdx.x < FB_TILE) {
            const int t = threadIdx.x;
            float am = col_part[0][t];
#pragma unroll
            for (int g = 1; g < FB_RG; ++g) am = ted_max(am, col_part[g][t]);
            float mult, sinv;
            fb_scale(am, fp8_max, epsilon, pow2, value_for_inf, mult, sinv);
            col_mult[t] = mult;
            col_scinv[t] = sinv;
            const long long kk = kt * FB_TILE + t;
            if (do_col && kk < K) col_sinv[kk * n_mt + mt] = sinv;
        }
        __syncthreads();  // col_mult / col_scinv complete; col_part readers are done

        FbMul cs;
#pragma unroll
        for (int e = 0; e < FB_EPC; ++e) {
            cs.mult[e] = col_mult[c * FB_EPC + e];
            cs.sinv[e] = col_scinv[c * FB_EPC + e];
        }
        unsigned int cc[FB_R][FB_CW];
        unsigned int nzr = 0u, nzc = 0u;
        const int src0 = grp * FB_CPR;  // lane 2i of the group holds row i's scale
#pragma unroll
        for (int i = 0; i < FB_R; ++i) {
            if (do_row) {
                FbMul rs;
                const float mult = __shfl_sync(0xFFFFFFFFu, my_mult, src0 + 2 * i);
                const float sinv = __shfl_sync(0xFFFFFFFFu, my_sinv, src0 + 2 * i);
#pragma unroll
                for (int e = 0; e < FB_EPC; ++e) { rs.mult[e] = mult; rs.sinv[e] = sinv; }
                unsigned int rc[FB_CW];
                fb_chunk(v[i], rs, rc, row_err, nzr);
                fb_store_row(row_codes, M, K, m + i, k, vec, rc);
            }
            if (do_col) fb_chunk(v[i], cs, cc[i], col_err, nzc);
        }
        if (do_col) fb_store_col(col_codes, M, K, m, k, cc);
        nz_row += nzr;
        nz_col += nzc;
    }
    fb_finish(nzx, nz_row, row_err, nz_col, col_err, partial, ticket, out);
}

extern "C" __global__ void __launch_bounds__(FB_THREADS, FB_MIN_BLOCKS) ted_fp8_block_quantize_2d(FB_PARAMS) {
    __shared__ float warp_max[FB_THREADS / 32];
    __shared__ float tile_scale[2];
    FB_STAGE_DECL
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int grp = lane / FB_CPR, c = lane % FB_CPR;
    const int rg = wid * FB_GROUPS + grp;
    const long long n_mt = (M + FB_TILE - 1) / FB_TILE, n_kt = (K + FB_TILE - 1) / FB_TILE;
    const long long n_tiles = n_mt * n_kt;
    const bool vec = (K % FB_EPC) == 0;

    unsigned long long nzx = 0ull, nz = 0ull;
    double err = 0.0;
    fb_first(x, M, K, n_kt, n_tiles, rg, c, vec, stage);
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const long long mt = tile / n_kt, kt = tile % n_kt;
        long long m, k;
        fb_origin(tile, n_kt, rg, c, m, k);
        uint4 v[FB_R];
        fb_fetch(x, M, K, m, k, vec, stage, v);

        float am = 0.0f;
        unsigned int cnt = 0u;
#pragma unroll
        for (int i = 0; i < FB_R; ++i) {
            cnt += fb_nonzero(v[i]);
#pragma unroll
            for (int e = 0; e < FB_EPC; ++e) am = ted_max(am, ted_abs(fb_elem(v[i], e)));  // max drops NaN
        }
        nzx += cnt;
        fb_next(x, M, K, n_kt, n_tiles, tile, rg, c, vec, stage);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) am = ted_max(am, __shfl_xor_sync(0xFFFFFFFFu, am, off));
        if (lane == 0) warp_max[wid] = am;
        __syncthreads();  // warp maxima complete; the previous tile's tile_scale readers are done
        if (threadIdx.x == 0) {
#pragma unroll
            for (int w = 1; w < FB_THREADS / 32; ++w) am = ted_max(am, warp_max[w]);
            float mult, sinv;
            fb_scale(am, fp8_max, epsilon, pow2, value_for_inf, mult, sinv);
            tile_scale[0] = mult;
            tile_scale[1] = sinv;
            if (do_row) row_sinv[mt * n_kt + kt] = sinv;
            if (do_col) col_sinv[kt * n_mt + mt] = sinv;
        }
        __syncthreads();  // tile_scale complete; warp_max readers are done
        FbMul s;
        const float mult = tile_scale[0], sinv = tile_scale[1];
#pragma unroll
        for (int e = 0; e < FB_EPC; ++e) { s.mult[e] = mult; s.sinv[e] = sinv; }
        unsigned int cc[FB_R][FB_CW];
        unsigned int nzq = 0u;
#pragma unroll
        for (int i = 0; i < FB_R; ++i) {
            fb_chunk(v[i], s, cc[i], err, nzq);
            if (do_row) fb_store_row(row_codes, M, K, m + i, k, vec, cc[i]);
        }
        if (do_col) fb_store_col(col_codes, M, K, m, k, cc);
        nz += nzq;
    }
    // both directions hold the same codes and decode scales: identical statistics
    fb_finish(nzx, nz, err, nz, err, partial, ticket, out);
}
