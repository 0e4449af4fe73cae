// NVFP4 quantize (tedebug.quantization.nvfp4, bit-identical): rowwise 1x16 blocks along K and columnwise 1x16
// blocks along M of the transposed view, from one read of x [M, K], with fused error statistics per direction.
// The global amaxes come from a separate pass (ted_fp8_amax_scale in fp8_tensor.cu); the kernels read them from
// device memory.  The columnwise direction with the random Hadamard transform has its own kernels at the end of
// this file (ted_nvfp4_rht_amax: amax of the rotated values; ted_nvfp4_rht_col: rotate + quantize + statistics).
//
// `ted_nvfp4_quantize`: a block of 256 threads owns a tile of 64 rows x NV_TK columns (128 for 16-bit inputs, 64
// for fp32: 16 KB either way), staged in shared memory by cp.async (double-buffered: the next tile streams in while
// this one is processed; 16-byte chunks, XOR-swizzled so that both read patterns below are bank-conflict free).
// Row phase: each thread takes NV_RU whole 1x16 row blocks (two or four 16-byte shared loads each).  Column phase:
// each thread takes one 16-row group of NV_CW adjacent columns (16 four-byte shared loads).  So every block of 16
// lives in one thread: no shuffles.  Per block: E4M3 scale code, multiplier, 16 E2M1 codes (8 bytes, even element
// in the low nibble), one 8-byte store.  2D (16x16 tiles): column-group amaxes go to shared memory and the tile
// amax is shared by the 16 rows / columns of the tile in both directions.
//
// Scale rule (all fp32 through the IEEE helpers of common.cuh, CuPy compiles with -ftz=true):
//   S_enc = min(2688 / amax, FLT_MAX) (1 when amax == 0 or S_enc == 0), S_dec = 1 / S_enc;
//   code_b = E4M3_satfinite(min(block_amax * (S_enc * fp32(1/6)), FLT_MAX));
//   mult_b = min(1 / (E4M3(code_b) * S_dec), FLT_MAX);  decode scale = (E4M3(code_b) * amax) * fp32(1/2688).
// Element rounding, round to nearest even (no SR): a = min(|x * mult_b|, 6) (min drops NaN: NaN -> 6), then
// t = a + 2^(22 + e) with e = 0 below 2, 1 in [2, 4), 2 from 4 (the fp32 add rounds a to the E2M1 step 0.5, 1, 2
// with ties to even), r = t - 2^(22 + e) is the grid magnitude and bits(t) - bits(2^(22 + e)) + 2e the 3-bit code.
// Stochastic rounding (NV_SR=1): TE's software rule of the reference, with 8 random bits per element: the bytes of
// the reference's Philox draws ([M, K] rowwise, [K, M] columnwise), computed in place by `ted_philox_block`
// (philox.cuh) for the block of 16 bytes an element group needs - no buffer is written or read.
// Sign: the sign bit of x (ORed into the code as 0x8).  The hot path does not special-case NaN: a NaN makes the
// block's fp32 error sum non-finite, and such a block (also Inf, fp32 overflow of the squares) is redone exactly
// (`nv_redo`: NaN -> +6, code 7; the error in fp64).
// Statistics per direction: underflows = count_nonzero(x) - non-zero codes (nibble & 7 != 0); squared error
// sum (x - deq)^2 with |x - deq| = |x| - |deq| computed in fp32, summed in fp32 over the block of 16, then in fp64.
// The last block (atomic ticket) sums the per-block partials into out[4] = (row underflows, row sq_err, col
// underflows, col sq_err).
#include "common.cuh"
#include "philox.cuh"

#ifndef NV_SR
#define NV_SR 0
#endif
#ifndef NR_STATS
#define NR_STATS 1  // 0: no squared error (no inverse rotation; its partials stay 0), for calls nobody measures
                    // (ted_nvfp4_rht_col only)
#endif
#ifndef NV_MIN_BLOCKS
#define NV_MIN_BLOCKS 2  // resident blocks per SM (128 registers: no spills); cupy_nvfp4.NV_BLOCKS_PER_SM must match
#endif

#define NV_TM 64
#if TED_DTYPE == 0
#define NV_TK 64
#else
#define NV_TK 128
#endif
#define NV_EPC (16 / TED_ELEM_BYTES)   // elements per 16-byte chunk (4 or 8)
#define NV_CPR (NV_TK / NV_EPC)        // chunks per tile row (16)
#define NV_CPB (16 / NV_EPC)           // chunks per 1x16 block (4 or 2)
#define NV_BPR (NV_TK / 16)            // 1x16 blocks per tile row (4 or 8)
#define NV_RU (NV_TM * NV_BPR / 256)   // row blocks per thread and tile (1 or 2)
#define NV_CW TED_PER_WORD             // columns per column unit (1 or 2)
#define NV_CU (NV_TK / NV_CW)          // column units per 16-row group (64)
#define NV_WPR (NV_TK / NV_CW)         // 32-bit words per tile row (64)
#define NV_FLT_MAX __uint_as_float(0x7F7FFFFFu)

// Physical chunk of logical chunk `c` of tile row `row` (see the header: conflict-free row and column reads).
__device__ __forceinline__ int nv_swz(int row, int c) {
#if TED_DTYPE == 0
    return c ^ (((c >> 3) & 1) << 1) ^ (row & 1);
#else
    (void)row;
    return c ^ ((c >> 3) & 1);
#endif
}

__device__ __forceinline__ float nv_rcp(float a) { float r; asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }

// ---------------------------------------------------------------------------------------------- scale rule
struct NvDir { float amax, factor, s_dec; };  // a direction's global amax, S_enc * fp32(1/6), 1 / S_enc

__device__ __forceinline__ NvDir nv_dir(float amax, float inv6) {
    float s = ted_min(ted_div(2688.0f, amax), NV_FLT_MAX);
    if (!ted_nonzero(amax) || !ted_nonzero(s)) s = 1.0f;
    NvDir d;
    d.amax = amax;
    d.factor = ted_mul(s, inv6);
    d.s_dec = nv_rcp(s);
    return d;
}

struct NvBlock { float mult, dscale; unsigned int code; };

// E4M3 scale code of a block with amax `bamax` (>= 0, never NaN: the maxima drop NaN): 0 .. 0x7E.
__device__ __forceinline__ unsigned int nv_code(float bamax, const NvDir& d) {
    return (unsigned int)__nv_cvt_float_to_fp8(ted_min(ted_mul(bamax, d.factor), NV_FLT_MAX), __NV_SATFINITE,
                                               TED_FP8_INTERP);
}

// Multiplier and decode scale of scale code `code` in direction d.
__device__ __forceinline__ NvBlock nv_block_of(unsigned int code, const NvDir& d, float inv2688) {
    NvBlock b;
    b.code = code;
    const float sdec_b = ted_decode_fp8(code);
    b.mult = ted_min(nv_rcp(ted_mul(sdec_b, d.s_dec)), NV_FLT_MAX);
    b.dscale = ted_mul(ted_mul(sdec_b, d.amax), inv2688);
    return b;
}

__device__ __forceinline__ NvBlock nv_block(float bamax, const NvDir& d, float inv2688) {
    return nv_block_of(nv_code(bamax, d), d, inv2688);
}

// ---------------------------------------------------------------------------------------------- element rounding
// Round-to-nearest-even of min(|v|, 6) onto the E2M1 grid: returns the 3-bit magnitude code, r = grid magnitude.
__device__ __forceinline__ unsigned int nv_rn(float v, float& r) {
    const float a = ted_min(ted_abs(v), 6.0f);
    const unsigned int mb = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u) + 0x0B000000u;  // 2^(22+e)
    const float m = __uint_as_float(mb);
    const float t = ted_add(a, m);
    r = ted_sub(t, m);
    return __float_as_uint(t) - mb + (mb >> 22) - 298u;
}

// TE's software stochastic rounding of min(|v|, 6) with 8 random bits (tedebug.quantization.nvfp4):
//   u = bits / 256, t = a + u * step(a), g = min(floor(t / step(t)) * step(t), 6).
// Computed as nv_rn does, on the fp32 bits and pipes only (no conversion / MUFU instruction): step(a) = 2^(e - 1)
// with 2^e = max(2^floor(log2 a), 1), i.e. the exponent field of max(a, 1) minus one; u * step(a) is exact
// (8 significant bits times a power of two), so t = fma(u, step(a), a) is the reference's RN(a + u * step(a)).
// g is the largest grid point <= t: with 2^e' = max(2^floor(log2 t), 1) and M = 2^(22 + e'), the fp32 sum
// t + M lies in [2^(22 + e'), 2^(23 + e')), whose ulp is step(t), so adding with rounding toward zero (add.rz)
// truncates t to a multiple of step(t): q = rz(t + M), g = q - M (exact).  No min(., 6) is needed: t < 6 + 2 = 8,
// and the multiples of 2 in [4, 8) stop at 6.  The grid points 1, 2, 4 lie between 2^e' and t, so g has the
// exponent of t (or both are below 1): the code follows from the bits of q exactly as nv_rn's from its sum.
__device__ __forceinline__ unsigned int nv_sr(float v, unsigned int bits8, float& r) {
    const float a = ted_min(ted_abs(v), 6.0f);
    const float u = ted_sub(__uint_as_float(0x3F800000u | (bits8 << 15)), 1.0f);  // bits / 256, exact
    const unsigned int ea = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);
    const float t = ted_fma(u, __uint_as_float(ea - 0x00800000u), a);  // a + u * step(a)
    const unsigned int mb = max(__float_as_uint(t) & 0x7F800000u, 0x3F800000u) + 0x0B000000u;  // 2^(22+e')
    const float m = __uint_as_float(mb);
    float q;
    asm("add.rz.f32 %0, %1, %2;" : "=f"(q) : "f"(t), "f"(m));
    r = ted_sub(q, m);
    return __float_as_uint(q) - mb + (mb >> 22) - 298u;
}

__device__ __forceinline__ unsigned int nv_round(float v, unsigned int bits8, float& r) {
#if NV_SR
    return nv_sr(v, bits8, r);
#else
    (void)bits8;
    return nv_rn(v, r);
#endif
}

// Non-zero E2M1 codes among the 8 nibbles of `w`.
__device__ __forceinline__ unsigned int nv_nonzero8(unsigned int w) {
    return __popc(((w & 0x77777777u) + 0x77777777u) & 0x88888888u);
}

__device__ __forceinline__ unsigned int nv_byte(const uint4& b, int j) {
    const unsigned int w = j < 4 ? b.x : (j < 8 ? b.y : (j < 12 ? b.z : b.w));
    return (w >> (8 * (j & 3))) & 0xFFu;
}

struct NvVals { float v[16]; };
struct NvRedo { uint2 packed; double err; };

// Element j of an exact redo: its code (NaN -> +6, code 7; `sr`: nv_round with the random byte, else round to
// nearest) packed into o.packed and its fp64 squared error added to o.err.
__device__ __forceinline__ void nv_redo_elem(NvRedo& o, int j, float f, float mult, float dscale, unsigned int bits8,
                                             bool sr) {
    const float v = ted_mul(f, mult);
    unsigned int c;
    float r;
    if (isnan(v)) {
        c = 7u;
        r = 6.0f;
    } else {
        c = (sr ? nv_round(v, bits8, r) : nv_rn(v, r)) | ((__float_as_uint(f) >> 28) & 8u);
    }
    if (j < 8) o.packed.x |= c << (4 * j);
    else o.packed.y |= c << (4 * (j - 8));
    const double deq = ted_f2d(ted_mul(r, dscale));
    const double d = ted_f2d(f) - ((c & 8u) ? -deq : deq);
    o.err += d * d;
}

// Exact codes (NaN -> +6, code 7) and fp64 squared error of a block whose fp32 error sum was not finite.
__device__ __noinline__ NvRedo nv_redo(const NvVals f, float mult, float dscale, uint4 rb) {
    NvRedo o;
    o.packed = make_uint2(0u, 0u);
    o.err = 0.0;
    for (int j = 0; j < 16; ++j) nv_redo_elem(o, j, f.v[j], mult, dscale, nv_byte(rb, j), true);
    return o;
}

// Quantize one block of 16 values: packed codes, fp64 squared error, non-zero code count.
__device__ __forceinline__ void nv_quant16(const NvVals& f, const NvBlock& b, uint4 rb, uint2& packed,
                                           double& err, unsigned int& nz) {
    unsigned int lo = 0u, hi = 0u;
    float e = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        float r;
        const unsigned int c = nv_round(ted_mul(f.v[j], b.mult), nv_byte(rb, j), r) |
                               ((__float_as_uint(f.v[j]) >> 28) & 8u);
        if (j < 8) lo |= c << (4 * j);
        else hi |= c << (4 * (j - 8));
        const float d = ted_abs_sub(f.v[j], ted_mul(r, b.dscale));
        e = ted_fma(d, d, e);
    }
    packed = make_uint2(lo, hi);
    if (isfinite(e)) {
        err += ted_f2d(e);
    } else {
        const NvRedo o = nv_redo(f, b.mult, b.dscale, rb);
        packed = o.packed;
        err += o.err;
    }
    nz += nv_nonzero8(packed.x) + nv_nonzero8(packed.y);
}

// ---------------------------------------------------------------------------------------------- tile helpers
__device__ __forceinline__ void nv_prefetch(const ted_raw_t* x, long long M, long long K, long long n_tk,
                                            long long tile, uint4* dst) {
    const long long m0 = (tile / n_tk) * NV_TM, k0 = (tile % n_tk) * NV_TK;
#pragma unroll
    for (int j = 0; j < NV_TM * NV_CPR / 256; ++j) {
        const int i = threadIdx.x + 256 * j;
        const int row = i / NV_CPR, c = i % NV_CPR;
        const long long m = m0 + row, k = k0 + (long long)c * NV_EPC;
        if (m < M && k < K) {
            const unsigned int saddr = (unsigned int)__cvta_generic_to_shared(dst + row * NV_CPR + nv_swz(row, c));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(saddr), "l"(x + m * K + k) : "memory");
        }
    }
}

// 16 elements of a row block (raw 16-byte chunks) as fp32 values.
__device__ __forceinline__ void nv_unpack_row(const uint4 (&ch)[NV_CPB], NvVals& f) {
#pragma unroll
    for (int j = 0; j < NV_CPB; ++j) {
        const unsigned int w[4] = {ch[j].x, ch[j].y, ch[j].z, ch[j].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) ted_unpack_word(w[k], &f.v[j * NV_EPC + k * TED_PER_WORD]);
    }
}

// Element `e` (column) of each of the 16 words of a column unit.
__device__ __forceinline__ void nv_unpack_col(const unsigned int (&cw)[16], int e, NvVals& f) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#if TED_DTYPE == 0
        (void)e;
        f.v[i] = __uint_as_float(cw[i]);
#else
        f.v[i] = e ? ted_hi(cw[i]) : ted_lo(cw[i]);
#endif
    }
}

// max |v| of a word's elements folded into `m` (NaN dropped), per column for 16-bit words.
__device__ __forceinline__ unsigned int nv_word_nonzero(unsigned int w) {
#if TED_DTYPE == 0
    return ted_nonzero(__uint_as_float(w)) ? 1u : 0u;
#else
    return ted_pk_total(ted_pk_nonzero(w));
#endif
}

__device__ __forceinline__ float nv_row_amax(const uint4 (&ch)[NV_CPB]) {
#if TED_DTYPE == 0
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < NV_CPB; ++j) {
        m = ted_max(m, ted_abs(__uint_as_float(ch[j].x)));
        m = ted_max(m, ted_abs(__uint_as_float(ch[j].y)));
        m = ted_max(m, ted_abs(__uint_as_float(ch[j].z)));
        m = ted_max(m, ted_abs(__uint_as_float(ch[j].w)));
    }
    return m;
#else
    unsigned int m = 0u;
#pragma unroll
    for (int j = 0; j < NV_CPB; ++j) {
        m = ted_pmax(m, ch[j].x & 0x7FFF7FFFu);
        m = ted_pmax(m, ch[j].y & 0x7FFF7FFFu);
        m = ted_pmax(m, ch[j].z & 0x7FFF7FFFu);
        m = ted_pmax(m, ch[j].w & 0x7FFF7FFFu);
    }
    return ted_max(ted_lo(m), ted_hi(m));
#endif
}

// ---------------------------------------------------------------------------------------------- quantize
// amax[0]: rowwise global amax, amax[1]: columnwise global amax (fp32 device values).  NV_SR only: the Philox seed
// and the offsets of the rowwise ([M, K]) and columnwise ([K, M]) draws.  partial: >= gridDim.x * 4 doubles; ticket: 0 before, reset to 0 by the last block.
extern "C" __global__ void __launch_bounds__(256, NV_MIN_BLOCKS)
ted_nvfp4_quantize(const ted_raw_t* __restrict__ x, long long M, long long K, const float* __restrict__ amax,
                   float inv6, float inv2688, int do_row, int do_col, int two_d, unsigned int seed_lo,
                   unsigned int seed_hi, unsigned int row_off_lo, unsigned int row_off_hi, unsigned int col_off_lo,
                   unsigned int col_off_hi,
                   unsigned char* __restrict__ row_data, unsigned char* __restrict__ row_scales,
                   unsigned char* __restrict__ col_data, unsigned char* __restrict__ col_scales,
                   double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out) {
    __shared__ __align__(16) uint4 stage[2][NV_TM * NV_CPR];
    __shared__ float s_camax[NV_TM / 16][NV_TK];  // 2D: column amax of each 16-row group
    __shared__ float s_tamax[NV_TM / 16][NV_BPR];  // 2D: 16x16 tile amax
    const NvDir rdir = nv_dir(amax[0], inv6);
    const NvDir cdir = nv_dir(amax[1], inv6);
    const long long n_tk = (K + NV_TK - 1) / NV_TK;
    const long long n_tiles = ((M + NV_TM - 1) / NV_TM) * n_tk;
    const bool load_col = do_col || two_d;
    const int cu_p = threadIdx.x % NV_CU, cu_g = threadIdx.x / NV_CU;  // column unit: word column, row group

    double row_err = 0.0, col_err = 0.0;
    unsigned int nzx = 0u, nz_row = 0u, nz_col = 0u;  // per thread: far below 2^32
    int buf = 0;
    if ((long long)blockIdx.x < n_tiles) nv_prefetch(x, M, K, n_tk, blockIdx.x, stage[0]);
    asm volatile("cp.async.commit_group;\n" ::);
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x, buf ^= 1) {
        const long long m0 = (tile / n_tk) * NV_TM, k0 = (tile % n_tk) * NV_TK;
        __syncthreads();  // the previous tile's readers of stage[buf ^ 1] are done
        if (tile + gridDim.x < n_tiles) nv_prefetch(x, M, K, n_tk, tile + gridDim.x, stage[buf ^ 1]);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        __syncthreads();  // this tile is in stage[buf]
        const uint4* st = stage[buf];
        const unsigned int* sw = reinterpret_cast<const unsigned int*>(st);

        // ---- column unit: 16 rows x NV_CW columns
        unsigned int cw[16];
        float cam[NV_CW];
        const long long ck = k0 + (long long)cu_p * NV_CW;  // first column of the unit
        const bool c_ok = (m0 + 16 * cu_g < M) && (ck < K);
        if (load_col) {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int row = 16 * cu_g + i;
                cw[i] = sw[row * NV_WPR + nv_swz(row, cu_p >> 2) * 4 + (cu_p & 3)];
            }
#if TED_DTYPE == 0
            float m = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; ++i) m = ted_max(m, ted_abs(__uint_as_float(cw[i])));
            cam[0] = m;
#else
            unsigned int m = 0u;
#pragma unroll
            for (int i = 0; i < 16; ++i) m = ted_pmax(m, cw[i] & 0x7FFF7FFFu);
            cam[0] = ted_lo(m);
            cam[1] = ted_hi(m);
#endif
            if (two_d) {
#pragma unroll
                for (int e = 0; e < NV_CW; ++e) s_camax[cu_g][cu_p * NV_CW + e] = cam[e];
            }
        }
        if (two_d) {
            __syncthreads();
            if (threadIdx.x < (NV_TM / 16) * NV_BPR) {
                const int g = threadIdx.x / NV_BPR, tb = threadIdx.x % NV_BPR;
                float m = 0.0f;
#pragma unroll
                for (int c = 0; c < 16; ++c) m = ted_max(m, s_camax[g][16 * tb + c]);
                s_tamax[g][tb] = m;
            }
            __syncthreads();
        }

        // ---- columns
        if (do_col && c_ok) {
            const long long mg = m0 + 16 * cu_g;
            if (!do_row) {
#pragma unroll
                for (int i = 0; i < 16; ++i) nzx += nv_word_nonzero(cw[i]);
            }
#pragma unroll
            for (int e = 0; e < NV_CW; ++e) {
                const long long kc = ck + e;
                const float bam = two_d ? s_tamax[cu_g][(cu_p * NV_CW + e) >> 4] : cam[e];
                const NvBlock blk = nv_block(bam, cdir, inv2688);
                col_scales[kc * (M / 16) + mg / 16] = (unsigned char)blk.code;
                uint4 rb = make_uint4(0u, 0u, 0u, 0u);
#if NV_SR
                rb = ted_philox_block(TedPhilox{seed_lo, seed_hi, col_off_lo, col_off_hi},
                                      (unsigned long long)((kc * M + mg) / 16));
#endif
                NvVals f;
                nv_unpack_col(cw, e, f);
                uint2 packed;
                unsigned int nz = 0u;
                nv_quant16(f, blk, rb, packed, col_err, nz);
                nz_col += nz;
                *reinterpret_cast<uint2*>(col_data + kc * (M / 2) + mg / 2) = packed;
            }
        }
        // ---- rows
        if (do_row) {
#pragma unroll 1
            for (int n = 0; n < NV_RU; ++n) {
                const int u = threadIdx.x + 256 * n;
                const int r = u / NV_BPR, b = u % NV_BPR;
                const long long m = m0 + r, k = k0 + 16 * b;
                if (m >= M || k >= K) continue;
                uint4 ch[NV_CPB];
#pragma unroll
                for (int j = 0; j < NV_CPB; ++j) ch[j] = st[r * NV_CPR + nv_swz(r, b * NV_CPB + j)];
                const float bam = two_d ? s_tamax[r >> 4][b] : nv_row_amax(ch);
                const NvBlock blk = nv_block(bam, rdir, inv2688);
                row_scales[m * (K / 16) + k / 16] = (unsigned char)blk.code;
#pragma unroll
                for (int j = 0; j < NV_CPB; ++j)
                    nzx += nv_word_nonzero(ch[j].x) + nv_word_nonzero(ch[j].y) + nv_word_nonzero(ch[j].z) +
                           nv_word_nonzero(ch[j].w);
                uint4 rb = make_uint4(0u, 0u, 0u, 0u);
#if NV_SR
                rb = ted_philox_block(TedPhilox{seed_lo, seed_hi, row_off_lo, row_off_hi},
                                      (unsigned long long)((m * K + k) / 16));
#endif
                NvVals f;
                nv_unpack_row(ch, f);
                uint2 packed;
                unsigned int nz = 0u;
                nv_quant16(f, blk, rb, packed, row_err, nz);
                nz_row += nz;
                *reinterpret_cast<uint2*>(row_data + m * (K / 2) + k / 2) = packed;
            }
        }

    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    ted_store_dir_stats((double)nzx - (double)nz_row, row_err, (double)nzx - (double)nz_col, col_err, partial);
    if (ted_last_block(ticket)) ted_finish_columns(partial, gridDim.x, 4, out, ticket);
}


// ---------------------------------------------------------------------------------------------- fast kernel
// `ted_nvfp4_quantize16`: bf16 / fp16, 1D blocks or (compiled with NQ_2D=1) 16x16 tiles,
// M % 64 == 0 and K % 128 == 0 (the host picks it; every other call takes `ted_nvfp4_quantize`).  2D: the column
// pass always runs; warp w's 32 column units are the 4 row groups x 16 columns of tile column block w, so each
// 16x16 tile amax is a 3-step xor-shuffle max over the lanes of one row group (lanes l, l ^ 4, l ^ 8, l ^ 16, ...),
// shared with the row pass through shared memory (one more barrier per tile); both directions take their scale
// code from the tile amax (NaN dropped), as the general kernel does.  Same results bit for bit, less work per
// element:
//   - tiles walked in bands of NQ_BAND tile rows, column by column (nq_walk / nq_tile: 32-bit arithmetic, no
//     division per tile), 3 resident blocks per SM (80 registers);
//   - column units numbered so that the 4 lanes of one column pair hold its 4 16-row groups: one 8-byte store
//     instruction writes 32 contiguous bytes per column (full sectors) instead of 64 scattered 8-byte pieces;
//     swizzle NQ_SWZ also spreads those 4 row groups over distinct banks;
//   - per element: |x| * mult and min(., 6) in two instructions, the sign OR-ed in with one shift + LOP3, no
//     NaN special case (a non-finite fp32 block error redoes the block exactly from shared memory, `nq_redo`);
//     blocks with a normal E4M3 scale code (nearly all) skip the min and pack on the multiply-add pipe
//     (nq_elem_fast);
//   - count_nonzero(x) comes from the amax pass (`ted_amax_count`, memory-bound, +2 us), not from this kernel;
//   - block scales from a shared table (mult, dscale) per E4M3 code and direction, built once per block (no
//     reciprocal per block); every address a per-thread constant (NqThread) plus a per-tile base.
// Stochastic rounding (a separate compile, NV_SR=1, with 2 resident blocks per SM): the tile walk, staging, scale
// codes and stores are the ones above; each 1x16 block takes its 16 random bytes from Philox block (m K + k) / 16
// of the rowwise draw (row m, first column k) or (k M + m) / 16 of the columnwise draw (column k, first row m), as
// the general kernel does, and is quantized by the general kernel's nv_quant16 (SR rounding, fp32 block error,
// exact redo of a non-finite block): the same bytes and statistics bit for bit.
// Profile (ncu, H200, bf16 8192^2, row+col): issue-bound (85 % of the issue slots busy, the ALU pipe at 62 % of
// its peak), so time follows the instruction count.  Under ncu: walking the tiles without per-tile divisions and
// packing with shift-adds: 112.5 M -> 109.1 M instructions, 192.8 -> 184.6 us; the count in the amax pass, the
// scale table and the address constants: 91.6 M, 151.0 us (the ALU pipe, LOP3 / shifts / integer min-max at half
// rate, was at 72 % of its peak); nq_elem_fast: 87.5 M, 142.1 us; the row loop unrolled with 3 blocks per SM
// (80 registers, no rematerialised addresses): 82.3 M, 136.6 us.
#if TED_DTYPE != 0
#define NQ_TM 64
#define NQ_TK 128
#define NQ_WPR 64  // 32-bit words per tile row
#define NQ_BAND 8  // tile rows per band of the tile order (see nq_tile)
#ifndef NQ_2D
#define NQ_2D 0  // 1: 16x16 scale tiles (a separate compile, -DNQ_2D=1; the 1D code is unchanged by it)
#endif
#ifndef NQ_MIN_BLOCKS
#define NQ_MIN_BLOCKS 3  // resident blocks per SM (80 registers); cupy_nvfp4.NQ_BLOCKS_PER_SM must match
#endif

// Physical 16-byte chunk of logical chunk c of tile row `row`: conflict-free cp.async writes, row-block reads
// (8 lanes of one row) and column reads (lanes 4p + g read rows 16g + i of word column p).
__device__ __forceinline__ int nq_swz(int row, int c) { return c ^ ((c >> 3) & 1) ^ (((row >> 4) & 3) << 1); }

__device__ __forceinline__ unsigned int nq_word(const unsigned int* sw, int row, int wc) {
    return sw[row * NQ_WPR + nq_swz(row, wc >> 2) * 4 + (wc & 3)];
}

// One element: its 4-bit code (sign in bit 3) and e += (|f| - |deq|)^2 in fp32 (nv_rn's rounding; a NaN f gives
// a NaN error, which sends the block to nq_redo).
__device__ __forceinline__ unsigned int nq_elem(float f, float mult, float dscale, float& e) {
    float a;
    asm("{.reg .f32 t; abs.f32 t, %1; mul.rn.f32 t, t, %2; min.f32 %0, t, 0f40C00000;}" : "=f"(a) : "f"(f), "f"(mult));
    const unsigned int E = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);  // 2^e, e = 0, 1, 2
    // t = a + 2^(22 + e) and r = t - 2^(22 + e) (exact) as fmas with the exact product 2^e * 2^22: one rounding
    // each, the same results as nv_rn's adds without materialising 2^(22 + e)
    const float t = ted_fma(__uint_as_float(E), 4194304.0f, a);
    const float r = ted_fma(__uint_as_float(E), -4194304.0f, t);
    const float d = ted_abs_sub(f, ted_mul(r, dscale));
    e = ted_fma(d, d, e);
    const unsigned int c = __float_as_uint(t) - E - 0x0B000000u + (E >> 22) - 254u;
    return c | ((__float_as_uint(f) >> 28) & 8u);
}

// The same element in a block whose scale code is >= 8 (E4M3 normal, nq_fast): there the block scale rounds by at
// most 2^-4 (relative), so |x| * mult <= 6.4 < 7 for every finite x of the block and min(., 6) is not needed.  An
// infinite or NaN element makes the block's error sum non-finite, so the block is redone by nq_redo, as on the
// clamped path; and when the global amax is Inf (S_enc = 1, where a saturated scale code could leave |x| * mult
// above 7) the decode scale is Inf, so every block's error is non-finite and every block is redone.
// The nibble bits(t) - E - 0x0B000000 + (E >> 22) - 254 + 8 s (s: sign of f) is added into `acc` times 16^i,
// mostly with integer multiply-adds (the shift / LOP3 pipe was the kernel's bottleneck); the constant part is
// taken off once per word (NQ_BIAS).  s * 2^(4i + 3) is the high half of bits(f * 0) * 2^(4i + 4): f * 0 is +-0,
// the sign bit alone.
__device__ __forceinline__ void nq_elem_fast(float f, float mult, float dscale, float& e, unsigned int& acc, int i) {
    float a;
    asm("{.reg .f32 t; abs.f32 t, %1; mul.rn.f32 %0, t, %2;}" : "=f"(a) : "f"(f), "f"(mult));  // one FMUL |f|
    const unsigned int E = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);
    const float t = ted_fma(__uint_as_float(E), 4194304.0f, a);
    const float r = ted_fma(__uint_as_float(E), -4194304.0f, t);
    const float d = ted_abs_sub(f, ted_mul(r, dscale));
    e = ted_fma(d, d, e);
    const unsigned int z = __float_as_uint(ted_mul(f, 0.0f));
    acc += __float_as_uint(t) * (1u << (4 * i));
    if (i < 6) {
        acc -= E * (1u << (4 * i));
        acc += __umulhi(E, 1u << (10 + 4 * i));
    } else {
        acc += E * ((1u << (4 * i - 22)) - (1u << (4 * i)));
    }
    acc += i < 7 ? __umulhi(z, 1u << (4 * i + 4)) : z;
}

// sum over the 8 nibbles of a word of 16^i * (0x0B000000 + 254), mod 2^32: what nq_elem_fast's sums carry extra.
#define NQ_BIAS ((0x0B000000u + 254u) * 0x11111111u)

__device__ __forceinline__ bool nq_fast(unsigned int code) { return code >= 8u; }

// Element j of a block in shared memory: row blocks (by_row) run along the words of row `row0` from word column
// wc0; column blocks down rows row0 .. row0 + 15 of word column wc0, half `half`.
__device__ __forceinline__ float nq_elem_at(const unsigned int* sw, int by_row, int row0, int wc0, int half, int j) {
    const unsigned int w = by_row ? nq_word(sw, row0, wc0 + (j >> 1)) : nq_word(sw, row0 + j, wc0);
    const int h = by_row ? (j & 1) : half;
    return h ? ted_hi(w) : ted_lo(w);
}

// Exact codes (NaN -> +6, code 7) and fp64 squared error of a block whose fp32 error sum was not finite.
__device__ __noinline__ NvRedo nq_redo(const unsigned int* sw, int by_row, int row0, int wc0, int half, float mult,
                                       float dscale) {
    NvRedo o;
    o.packed = make_uint2(0u, 0u);
    o.err = 0.0;
    for (int j = 0; j < 16; ++j)
        nv_redo_elem(o, j, nq_elem_at(sw, by_row, row0, wc0, half, j), mult, dscale, 0u, false);
    return o;
}

// Finish a block: exact redo when its fp32 error is not finite, fp64 error and non-zero code count.
__device__ __forceinline__ uint2 nq_finish(uint2 packed, float e, const unsigned int* sw, int by_row, int row0,
                                           int wc0, int half, float mult, float dscale, double& err,
                                           unsigned int& nz) {
    if (isfinite(e)) {
        err += ted_f2d(e);
    } else {
        const NvRedo o = nq_redo(sw, by_row, row0, wc0, half, mult, dscale);
        packed = o.packed;
        err += o.err;
    }
    nz += nv_nonzero8(packed.x) + nv_nonzero8(packed.y);
    return packed;
}

// The banded tile order: bands of NQ_BAND tile rows (the last may be shorter), each walked column by column (tm
// fastest), so the tiles in flight at once write runs of NQ_BAND * 32 contiguous bytes of every column of column
// data while the input rows and row data they touch stay long contiguous runs.  Tile t is (band, rest) with
// t = band * (NQ_BAND * n_tk) + rest; a block walks t = blockIdx.x, + G, ... by adding G's (band, rest) (divisions
// once per kernel, none per tile but for the last, shorter band).
struct NqWalk {
    unsigned int band, rest;          // the current tile
    unsigned int g_band, g_rest, bn;  // G as (band, rest); tiles per full band
};

__device__ __forceinline__ NqWalk nq_walk(unsigned int t, unsigned int G, unsigned int n_tk) {
    NqWalk w;
    w.bn = NQ_BAND * n_tk;
    w.band = t / w.bn;
    w.rest = t - w.band * w.bn;
    w.g_band = G / w.bn;
    w.g_rest = G - w.g_band * w.bn;
    return w;
}

__device__ __forceinline__ void nq_advance(NqWalk& w) {
    w.band += w.g_band;
    w.rest += w.g_rest;
    if (w.rest >= w.bn) {
        w.rest -= w.bn;
        ++w.band;
    }
}

__device__ __forceinline__ void nq_tile(const NqWalk& w, unsigned int n_tm, unsigned int& tm, unsigned int& tk) {
    const unsigned int h = min((unsigned int)NQ_BAND, n_tm - w.band * NQ_BAND);  // tile rows of this band
    if (h == NQ_BAND) {
        tk = w.rest / NQ_BAND;
        tm = w.band * NQ_BAND + w.rest % NQ_BAND;
    } else {
        tk = w.rest / h;
        tm = w.band * NQ_BAND + (w.rest - tk * h);
    }
}

// Per-thread constants of the tile walk (byte offsets; the host keeps M, K < 2^24 so that they fit 32 bits).
//   cp.async: chunk tid + 256 j is tile row (tid >> 4) + 16 j, chunk tid & 15: source tile + p_src + 32 K j,
//     destination p_dst ^ 4128 j (rows 16 j .. 16 j + 15 flip bit 1 of the swizzled chunk, bits 12-13 of the row);
//   columns: word column cp = tid >> 2, 16-row group cg = tid & 3; word i of the unit at c_off + 256 i;
//   rows: row blocks (tid >> 3) + 32 n, 16 elements from word column 8 (tid & 7): chunks at r_off and r_off ^ 16,
//     r_off ^ 0x2040 for n = 1 (32 rows further, bit 2 of the swizzled chunk flipped);
//   stores: column data at tile + c_st (+ M / 2 for the odd column), scales at c_st / 8; row data at tile + r_st
//     (+ 16 K for n = 1), scales at r_st / 8.
struct NqThread { unsigned int p_src, p_dst, c_off, r_off, c_st, r_st; };

__device__ __forceinline__ NqThread nq_thread(unsigned int M, unsigned int K) {
    const unsigned int t = threadIdx.x;
    NqThread o;
    const unsigned int pc = t & 15u, prow = t >> 4;
    o.p_src = prow * K * 2u + pc * 16u;
    o.p_dst = prow * 256u + 16u * (unsigned int)nq_swz((int)prow, (int)pc);
    const unsigned int cg = t & 3u, cp = t >> 2;
    o.c_off = cg * 4096u + 16u * (unsigned int)nq_swz((int)(16u * cg), (int)(cp >> 2)) + 4u * (cp & 3u);
    const unsigned int r0 = t >> 3, b = t & 7u;
    o.r_off = r0 * 256u + 16u * (unsigned int)nq_swz((int)r0, (int)(2u * b));
    o.c_st = cp * M + 8u * cg;
    o.r_st = r0 * (K / 2u) + 8u * b;
    return o;
}

__device__ __forceinline__ void nq_prefetch(const char* tile, unsigned int K, const NqThread& th, unsigned int sbase) {
#pragma unroll
    for (unsigned int j = 0; j < 4; ++j) {
        const unsigned int saddr = sbase + (th.p_dst ^ (4128u * j));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                     :: "r"(saddr), "l"(tile + th.p_src + 32u * K * j) : "memory");
    }
}

__device__ __forceinline__ unsigned int nq_lds32(unsigned int addr) {
    unsigned int v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ uint4 nq_lds128(unsigned int addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// nonzero: count_nonzero(x) (int64, from the amax pass `ted_amax_count`), subtracted from by the code counts.
extern "C" __global__ void __launch_bounds__(256, NQ_MIN_BLOCKS)
ted_nvfp4_quantize16(const ted_raw_t* __restrict__ x, long long M, long long K, const float* __restrict__ amax,
                     const unsigned long long* __restrict__ nonzero, float inv6, float inv2688, int do_row,
                     int do_col, unsigned int seed_lo, unsigned int seed_hi, unsigned int row_off_lo,
                     unsigned int row_off_hi, unsigned int col_off_lo, unsigned int col_off_hi,
                     unsigned char* __restrict__ row_data, unsigned char* __restrict__ row_scales,
                     unsigned char* __restrict__ col_data, unsigned char* __restrict__ col_scales,
                     double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out) {
    __shared__ __align__(16) uint4 stage[2][NQ_TM * 16];
    __shared__ float2 tab[2][128];  // (mult, dscale) of every E4M3 scale code, rowwise / columnwise
#if NQ_2D
    __shared__ float s_tam[NQ_TM / 16][NQ_TK / 16];  // 16x16 tile amaxes of the tile
#endif
    const NvDir rdir = nv_dir(amax[0], inv6);
    const NvDir cdir = nv_dir(amax[1], inv6);
    {
        const unsigned int d = threadIdx.x >> 7, c = threadIdx.x & 127u;
        const NvBlock b = nv_block_of(c, nv_dir(amax[d], inv6), inv2688);
        tab[d][c] = make_float2(b.mult, b.dscale);
    }
    const unsigned int Mu = (unsigned int)M, Ku = (unsigned int)K;
    const NqThread th = nq_thread(Mu, Ku);
    // Tiles in the banded order of nq_tile; block b takes b, b + G, ...; n_tiles < 2^31 (checked by the host).
    const unsigned int n_tk = Ku / NQ_TK, n_tm = Mu / NQ_TM;
    const unsigned int n_tiles = n_tm * n_tk;
    const unsigned int G = gridDim.x;
    unsigned int tm, tk, ntm = 0u, ntk = 0u;
    NqWalk walk = nq_walk(blockIdx.x, G, n_tk);
    nq_tile(walk, n_tm, tm, tk);
    const char* xb = reinterpret_cast<const char*>(x);
    const unsigned int s0 = (unsigned int)__cvta_generic_to_shared(stage[0]);
    const unsigned int s1 = (unsigned int)__cvta_generic_to_shared(stage[1]);

    double row_err = 0.0, col_err = 0.0;
    unsigned int nz_row = 0u, nz_col = 0u;  // per thread: far below 2^32
    int buf = 0;
    if (blockIdx.x < n_tiles)
        nq_prefetch(xb + ((long long)tm * NQ_TM * K + (long long)tk * NQ_TK) * 2, Ku, th, s0);
    asm volatile("cp.async.commit_group;\n" ::);
    for (unsigned int tile = blockIdx.x; tile < n_tiles; tile += G, buf ^= 1) {
        __syncthreads();  // the previous tile's readers of stage[buf ^ 1] are done (and, first, tab is written)
        if (tile + G < n_tiles) {
            nq_advance(walk);
            nq_tile(walk, n_tm, ntm, ntk);
            nq_prefetch(xb + ((long long)ntm * NQ_TM * K + (long long)ntk * NQ_TK) * 2, Ku, th, buf ? s0 : s1);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        __syncthreads();  // this tile is in stage[buf]
        const unsigned int sb = buf ? s1 : s0;
        const unsigned int* sw = reinterpret_cast<const unsigned int*>(stage[buf]);
        const long long m0 = (long long)tm * NQ_TM, k0 = (long long)tk * NQ_TK;

        // ---- columns: 16 rows x 2 columns per thread
#if NQ_2D
        {  // 2D: every tile amax (the rows need them too); then the columns when do_col
            unsigned int cw[16];
            unsigned int pm = 0u;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                cw[i] = nq_lds32(sb + th.c_off + 256u * i);
                pm = ted_pmax(pm, cw[i] & 0x7FFF7FFFu);
            }
            // warp w holds word columns 8w .. 8w + 7 (tile column block w); lane l their row group l & 3
            float tam = ted_max(ted_lo(pm), ted_hi(pm));
            tam = ted_max(tam, __shfl_xor_sync(0xFFFFFFFFu, tam, 4));
            tam = ted_max(tam, __shfl_xor_sync(0xFFFFFFFFu, tam, 8));
            tam = ted_max(tam, __shfl_xor_sync(0xFFFFFFFFu, tam, 16));
            if ((threadIdx.x & 28u) == 0u) s_tam[threadIdx.x & 3u][threadIdx.x >> 5] = tam;
            if (do_col) {
#else
        if (do_col) {
            unsigned int cw[16];
            unsigned int pm = 0u;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                cw[i] = nq_lds32(sb + th.c_off + 256u * i);
                pm = ted_pmax(pm, cw[i] & 0x7FFF7FFFu);
            }
#endif
            unsigned char* cdata = col_data + k0 * (M / 2) + m0 / 2 + th.c_st;
            unsigned char* cscale = col_scales + k0 * (M / 16) + m0 / 16 + (th.c_st >> 3);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
#if NQ_2D
                const unsigned int code = nv_code(tam, cdir);
#else
                const unsigned int code = nv_code(e ? ted_hi(pm) : ted_lo(pm), cdir);
#endif
                const float2 md = tab[1][code];
                cscale[e * (M / 16)] = (unsigned char)code;
#if NV_SR
                NvVals f;
#pragma unroll
                for (int i = 0; i < 16; ++i) f.v[i] = e ? ted_hi(cw[i]) : ted_lo(cw[i]);
                const long long kc = k0 + 2 * (threadIdx.x >> 2) + e, mc = m0 + 16 * (threadIdx.x & 3);
                const uint4 rb = ted_philox_block(TedPhilox{seed_lo, seed_hi, col_off_lo, col_off_hi},
                                                  (unsigned long long)((kc * M + mc) / 16));
                uint2 packed;
                nv_quant16(f, NvBlock{md.x, md.y, code}, rb, packed, col_err, nz_col);
#else
                unsigned int lo = 0u, hi = 0u;
                float ef = 0.0f;
                if (nq_fast(code)) {
#pragma unroll
                    for (int i = 0; i < 16; ++i)
                        nq_elem_fast(e ? ted_hi(cw[i]) : ted_lo(cw[i]), md.x, md.y, ef, i < 8 ? lo : hi, i & 7);
                    lo -= NQ_BIAS;
                    hi -= NQ_BIAS;
                } else {
#pragma unroll
                    for (int i = 0; i < 16; ++i) {
                        const unsigned int c = nq_elem(e ? ted_hi(cw[i]) : ted_lo(cw[i]), md.x, md.y, ef);
                        if (i < 8) lo += c << (4 * i);  // disjoint nibbles: + is |, one shift-add
                        else hi += c << (4 * (i - 8));
                    }
                }
                const uint2 packed = nq_finish(make_uint2(lo, hi), ef, sw, 0, 16 * (threadIdx.x & 3),
                                               threadIdx.x >> 2, e, md.x, md.y, col_err, nz_col);
#endif
                *reinterpret_cast<uint2*>(cdata + e * (M / 2)) = packed;
            }
#if NQ_2D
            }
#endif
        }
#if NQ_2D
        __syncthreads();  // s_tam is written (its readers of the previous tile passed the loop's first barrier)
#endif
        // ---- rows: two 1x16 blocks per thread
        if (do_row) {
            unsigned char* rdata = row_data + m0 * (K / 2) + k0 / 2 + th.r_st;
            unsigned char* rscale = row_scales + m0 * (K / 16) + k0 / 16 + (th.r_st >> 3);
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const unsigned int roff = n ? (th.r_off ^ 0x2040u) : th.r_off;
                const uint4 c0 = nq_lds128(sb + roff);
                const uint4 c1 = nq_lds128(sb + (roff ^ 16u));
                const unsigned int w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#if NQ_2D
                const unsigned int code = nv_code(s_tam[(threadIdx.x >> 7) + 2 * n][threadIdx.x & 7u], rdir);
#else
                unsigned int pm = 0u;
#pragma unroll
                for (int i = 0; i < 8; ++i) pm = ted_pmax(pm, w[i] & 0x7FFF7FFFu);
                const unsigned int code = nv_code(ted_max(ted_lo(pm), ted_hi(pm)), rdir);
#endif
                const float2 md = tab[0][code];
                rscale[n * 2 * K] = (unsigned char)code;
#if NV_SR
                NvVals f;
#pragma unroll
                for (int j = 0; j < 16; ++j) f.v[j] = (j & 1) ? ted_hi(w[j >> 1]) : ted_lo(w[j >> 1]);
                const long long mr = m0 + (threadIdx.x >> 3) + 32 * n, kr = k0 + 16 * (threadIdx.x & 7);
                const uint4 rb = ted_philox_block(TedPhilox{seed_lo, seed_hi, row_off_lo, row_off_hi},
                                                  (unsigned long long)((mr * K + kr) / 16));
                uint2 packed;
                nv_quant16(f, NvBlock{md.x, md.y, code}, rb, packed, row_err, nz_row);
#else
                unsigned int lo = 0u, hi = 0u;
                float ef = 0.0f;
                if (nq_fast(code)) {
#pragma unroll
                    for (int j = 0; j < 16; ++j)
                        nq_elem_fast((j & 1) ? ted_hi(w[j >> 1]) : ted_lo(w[j >> 1]), md.x, md.y, ef,
                                     j < 8 ? lo : hi, j & 7);
                    lo -= NQ_BIAS;
                    hi -= NQ_BIAS;
                } else {
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        const unsigned int c = nq_elem((j & 1) ? ted_hi(w[j >> 1]) : ted_lo(w[j >> 1]), md.x, md.y,
                                                       ef);
                        if (j < 8) lo += c << (4 * j);
                        else hi += c << (4 * (j - 8));
                    }
                }
                const uint2 packed = nq_finish(make_uint2(lo, hi), ef, sw, 1, (threadIdx.x >> 3) + 32 * n,
                                               8 * (threadIdx.x & 7), 0, md.x, md.y, row_err, nz_row);
#endif
                *reinterpret_cast<uint2*>(rdata + n * 16 * K) = packed;
            }
        }
        tm = ntm;
        tk = ntk;
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    ted_store_dir_stats(-(double)nz_row, row_err, -(double)nz_col, col_err, partial);
    if (ted_last_block(ticket)) {
        ted_finish_columns(partial, gridDim.x, 4, out, ticket);
        if (threadIdx.x == 0) {  // underflows = count_nonzero(x) - non-zero codes
            const double nzx = (double)*nonzero;
            out[0] += nzx;
            out[2] += nzx;
        }
    }
}
#endif


// ---------------------------------------------------------------------------------------------- RHT columnwise
// NVFP4 columnwise with the random Hadamard transform (tedebug.quantization.nvfp4: `apply_rht` of the transposed
// view, bit-identical).  For column k of x [M, K] and 16-row group g (v_i = x[16g + i, k] as fp32):
//   y[16g + j, k] = sum_i v_i * s_i * (-1)^popc(i & j) / 4,
// in the reference an fp64 matmul (every term exact), rounded fp64 -> fp32 -> x's dtype (round to nearest even,
// subnormals kept); a NaN y is a positive NaN.  Bit i of `sign_mask` is set iff s_i = -1 (the host derives it from
// RHT_SIGNS).
//
// Rotation (`nr_rotate`: RN32(y), the fp64 value rounded to fp32; `nr_dtype` then rounds to x's dtype).  Where the
// fp64 sum is exact, every summation order gives it, so the kernels take the cheapest; elsewhere they sum in the
// order i = 0..15 from +0, as the first kernels did (the reference's order there is cuBLAS's, unspecified: the GPU
// tests avoid such groups, see tests/backends/test_gpu_nvfp4.py).  Exactness: with E(a) the biased fp32 exponent field of
// |a| (subnormals and zero counted as 1), e_max = E(max |v_i|) (NaN dropped) and e_min = E(min non-zero |v_i|),
// every v_i is a multiple of 2^(e_min - 127 - (p - 1)) (p = 8 bf16, 11 fp16, 24 fp32 significand bits; fp16
// subnormals are multiples of 2^-24, which their fp32 exponent bound covers) and every signed partial sum of the
// v_i is below 16 * 2^(e_max - 127 + 1) in magnitude, so all partial sums are integer multiples of that power of
// two below 2^(span + p + 4), span = e_max - e_min; they are exact in a format of W significand bits when
// span + p + 4 <= W:
//   A. span <= 20 - p (16-bit dtypes: 12 bf16, 9 fp16) and e_max <= 250 (partial sums < 2^128: no fp32 overflow):
//      the 4-stage Walsh-Hadamard butterfly in fp32 (IEEE adds, no flush) on s_i v_i (sign flips by XOR, exact),
//      then RN32(S / 4) = fma(S, 0.25, +0): one rounding, and an exact -0 becomes +0 as in the sequential sum from
//      +0 (a sum of two values is -0 only when both are);
//   B. span <= 49 - p (41 bf16, 38 fp16, 25 fp32): the same butterfly in fp64, then RN32(fma(S, 0.25, +0));
//   C. otherwise: the sequential fp64 sum.
// Each butterfly node holds, up to its sign, a partial sum of the very terms of each output it feeds, so the bound
// covers the butterfly.  Non-finite inputs: an Inf makes e_max = 255 (never path A); a sum with +-Inf / NaN terms
// and no finite overflow (none in fp64) is NaN or +-Inf independently of the order, and a NaN input makes every y_j
// NaN in every order (all coefficients are non-zero), so paths A and B are exact for such groups too.
// Cost per element, path A: ~3 integer / min-max ops for the span, 1 XOR, 4 fp32 adds, 1 fma (the sequential fp64
// sum: 16 fp64 adds and 2 conversions, which run at 1/4 of the fp32 rate).
// The dtype rounding is monotone, so max |y| over the dtype values is RN_dtype(max |RN32(y)|): the amax kernel
// rounds once per block.
//
//   ted_nvfp4_rht_amax: *amax_bits (fp32 bits, 0 before the launch) = max |y| (NaN ignored); a streaming max.  One
//   thread per (16-row group, NR_APT = 8 bytes of columns, 4 for fp32): sixteen loads (consecutive threads take
//   consecutive pieces of a row: 256 / 128 contiguous bytes per warp and row), the NR_AEPT columns rotated in
//   registers, one atomicMax per block.  Optionally (the rowwise direction of the same quantize call) max |x| and
//   count_nonzero(x) from the same loads, which saves the separate amax pass over x (ted_amax_count).
//   ted_nvfp4_rht_col: the columnwise data / scales of y (the 1x16 rule of the kernels above: nv_block, nv_round,
//   a NaN scaled value -> code 7) with global amax amax[1], and per block partial[b][0..1] = (count_nonzero(y) -
//   non-zero codes, squared error) where the squared error is the torch path's: sum (x - z)^2 in fp64 against the
//   ORIGINAL x, z_i = fp32(sum_j deq_j * s_i * (-1)^popc(i & j) / 4) the inverse transform of the dequantized block
//   (NVFP4Tensor.dequantize("columnwise")).  That fp64 sum is exact in any order (the deq_j of a block are fp32
//   multiples of one power of two spanning < 8 binades), so it runs as a 4-stage butterfly.  The host sums the
//   partials (ted_sum_columns).
//   Layout: tiles of NR_ROWS = 256 rows (16 groups) x NR_TB = 64 bytes of columns (NR_TC = 32 16-bit or 16 fp32
//   columns), double-buffered in shared memory by cp.async (16-byte chunks, 64 contiguous bytes per row).  Thread
//   t takes word column p = t & 15 and group g = t >> 4 and reads its 16 words (NV_CW columns) down the group.
//   Bank-conflict free: a warp reads one row of group g (16 words, half the banks) and one of group g + 1; tile row
//   r is stored at row r ^ ((r >> 4) & 1), so odd groups land on the other 16 banks (a cp.async quarter warp still
//   writes two whole rows).  The codes (8 bytes per (column kk, group g)) and scale codes are staged in shared
//   memory: code slot g ^ p of column kk (p = kk / NV_CW, the writer's word column: the 16 lanes of a half warp hit
//   16 distinct 8-byte slots), scale byte g & 3 of word (g >> 2) ^ ((p >> 2) & 3).  Then consecutive threads store
//   whole rows of column data: per column and tile 128 contiguous bytes (16 groups; 8 threads x 16 bytes, reading
//   the 8 chunks of one staged column, halves swapped back where p is odd; 8-byte stores when M % 32 != 0 or in the
//   last, partial group tile) and 16 scale bytes (one 16-byte store when M % 256 == 0, else bytes).
#if TED_DTYPE == 0
#define NR_QNAN 0x7FC00000u
#define NR_ABS 0x7FFFFFFFu
#define NR_SPAN32 (-1)  // path A never applies to fp32 inputs
#define NR_SPAN64 25u
#elif TED_DTYPE == 1
#define NR_QNAN 0x7FC0u
#define NR_ABS 0x7FFFu
#define NR_SPAN32 12u
#define NR_SPAN64 41u
#else
#define NR_QNAN 0x7E00u
#define NR_ABS 0x7FFFu
#define NR_SPAN32 9u
#define NR_SPAN64 38u
#endif

__device__ __forceinline__ constexpr int nr_parity(int v) { return (v ^ (v >> 1) ^ (v >> 2) ^ (v >> 3)) & 1; }

__device__ __forceinline__ float nr_d2f(double d) {  // fp64 -> fp32, RN, no flush
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(d));
    return r;
}

// An fp32 value rounded to x's dtype (RN, subnormals kept), as fp32; NaN -> a positive NaN (16-bit types: the
// conversion's canonical NaN 0x7FFF, positive; fp32: the positive quiet NaN).  One conversion instruction for the
// 16-bit types (cvt.rn without .ftz keeps subnormals).
__device__ __forceinline__ float nr_dtype(float f) {
#if TED_DTYPE == 0
    return isnan(f) ? __uint_as_float(0x7FC00000u) : f;
#elif TED_DTYPE == 1
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return __uint_as_float((unsigned int)h << 16);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return ted_to_float(h);
#endif
}

// s_i as a sign bit (bit 31) to XOR into the bits of v_i.
__device__ __forceinline__ unsigned int nr_sign(unsigned int sign_mask, int i) {
    return (sign_mask << (31 - i)) & 0x80000000u;
}

// In-place Walsh-Hadamard butterflies: t_j <- sum_i (-1)^popc(i & j) t_i (IEEE, no flush).
__device__ __forceinline__ void nr_fwht32(float (&t)[16]) {
#pragma unroll
    for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
        for (int a = 0; a < 16; ++a) {
            if (a & h) continue;
            const float u = t[a], w = t[a + h];
            t[a] = ted_add(u, w);
            t[a + h] = ted_sub(u, w);
        }
    }
}

__device__ __forceinline__ void nr_fwht64(double (&t)[16]) {
#pragma unroll
    for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
        for (int a = 0; a < 16; ++a) {
            if (a & h) continue;
            const double u = t[a], w = t[a + h];
            t[a] = __dadd_rn(u, w);
            t[a + h] = __dsub_rn(u, w);
        }
    }
}

// y[j] = RN32(sum_i v_i * s_i * (-1)^popc(i & j) / 4) with the reference's fp64 value (see the header: paths A,
// B, C).  A NaN y[j] may carry either sign (nr_dtype makes it positive).
__device__ __forceinline__ void nr_rotate(const float (&v)[16], unsigned int sign_mask, float (&y)[16]) {
    float am = 0.0f;              // max |v_i|, NaN dropped
    unsigned int mn2 = 0xFFFFFFFFu;  // min over i of 2 |bits(v_i)| - 1 (mod 2^32: a zero gives 2^32 - 1)
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        am = ted_max(am, ted_abs(v[i]));
        mn2 = min(mn2, __float_as_uint(v[i]) * 2u - 1u);
    }
    const unsigned int e_max = max(__float_as_uint(am) >> 23, 1u);  // biased exponents, fp32 subnormals as 1
    const unsigned int e_min = max((mn2 + 1u) >> 24, 1u);          // all zero: mn2 + 1 == 0
    const unsigned int span = e_max - e_min;                         // e_max < e_min (NaN / zero only): huge -> C
#if TED_DTYPE != 0
    if (span <= NR_SPAN32 && e_max <= 250u) {  // A: |partial sums| < 2^(e_max - 127 + 5) <= 2^128
        float t[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) t[i] = __uint_as_float(__float_as_uint(v[i]) ^ nr_sign(sign_mask, i));
        nr_fwht32(t);
#pragma unroll
        for (int j = 0; j < 16; ++j) y[j] = ted_fma(t[j], 0.25f, 0.0f);
        return;
    }
#endif
    if (span <= NR_SPAN64) {  // B
        double t[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) t[i] = ted_f2d(__uint_as_float(__float_as_uint(v[i]) ^ nr_sign(sign_mask, i)));
        nr_fwht64(t);
#pragma unroll
        for (int j = 0; j < 16; ++j) y[j] = nr_d2f(__fma_rn(t[j], 0.25, 0.0));
        return;
    }
    // C: the sequential sum (every term exact)
    double t[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) t[i] = ted_f2d(v[i]) * (((sign_mask >> i) & 1u) ? -0.25 : 0.25);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        double acc = 0.0;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc = nr_parity(i & j) ? __dsub_rn(acc, t[i]) : __dadd_rn(acc, t[i]);
        y[j] = nr_d2f(acc);
    }
}

// z[i] = fp32(sum_j d[j] * s_i * (-1)^popc(i & j) / 4) (exact fp64 sums: butterfly order).
__device__ __forceinline__ void nr_inverse(const float (&d)[16], unsigned int sign_mask, float (&z)[16]) {
    double t[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) t[j] = ted_f2d(d[j]);
    nr_fwht64(t);
#pragma unroll
    for (int i = 0; i < 16; ++i) z[i] = nr_d2f(t[i] * (((sign_mask >> i) & 1u) ? -0.25 : 0.25));
}

// Element e (0 .. NV_CW - 1, low half first) of a 32-bit word of x's elements, as fp32.
__device__ __forceinline__ float nr_elem(unsigned int w, int e) {
#if TED_DTYPE == 0
    (void)e;
    return __uint_as_float(w);
#else
    return e ? ted_hi(w) : ted_lo(w);
#endif
}

// rht_amax: one piece of NR_APT bytes per thread and row (8 bytes, 4 columns for 16-bit types; 4 bytes, 1 column for
// fp32: the fp64 rotation paths of fp32 inputs need the registers)
#if TED_DTYPE == 0
#define NR_APT 4
typedef unsigned int nr_piece_t;
__device__ __forceinline__ unsigned int nr_piece_word(unsigned int p, int j) { (void)j; return p; }
#else
#define NR_APT 8
typedef uint2 nr_piece_t;
__device__ __forceinline__ unsigned int nr_piece_word(const uint2& p, int j) { return j ? p.y : p.x; }
#endif
#define NR_AEPT (NR_APT / TED_ELEM_BYTES)  // rht_amax: columns per thread (4 or 1)
#ifndef NR_AMAX_MIN_BLOCKS
#define NR_AMAX_MIN_BLOCKS 2  // resident blocks per SM (register cap); cupy_nvfp4.RHT_AMAX_BLOCKS_PER_SM must match
#endif

// max |x| (NaN dropped) and non-zero elements (NaN counts, -0 does not) of one 32-bit word folded into (xm, nz):
// ted_amax_count's rules (fp8_tensor.cu).  16-bit types: xm packed (bf16x2 / f16x2 max).
__device__ __forceinline__ void nr_fold_x(unsigned int w, unsigned int& xm, unsigned int& nz) {
#if TED_DTYPE == 0
    xm = __float_as_uint(ted_max(__uint_as_float(xm), ted_abs(__uint_as_float(w))));
    nz += (w & 0x7FFFFFFFu) ? 1u : 0u;
#else
    xm = ted_pmax(xm, w & 0x7FFF7FFFu);
    nz += ted_pk_total(ted_pk_nonzero(w));
#endif
}

// n_items = (M / 16) * (K / NR_AEPT) < 2^31 (checked by the host).  Unless null, also *row_amax_bits = max |x|
// (fp32 bits, NaN ignored) and *nonzero = count_nonzero(x), from the same loads (the rowwise direction's amax pass);
// each 0 before the launch.
extern "C" __global__ void __launch_bounds__(256, NR_AMAX_MIN_BLOCKS)
ted_nvfp4_rht_amax(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int sign_mask,
                   unsigned int* __restrict__ amax_bits, unsigned int* __restrict__ row_amax_bits,
                   unsigned long long* __restrict__ nonzero) {
    __shared__ float warp_max[8], warp_xmax[8];
    __shared__ unsigned long long warp_nz[8];
    const unsigned int n_c = (unsigned int)(K / NR_AEPT);  // pieces per row
    const unsigned int n_items = (unsigned int)(M / 16) * n_c;
    float am = 0.0f;       // max |RN32(y)| (NaN dropped)
    unsigned int xm = 0u;  // max |x| (fp32 bits, or packed 16-bit maxima)
    unsigned int nz = 0u;  // non-zero x: < 2^32 per thread for any tensor below 2^40 elements
    for (unsigned int it = blockIdx.x * 256u + threadIdx.x; it < n_items; it += gridDim.x * 256u) {
        const unsigned int g = it / n_c, c = it - g * n_c;
        const nr_piece_t* src = reinterpret_cast<const nr_piece_t*>(x + 16ll * g * K) + c;
        nr_piece_t ch[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) ch[i] = __ldg(src + (long long)i * n_c);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
#pragma unroll
            for (int j = 0; j < NR_APT / 4; ++j) nr_fold_x(nr_piece_word(ch[i], j), xm, nz);
        }
#pragma unroll
        for (int e = 0; e < NR_AEPT; ++e) {
            float v[16], y[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = nr_elem(nr_piece_word(ch[i], e / NV_CW), e % NV_CW);
            nr_rotate(v, sign_mask, y);
#pragma unroll
            for (int j = 0; j < 16; ++j) am = ted_max(am, ted_abs(y[j]));
        }
    }
#if TED_DTYPE == 0
    float xam = __uint_as_float(xm);
#else
    float xam = ted_max(ted_lo(xm), ted_hi(xm));
#endif
    unsigned long long nzl = nz;
    for (int off = 16; off > 0; off >>= 1) {
        am = ted_max(am, __shfl_down_sync(0xFFFFFFFFu, am, off));
        xam = ted_max(xam, __shfl_down_sync(0xFFFFFFFFu, xam, off));
        nzl += __shfl_down_sync(0xFFFFFFFFu, nzl, off);
    }
    if ((threadIdx.x & 31) == 0) {
        warp_max[threadIdx.x >> 5] = am;
        warp_xmax[threadIdx.x >> 5] = xam;
        warp_nz[threadIdx.x >> 5] = nzl;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < 8; ++w) {
            am = ted_max(am, warp_max[w]);
            xam = ted_max(xam, warp_xmax[w]);
            nzl += warp_nz[w];
        }
        atomicMax(amax_bits, __float_as_uint(nr_dtype(am)));  // non-negative floats order like their bits
        if (row_amax_bits != nullptr) atomicMax(row_amax_bits, __float_as_uint(xam));
        if (nonzero != nullptr) atomicAdd(nonzero, nzl);
    }
}

#define NR_ROWS 256                       // tile rows: 16 groups of 16
#define NR_TB 64                          // tile bytes per row
#define NR_TC (NR_TB / TED_ELEM_BYTES)    // tile columns (32 or 16)
#define NR_CH (NR_TB / 16)                // 16-byte chunks per tile row (4)
#define NR_WC (NR_TB / 4)                 // 32-bit word columns per tile row (16)

// Shared-memory row of tile row r (odd groups on the other 16 banks, see the header).
__device__ __forceinline__ int nr_prow(int r) { return r ^ ((r >> 4) & 1); }

__device__ __forceinline__ void nr_prefetch(const ted_raw_t* x, long long M, long long K, long long m0, long long k0,
                                            uint4* dst) {
#pragma unroll
    for (int j = 0; j < NR_ROWS * NR_CH / 256; ++j) {
        const int i = threadIdx.x + 256 * j;
        const int row = i / NR_CH, c = i % NR_CH;
        const long long m = m0 + row, k = k0 + (long long)c * NV_EPC;
        if (m < M && k < K) {  // K % 16 == 0: a chunk is entirely inside x or entirely outside
            const unsigned int saddr = (unsigned int)__cvta_generic_to_shared(dst + nr_prow(row) * NR_CH + c);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(saddr), "l"(x + m * K + k) : "memory");
        }
    }
}

// Word i of a column unit in shared memory: `col` = the shared address of the unit's word in shared row 16 g,
// `gb` = g & 1 (tile row 16 g + i is stored in shared row 16 g + (i ^ gb), rows of 64 bytes: nr_prow).  A volatile
// load: the block reads its words again where it needs them instead of holding them in registers across the
// rotation and the inverse (ted_nvfp4_rht_col stays at 128 registers without local memory).
__device__ __forceinline__ unsigned int nr_word_at(unsigned int col, int gb, int i) {
    unsigned int v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(col + 64u * (unsigned int)(i ^ gb)));
    return v;
}

// One (column, 16-row group) block: rotation of the 16 elements e of the unit's words, 1x16 quantization (packed
// codes and scale code stored to their staging slots as soon as known), fp64 squared error of the inverse-rotated
// dequantization against x, non-zero counts.
// NV_SR: the random bytes are block `sr_block` of the Philox draw `ph`.
__device__ __forceinline__ void nr_col_block(unsigned int col, int gb, int e, unsigned int sign_mask,
                                             const NvDir& cdir, float inv2688, const TedPhilox& ph,
                                             unsigned long long sr_block, uint2* packed_out,
                                             unsigned char* code_out, double& err, unsigned int& nz_y,
                                             unsigned int& nz_q) {
    float y[16];
    {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = nr_elem(nr_word_at(col, gb, i), e);
        nr_rotate(v, sign_mask, y);
    }
    float bam = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        y[j] = nr_dtype(y[j]);
        bam = ted_max(bam, ted_abs(y[j]));
        nz_y += ted_nonzero(y[j]) ? 1u : 0u;
    }
    const NvBlock blk = nv_block(bam, cdir, inv2688);
    *code_out = (unsigned char)blk.code;
#if NV_SR
    const uint4 rb = ted_philox_block(ph, sr_block);
#else
    (void)ph;
    (void)sr_block;
    const uint4 rb = make_uint4(0u, 0u, 0u, 0u);
#endif
    unsigned int lo = 0u, hi = 0u;
#if NR_STATS
    float deq[16];
#endif
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        // a NaN y (always a positive NaN, nr_dtype) needs no branch: min(|NaN|, 6) drops the NaN, so both roundings
        // give magnitude 6 (code 7, r = 6) with the sign bit of y, 0: the rule "NaN -> code 7"
        float r;
        const unsigned int c = nv_round(ted_mul(y[j], blk.mult), nv_byte(rb, j), r) |
                               ((__float_as_uint(y[j]) >> 28) & 8u);
        if (j < 8) lo |= c << (4 * j);
        else hi |= c << (4 * (j - 8));
#if NR_STATS
        // the code's sign on r * dscale (>= 0 or NaN) by its sign bit: a C negation would flush subnormals
        deq[j] = __uint_as_float(__float_as_uint(ted_mul(r, blk.dscale)) | ((c & 8u) << 28));
#else
        (void)r;
#endif
    }
    nz_q += nv_nonzero8(lo) + nv_nonzero8(hi);
    *packed_out = make_uint2(lo, hi);
#if NR_STATS
    float z[16];
    nr_inverse(deq, sign_mask, z);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const double d = ted_f2d(nr_elem(nr_word_at(col, gb, i), e)) - ted_f2d(z[i]);
        err += d * d;
    }
#else
    (void)err;
#endif
}

// amax[1]: the columnwise (rotated) global amax.  NV_SR only: the Philox seed and the offset of the [K, M] draw.
// partial: gridDim.x * 2.
#ifndef NR_MIN_BLOCKS
#define NR_MIN_BLOCKS 2  // resident blocks per SM (128 registers: no spills); cupy_nvfp4.RHT_BLOCKS_PER_SM must match
#endif
extern "C" __global__ void __launch_bounds__(256, NR_MIN_BLOCKS)
ted_nvfp4_rht_col(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int sign_mask,
                  const float* __restrict__ amax, float inv6, float inv2688, unsigned int seed_lo,
                  unsigned int seed_hi, unsigned int off_lo, unsigned int off_hi, unsigned char* __restrict__ col_data,
                  unsigned char* __restrict__ col_scales, double* __restrict__ partial) {
    __shared__ __align__(16) uint4 stage[2][NR_ROWS * NR_CH];
    __shared__ __align__(16) uint2 s_data[NR_TC * 16];        // column kk: 16 slots of 8 bytes (one per group)
    __shared__ __align__(16) unsigned int s_scale[NR_TC * 4];  // column kk: 16 scale codes
    __shared__ double scratch[32];
    const NvDir cdir = nv_dir(amax[1], inv6);
    // 32-bit tile arithmetic (the host keeps M, K and the tile count below 2^31; 64-bit offsets where stored)
    const unsigned int Mu = (unsigned int)M, Ku = (unsigned int)K;
    const unsigned int n_groups = Mu / 16u;
    const unsigned int n_tk = (Ku + NR_TC - 1) / NR_TC;
    const unsigned int n_tiles = ((Mu + NR_ROWS - 1) / NR_ROWS) * n_tk;
    const bool data16 = ((Mu / 2u) & 15u) == 0u;  // every row of column data starts 16-byte aligned
    const bool scale16 = (n_groups & 15u) == 0u;  // every tile has 16 groups, its scales 16-byte aligned
    const unsigned int p = threadIdx.x & 15u, g = threadIdx.x >> 4;  // word column, group of the tile
    double err = 0.0;
    unsigned int nz_y = 0u, nz_q = 0u;  // per thread: far below 2^32
    int buf = 0;
    if (blockIdx.x < n_tiles)
        nr_prefetch(x, M, K, (blockIdx.x / n_tk) * NR_ROWS, (blockIdx.x % n_tk) * NR_TC, stage[0]);
    asm volatile("cp.async.commit_group;\n" ::);
    for (unsigned int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x, buf ^= 1) {
        const unsigned int k0 = (tile % n_tk) * NR_TC;
        const unsigned int g0 = (tile / n_tk) * (NR_ROWS / 16);  // first group of the tile
        __syncthreads();  // the previous tile's readers of stage[buf ^ 1], s_data and s_scale are done
        if (tile + gridDim.x < n_tiles) {
            const unsigned int nt = tile + gridDim.x;
            nr_prefetch(x, M, K, (nt / n_tk) * NR_ROWS, (nt % n_tk) * NR_TC, stage[buf ^ 1]);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        __syncthreads();  // this tile is in stage[buf]

        // ---- rotate + quantize: thread (p, g), NV_CW columns
        if (g0 + g < n_groups && k0 + p * NV_CW < Ku) {
            // the unit's word in shared row 16 g (tile row 16 g + i sits in shared row 16 g + (i ^ (g & 1)))
            const unsigned int col = (unsigned int)__cvta_generic_to_shared(stage[buf]) + 4u * (16u * NR_WC * g + p);
#pragma unroll 1
            for (int e = 0; e < NV_CW; ++e) {  // not unrolled: the two columns' blocks would share the registers
                const unsigned int kk = p * NV_CW + e;
                nr_col_block(col, (int)(g & 1u), e, sign_mask, cdir, inv2688,
                             TedPhilox{seed_lo, seed_hi, off_lo, off_hi},
                             (unsigned long long)(k0 + kk) * n_groups + g0 + g, &s_data[kk * 16 + (g ^ p)],
                             reinterpret_cast<unsigned char*>(s_scale) + 16 * kk + 4 * ((g >> 2) ^ ((p >> 2) & 3)) +
                                 (g & 3),
                             err, nz_y, nz_q);
            }
        }
        __syncthreads();  // the tile's codes and scales are staged

        // ---- column data: per column 8 chunks of 16 bytes (groups 2c, 2c + 1), consecutive threads
#pragma unroll
        for (int u0 = 0; u0 < NR_TC * 8; u0 += 256) {
            const unsigned int u = u0 + threadIdx.x;
            const unsigned int kk = u >> 3, c = u & 7u;
            const unsigned int k = k0 + kk, gl = g0 + 2 * c;
            if (u < NR_TC * 8 && k < Ku && gl < n_groups) {
                const unsigned int s = (kk / NV_CW) & 15u;  // the writers' p
                uint4 v = reinterpret_cast<const uint4*>(s_data)[kk * 8 + (c ^ (s >> 1))];
                if (s & 1u) v = make_uint4(v.z, v.w, v.x, v.y);
                unsigned char* dst = col_data + (unsigned long long)k * (Mu / 2u) + 8u * gl;
                if (data16 && gl + 1 < n_groups) {
                    *reinterpret_cast<uint4*>(dst) = v;
                } else {
                    *reinterpret_cast<uint2*>(dst) = make_uint2(v.x, v.y);
                    if (gl + 1 < n_groups) *reinterpret_cast<uint2*>(dst + 8) = make_uint2(v.z, v.w);
                }
            }
        }
        // ---- scales: 16 bytes per column
        if (threadIdx.x < NR_TC && k0 + threadIdx.x < Ku) {
            const unsigned int kk = threadIdx.x;
            const unsigned int s2 = ((kk / NV_CW) >> 2) & 3u;
            const unsigned int* ws = s_scale + 4 * kk;
            const uint4 v = make_uint4(ws[s2], ws[1 ^ s2], ws[2 ^ s2], ws[3 ^ s2]);
            unsigned char* dst = col_scales + (unsigned long long)(k0 + kk) * n_groups + g0;
            if (scale16) {
                *reinterpret_cast<uint4*>(dst) = v;
            } else {
                const unsigned int ng = n_groups - g0;  // groups of this tile: min(16, ng)
#pragma unroll
                for (unsigned int j = 0; j < 16; ++j)
                    if (j < ng) dst[j] = (unsigned char)nv_byte(v, (int)j);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    const double uf = ted_block_sum((double)nz_y - (double)nz_q, scratch);
    const double se = ted_block_sum(err, scratch);
    if (threadIdx.x == 0) {
        partial[2 * (long long)blockIdx.x] = uf;
        partial[2 * (long long)blockIdx.x + 1] = se;
    }
}

// ---------------------------------------------------------------------------------------------- RHT, v1
// The first RHT kernels (one thread per (16-row group, column), 8-byte column-data stores scattered over K rows,
// the sequential fp64 rotation everywhere), kept as the tests' oracle of the fast ones: compiled only with
// -DNR_V1=1, which cupy_nvfp4 adds for `reference=True`.  Same arguments and results as the kernels above.
#if NR_V1
#define NR1_COLS 64
#define NR1_GROUPS (256 / NR1_COLS)

// fp64 -> fp32 -> x's dtype (both RN, subnormals kept) as raw bits; NaN -> positive quiet NaN.
__device__ __forceinline__ unsigned int nr_round(double d) {
    if (d != d) return NR_QNAN;
    const float f = nr_d2f(d);
#if TED_DTYPE == 0
    return __float_as_uint(f);
#elif TED_DTYPE == 1
    const unsigned int u = __float_as_uint(f);  // finite or +-Inf: round to nearest even on the bits
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// The (group g, column k) item of tile `tile` for this thread; false when it lies outside x.
__device__ __forceinline__ bool nr_item(long long tile, long long M, long long K, long long& g, long long& k) {
    const long long n_tk = (K + NR1_COLS - 1) / NR1_COLS;
    g = (tile / n_tk) * NR1_GROUPS + threadIdx.x / NR1_COLS;
    k = (tile % n_tk) * NR1_COLS + threadIdx.x % NR1_COLS;
    return 16 * g < M && k < K;
}

// v[i] = x[16g + i, k] as fp32.
__device__ __forceinline__ void nr_load(const ted_raw_t* __restrict__ x, long long K, long long g, long long k,
                                        float (&v)[16]) {
    const ted_raw_t* p = x + 16 * g * K + k;
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = ted_to_float((unsigned int)__ldg(p + i * K));
}

// raw[j]: the bits of y_j in x's dtype.
__device__ __forceinline__ void nr_forward(const float (&v)[16], unsigned int sign_mask, unsigned int (&raw)[16]) {
    double t[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) t[i] = ted_f2d(v[i]) * (((sign_mask >> i) & 1u) ? -0.25 : 0.25);  // exact
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        double acc = 0.0;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc = nr_parity(i & j) ? acc - t[i] : acc + t[i];
        raw[j] = nr_round(acc);
    }
}

extern "C" __global__ void __launch_bounds__(256)
ted_nvfp4_rht_amax_v1(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int sign_mask,
                   unsigned int* __restrict__ amax_bits) {
    const long long n_tiles = ((M / 16 + NR1_GROUPS - 1) / NR1_GROUPS) * ((K + NR1_COLS - 1) / NR1_COLS);
    float am = 0.0f;
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        long long g, k;
        if (!nr_item(tile, M, K, g, k)) continue;
        float v[16];
        unsigned int raw[16];
        nr_load(x, K, g, k, v);
        nr_forward(v, sign_mask, raw);
#pragma unroll
        for (int j = 0; j < 16; ++j) am = ted_max(am, ted_abs(ted_to_float(raw[j])));  // max drops NaN
    }
    ted_block_amax_into(am, amax_bits);
}

// amax[1]: the columnwise (rotated) global amax.  NV_SR only: the Philox seed and the offset of the [K, M] draw.
// partial: gridDim.x * 2.
extern "C" __global__ void __launch_bounds__(256, 3)
ted_nvfp4_rht_col_v1(const ted_raw_t* __restrict__ x, long long M, long long K, unsigned int sign_mask,
                  const float* __restrict__ amax, float inv6, float inv2688, unsigned int seed_lo,
                  unsigned int seed_hi, unsigned int off_lo, unsigned int off_hi, unsigned char* __restrict__ col_data,
                  unsigned char* __restrict__ col_scales, double* __restrict__ partial) {
    __shared__ double scratch[32];
    const NvDir cdir = nv_dir(amax[1], inv6);
    const long long n_tiles = ((M / 16 + NR1_GROUPS - 1) / NR1_GROUPS) * ((K + NR1_COLS - 1) / NR1_COLS);
    double err = 0.0;
    unsigned int nz_y = 0u, nz_q = 0u;  // per thread: far below 2^32
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        long long g, k;
        if (!nr_item(tile, M, K, g, k)) continue;
        float v[16], y[16], deq[16], z[16];
        unsigned int raw[16];
        nr_load(x, K, g, k, v);
        nr_forward(v, sign_mask, raw);
        float bam = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            y[j] = ted_to_float(raw[j]);
            bam = ted_max(bam, ted_abs(y[j]));
            nz_y += (raw[j] & NR_ABS) != 0u ? 1u : 0u;
        }
        const NvBlock blk = nv_block(bam, cdir, inv2688);
        col_scales[k * (M / 16) + g] = (unsigned char)blk.code;
        uint4 rb = make_uint4(0u, 0u, 0u, 0u);
#if NV_SR
        rb = ted_philox_block(TedPhilox{seed_lo, seed_hi, off_lo, off_hi}, (unsigned long long)(k * (M / 16) + g));
#else
        (void)seed_lo; (void)seed_hi; (void)off_lo; (void)off_hi;
#endif
        unsigned int lo = 0u, hi = 0u;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float q = ted_mul(y[j], blk.mult);
            unsigned int c;
            float r;
            if (isnan(q)) {
                c = 7u;
                r = 6.0f;
            } else {
                c = nv_round(q, nv_byte(rb, j), r) | ((__float_as_uint(y[j]) >> 28) & 8u);
            }
            if (j < 8) lo |= c << (4 * j);
            else hi |= c << (4 * (j - 8));
            // the code's sign on r * dscale (>= 0 or NaN) by its sign bit: a C negation would flush subnormals
            deq[j] = __uint_as_float(__float_as_uint(ted_mul(r, blk.dscale)) | ((c & 8u) << 28));
        }
        nz_q += nv_nonzero8(lo) + nv_nonzero8(hi);
        *reinterpret_cast<uint2*>(col_data + k * (M / 2) + 8 * g) = make_uint2(lo, hi);
        nr_inverse(deq, sign_mask, z);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const double e = ted_f2d(v[i]) - ted_f2d(z[i]);
            err += e * e;
        }
    }
    const double uf = ted_block_sum((double)nz_y - (double)nz_q, scratch);
    const double se = ted_block_sum(err, scratch);
    if (threadIdx.x == 0) {
        partial[2 * (long long)blockIdx.x] = uf;
        partial[2 * (long long)blockIdx.x + 1] = se;
    }
}
#endif  // NR_V1
