// MXFP8 quantize (tedebug.quantization.mxfp8, bit-identical): rowwise 1x32 and columnwise 32x1 blocks from one
// read of x [M, K] (M, K multiples of 32), with fused error statistics per direction.
// Fast kernel `ted_mxfp8_quantize16` (bf16 / fp16, used by tedebug/backends/cupy_mxfp8.py): a block of 8 warps
// owns a tile of 32 rows x 256 columns; warp w holds rows w, w+8, w+16, w+24 and lane l columns 8l..8l+7 (one
// 16-byte cp.async per row into shared memory, double-buffered: the next tile streams in while this one is
// processed).  Per tile:
//   1. amax: packed bf16x2/f16x2 maxima of |x| (NaN dropped); row blocks reduced over their 4 lanes by shuffles,
//      column blocks over the 8 warps through shared memory (thread t publishes column t's scale);
//      scale codes by a branch-free RCEIL; one __syncthreads_or flags a tile with a scale beyond the fast range.
//   2. per row of the chunk (re-read from shared memory), both directions: codes of |x| * 2^(127-code) (two per
//      cvt, satfinite RNE) with the sign bits of x OR-ed in afterwards; |deq| from the code bits (exact), error
//      (|x| - |deq|)^2 summed in fp32 over the thread's 32 elements (fast tiles: one fma per element with the
//      exact factor 2^(code-127+MAG); other tiles: the reference's fp32 product decode * scale);
//      underflows = elements with x != 0 and a zero code, counted as bytes of flags.
//   3. a non-finite fp32 error sum (Inf / NaN input, fp32 overflow) redoes that direction's chunk exactly: codes
//      with NaN -> 0x7F (stored again), fp64 error and underflows.
// 8-byte code stores (a warp writes 256 contiguous bytes per row).  The last block (atomic ticket) sums the
// per-block statistics into out[4] = (row underflows, row sq_err, col underflows, col sq_err).
// `ted_mxfp8_quantize` (the first kernel below) is the general kernel used for fp32 inputs: a warp owns
// 32 rows x 64 columns held in registers, per-block partials [grid, 4] added up by the last block.
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
                   double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out) {
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
    ted_store_dir_stats((double)row_uf, row_err, (double)col_uf, col_err, partial);
    // the last block adds the partials up (as ted_sum_columns would in a second launch: the same order)
    if (ted_last_block(ticket)) ted_finish_columns(partial, gridDim.x, 4, out, ticket);
}


// ------------------------------------------------------------------------------------------------ fast kernel
#if TED_DTYPE != 0
#define MX_K 256  // tile columns: 8 per lane
#ifndef MX_MIN_BLOCKS
#define MX_MIN_BLOCKS 4  // resident blocks per SM (register cap); cupy_mxfp8.MX_BLOCKS_PER_SM must match
#endif
#if TED_FP8 == 0
#define MX_MAG_EXP 120   // ted_fp8_mag(c) = |decode(c)| * 2^-MX_MAG_EXP (TED_FP8_MAG_SCALE = 2^MX_MAG_EXP)
#else
#define MX_MAG_EXP 112
#endif
#define MX_FAST_MAX_CODE (254 - MX_MAG_EXP)  // 2^(code-127+MX_MAG_EXP) is a finite fp32 up to this code
#define MX_MAG_MASK (0x7Fu << TED_FP8_MAG_SHIFT)

// E8M0 RCEIL code of amax * fp32(1/fp8_max) for amax >= 0 and not NaN (the packed maxima drop NaN): the
// branch-free form of ted_e8m0_rceil on that domain (exponent + 1 if any mantissa bit, fp32-subnormal ratio -> 1
// iff > 2^-127, +Inf and the top binade -> 254).
__device__ __forceinline__ unsigned int mx_code(float amax, float inv_fp8_max) {
    const unsigned int b = __float_as_uint(ted_mul(amax, inv_fp8_max));
    return min((b + (b >= 0x00800000u ? 0x007FFFFFu : 0x003FFFFFu)) >> 23, 254u);
}
// 2^(127-code) and 2^(code-127) for code <= 254 (ted_e8m0_encode_multiplier / ted_e8m0_to_float without NaN).
__device__ __forceinline__ float mx_mult(unsigned int code) {
    return __uint_as_float(code == 254u ? 0x00400000u : (254u - code) << 23);
}
__device__ __forceinline__ float mx_sinv(unsigned int code) {
    return __uint_as_float(code == 0u ? 0x00400000u : code << 23);
}
// sinv * 2^MX_MAG_EXP (exact for code <= MX_FAST_MAX_CODE).
__device__ __forceinline__ float mx_mag_factor(float sinv) { return ted_mul(sinv, TED_FP8_MAG_SCALE); }

// The two elements of a packed word as fp32 (exact; the sign is kept: callers take |x| through abs operand
// modifiers, which ptxas folds into FMUL / FFMA / FADD).
__device__ __forceinline__ void mx_unpack2(unsigned int w, float& lo, float& hi) {
#if TED_DTYPE == 1
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
#else
    lo = ted_lo(w);
    hi = ted_hi(w);
#endif
}
// Bit 7 of byte j set iff element j of the word pair (w0: elements 0, 1; w1: 2, 3) is not +-0 (NaN counts).
__device__ __forceinline__ unsigned int mx_nonzero4(unsigned int w0, unsigned int w1) {
    return __byte_perm((w0 & 0x7FFF7FFFu) + 0x7FFF7FFFu, (w1 & 0x7FFF7FFFu) + 0x7FFF7FFFu, 0x7531);
}
// The sign bits of the four elements at bit 7 of each byte (the FP8 sign position); other bits are junk.
__device__ __forceinline__ unsigned int mx_signs4(unsigned int w0, unsigned int w1) { return __byte_perm(w0, w1, 0x7531); }
// Codes q (no sign) with the signs of `sg` (mx_signs4) OR-ed in.
__device__ __forceinline__ unsigned int mx_sign_codes(unsigned int q, unsigned int sg) { return q | (sg & 0x80808080u); }
// Two FP8 codes of |a|, |b| (RNE, satfinite; low byte = a) in the low 16 bits, upper bits zero.
__device__ __forceinline__ unsigned int mx_cvt_abs2(float a, float b, float ma, float mb) {
    unsigned int r;
#if TED_FP8 == 0
    asm("{.reg .f32 u, v; .reg .b16 t, z; abs.f32 u, %1; abs.f32 v, %2; mul.rn.f32 u, u, %3; mul.rn.f32 v, v, %4;"
        " mov.b16 z, 0; cvt.rn.satfinite.e4m3x2.f32 t, v, u; mov.b32 %0, {t, z};}"
        : "=r"(r) : "f"(a), "f"(b), "f"(ma), "f"(mb));
#else
    asm("{.reg .f32 u, v; .reg .b16 t, z; abs.f32 u, %1; abs.f32 v, %2; mul.rn.f32 u, u, %3; mul.rn.f32 v, v, %4;"
        " mov.b16 z, 0; cvt.rn.satfinite.e5m2x2.f32 t, v, u; mov.b32 %0, {t, z};}"
        : "=r"(r) : "f"(a), "f"(b), "f"(ma), "f"(mb));
#endif
    return r;
}
__device__ __forceinline__ float mx_fnma_abs(float a, float b, float c) {  // |c| - a * b, one rounding, no flush
    float r;
    asm("{.reg .f32 t, u; neg.f32 t, %1; abs.f32 u, %3; fma.rn.f32 %0, t, %2, u;}" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

// One direction of one 8-element row chunk: FP8 codes of |f[e]| * m[e] (no sign) and err += (|f| - |deq|)^2 in
// fp32.  SLOW = false: s[e] = sinv * 2^MX_MAG_EXP is exact and |deq| = mag * s[e] exactly, so one fma gives the
// rounded difference; SLOW = true: s[e] = sinv and |deq| = (mag * 2^MX_MAG_EXP) * sinv
// rounded in fp32 like the reference (may overflow to Inf).  Returns the 8 codes (low byte = element 0).
template <bool SLOW>
__device__ __forceinline__ uint2 mx_quant8(const float (&f)[8], const float (&m)[8], const float (&s)[8],
                                           float& err) {
    unsigned int p[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = mx_cvt_abs2(f[2 * k], f[2 * k + 1], m[2 * k], m[2 * k + 1]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float mag = __uint_as_float((p[e >> 1] << (TED_FP8_MAG_SHIFT - 8 * (e & 1))) & MX_MAG_MASK);
        float d;
        if (SLOW) d = ted_abs_sub(f[e], ted_mul(ted_mul(mag, TED_FP8_MAG_SCALE), s[e]));
        else d = mx_fnma_abs(mag, s[e], f[e]);
        err = ted_fma(d, d, err);
    }
    return make_uint2(__byte_perm(p[0], p[1], 0x5410), __byte_perm(p[2], p[3], 0x5410));
}

// Underflow flags of four codes (bit 7 of each byte: x != 0 and the code is +-0); `nz` from mx_nonzero4, `q` the
// sign-free codes (every byte <= 0x7F, so the +0x7F per byte does not carry).
__device__ __forceinline__ unsigned int mx_underflow4(unsigned int nz, unsigned int q) {
    return (nz & ~(q + 0x7F7F7F7Fu) & 0x80808080u) >> 7;
}

struct MxRedo { double err; unsigned int uf; };

// Exact redo of one direction of this thread's 4 x 8 chunk (rare: the fp32 error sum was not finite): codes with
// NaN -> 0x7F stored again over the fast path's, the fp64 error and the underflows.  `xs` = the chunk in shared
// memory (row i at xs[256 i]); codes: by_row: byte i of c0 is row i's scale code, else byte e of (c0, c1) is
// column e's.  Not inlined: the hot loop keeps its registers.
__device__ __noinline__ MxRedo mx_redo(const uint4* xs, unsigned int c0, unsigned int c1, int by_row,
                                       unsigned char* dst, long long K, int active) {
    MxRedo r;
    r.err = 0.0;
    r.uf = 0u;
    for (int i = 0; i < 4; ++i) {
        const uint4 v = xs[256 * i];
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
        unsigned int out[2] = {0u, 0u};
        for (int e = 0; e < 8; ++e) {
            const float f = (e & 1) ? ted_hi(w[e >> 1]) : ted_lo(w[e >> 1]);
            const unsigned int sc = by_row ? (c0 >> (8 * i)) & 0xFFu : ((e < 4 ? c0 : c1) >> (8 * (e & 3))) & 0xFFu;
            const unsigned int c = ted_encode_fp8(ted_mul(f, mx_mult(sc)));
            out[e >> 2] |= c << (8 * (e & 3));
            r.uf += (ted_nonzero(f) && ted_fp8_is_zero(c)) ? 1u : 0u;
            const double d = ted_f2d(f) - ted_f2d(ted_mul(ted_decode_fp8(c), mx_sinv(sc)));
            r.err += d * d;
        }
        if (active) *reinterpret_cast<uint2*>(dst + 8 * K * i) = make_uint2(out[0], out[1]);
    }
    return r;
}

// Start the asynchronous copy of this thread's 4 x 16 bytes of tile (tm, tk) into its slots of `dst` (lanes
// beyond K copy nothing and later read zeros).
__device__ __forceinline__ void mx_prefetch(const ted_raw_t* x, long long K, unsigned int tm, unsigned int tk,
                                            int wid, int lane, uint4 (*dst)[256]) {
    const long long kc = (long long)tk * MX_K + 8 * lane;
    if (kc >= K) return;
    const ted_raw_t* src = x + ((long long)tm * 32 + wid) * K + kc;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int saddr = (unsigned int)__cvta_generic_to_shared(&dst[i][threadIdx.x]);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(saddr), "l"(src + 8 * K * i) : "memory");
    }
}

// Per-tile state of the quantize pass (registers).
struct MxTile {
    float rmult[4], rs[4];   // row i: multiplier, error factor (sinv, or sinv * 2^MX_MAG_EXP on fast tiles)
    float cmult[8], cs[8];   // column e: the same
};

// Both directions of the thread's 4 x 8 chunk (step 2 of the header); stores the codes.
template <bool SLOW>
__device__ __forceinline__ void mx_quant_chunk(const uint4* xs, MxTile& t, int do_row, int do_col, int active,
                                               unsigned char* rdst, unsigned char* cdst, long long K,
                                               float& re, float& ce, unsigned int& ruf, unsigned int& cuf) {
    if (!SLOW) {
#pragma unroll
        for (int i = 0; i < 4; ++i) t.rs[i] = mx_mag_factor(t.rs[i]);
#pragma unroll
        for (int e = 0; e < 8; ++e) t.cs[e] = mx_mag_factor(t.cs[e]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 v = active ? xs[256 * i] : make_uint4(0u, 0u, 0u, 0u);  // inactive slots were never written
        float f[8];
        mx_unpack2(v.x, f[0], f[1]);
        mx_unpack2(v.y, f[2], f[3]);
        mx_unpack2(v.z, f[4], f[5]);
        mx_unpack2(v.w, f[6], f[7]);
        const unsigned int nz0 = mx_nonzero4(v.x, v.y), nz1 = mx_nonzero4(v.z, v.w);
        const unsigned int sg0 = mx_signs4(v.x, v.y), sg1 = mx_signs4(v.z, v.w);
        if (do_row) {
            const float m[8] = {t.rmult[i], t.rmult[i], t.rmult[i], t.rmult[i],
                                t.rmult[i], t.rmult[i], t.rmult[i], t.rmult[i]};
            const float s[8] = {t.rs[i], t.rs[i], t.rs[i], t.rs[i], t.rs[i], t.rs[i], t.rs[i], t.rs[i]};
            const uint2 q = mx_quant8<SLOW>(f, m, s, re);
            ruf += mx_underflow4(nz0, q.x) + mx_underflow4(nz1, q.y);
            if (active) *reinterpret_cast<uint2*>(rdst + 8 * K * i) = make_uint2(mx_sign_codes(q.x, sg0), mx_sign_codes(q.y, sg1));
        }
        if (do_col) {
            const uint2 q = mx_quant8<SLOW>(f, t.cmult, t.cs, ce);
            cuf += mx_underflow4(nz0, q.x) + mx_underflow4(nz1, q.y);
            if (active) *reinterpret_cast<uint2*>(cdst + 8 * K * i) = make_uint2(mx_sign_codes(q.x, sg0), mx_sign_codes(q.y, sg1));
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, MX_MIN_BLOCKS)
ted_mxfp8_quantize16(const ted_raw_t* __restrict__ x, long long M, long long K, float inv_fp8_max,
                     int do_row, int do_col,
                     unsigned char* __restrict__ row_codes, unsigned char* __restrict__ row_scales,
                     unsigned char* __restrict__ col_codes, unsigned char* __restrict__ col_scales,
                     double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out) {
    __shared__ __align__(16) uint4 stage[2][4][256];             // [buffer][row i][thread]: 32 KB
    __shared__ __align__(16) unsigned int col_part[8][MX_K / 2];  // per warp: packed column max of its 4 rows
    __shared__ __align__(16) float4 col_sc[4][32];                // [j][lane]: (mult, sinv) of columns 8 lane + 2j, +1
    __shared__ __align__(8) unsigned char col_code[MX_K];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    // Tiles (tm, tk) in row-major order, block b takes b, b + G, ...; n_tiles < 2^31 (checked by the host).
    const unsigned int n_tk = (unsigned int)((K + MX_K - 1) / MX_K);
    const unsigned int n_tiles = (unsigned int)(M / 32) * n_tk;
    const unsigned int G = gridDim.x, step_m = G / n_tk, step_k = G % n_tk;
    unsigned int tm = blockIdx.x / n_tk, tk = blockIdx.x % n_tk;
    unsigned int ntm = tm + step_m, ntk = tk + step_k;
    if (ntk >= n_tk) { ntk -= n_tk; ++ntm; }

    double row_err = 0.0, col_err = 0.0;
    unsigned int uf_row = 0u, uf_col = 0u;
    int buf = 0;
    if (blockIdx.x < n_tiles) mx_prefetch(x, K, tm, tk, wid, lane, stage[0]);
    asm volatile("cp.async.commit_group;\n" ::);
    for (unsigned int tile = blockIdx.x; tile < n_tiles; tile += G, buf ^= 1) {
        if (tile + G < n_tiles) mx_prefetch(x, K, ntm, ntk, wid, lane, stage[buf ^ 1]);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        const long long m0 = (long long)tm * 32, k0 = (long long)tk * MX_K, kc = k0 + 8 * lane;
        const int active = kc < K;  // K % 32 == 0: the 4 lanes of a 32-column block agree
        const uint4* xs = &stage[buf][0][threadIdx.x];

        // ---- 1. amax and scales
        unsigned int rmax[4], cmax[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 v = active ? xs[256 * i] : make_uint4(0u, 0u, 0u, 0u);
            const unsigned int w[4] = {v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu, v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu};
            rmax[i] = ted_pmax(ted_pmax(w[0], w[1]), ted_pmax(w[2], w[3]));
#pragma unroll
            for (int k = 0; k < 4; ++k) cmax[k] = i ? ted_pmax(cmax[k], w[k]) : w[k];
        }
        *reinterpret_cast<uint4*>(&col_part[wid][4 * lane]) = make_uint4(cmax[0], cmax[1], cmax[2], cmax[3]);
        // row block amax: rows (0, 1) and (2, 3) packed in one word each, reduced over the 4 lanes of the block
        unsigned int r01 = ted_pmax(__byte_perm(rmax[0], rmax[1], 0x5410), __byte_perm(rmax[0], rmax[1], 0x7632));
        unsigned int r23 = ted_pmax(__byte_perm(rmax[2], rmax[3], 0x5410), __byte_perm(rmax[2], rmax[3], 0x7632));
        r01 = ted_pmax(r01, __shfl_xor_sync(0xFFFFFFFFu, r01, 1));
        r23 = ted_pmax(r23, __shfl_xor_sync(0xFFFFFFFFu, r23, 1));
        r01 = ted_pmax(r01, __shfl_xor_sync(0xFFFFFFFFu, r01, 2));
        r23 = ted_pmax(r23, __shfl_xor_sync(0xFFFFFFFFu, r23, 2));
        const float ramax[4] = {ted_lo(r01), ted_hi(r01), ted_lo(r23), ted_hi(r23)};
        MxTile t;
        unsigned int rcodes = 0u, slow = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int code = mx_code(ramax[i], inv_fp8_max);
            t.rmult[i] = mx_mult(code);
            t.rs[i] = mx_sinv(code);
            rcodes |= code << (8 * i);
            slow |= code > MX_FAST_MAX_CODE ? 1u : 0u;
        }
        if (do_row && active) {  // lane 4b + j stores the scale of row j of its block
            const int j = lane & 3;
            row_scales[(m0 + wid + 8 * j) * (K / 32) + (kc >> 5)] = (unsigned char)(rcodes >> (8 * j));
        }
        __syncthreads();  // col_part complete
        {
            const int c = threadIdx.x;  // tile column c lives in word c / 2 of every warp's col_part row
            unsigned int m = col_part[0][c >> 1];
#pragma unroll
            for (int w = 1; w < 8; ++w) m = ted_pmax(m, col_part[w][c >> 1]);
            const unsigned int code = mx_code((c & 1) ? ted_hi(m) : ted_lo(m), inv_fp8_max);
            reinterpret_cast<float2*>(&col_sc[(c >> 1) & 3][c >> 3])[c & 1] = make_float2(mx_mult(code), mx_sinv(code));
            col_code[c] = (unsigned char)code;
            slow |= code > MX_FAST_MAX_CODE ? 1u : 0u;
            if (do_col && k0 + c < K) col_scales[(m0 / 32) * K + k0 + c] = (unsigned char)code;
        }
        const int slow_tile = __syncthreads_or((int)slow);  // col_sc / col_code complete; col_part readers done
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 q = col_sc[j][lane];
            t.cmult[2 * j] = q.x;
            t.cs[2 * j] = q.y;
            t.cmult[2 * j + 1] = q.z;
            t.cs[2 * j + 1] = q.w;
        }

        // ---- 2. codes, errors, underflows
        const long long off = (m0 + wid) * K + kc;
        float re = 0.0f, ce = 0.0f;
        unsigned int ruf = 0u, cuf = 0u;  // per-byte counts (<= 8 per byte)
        if (slow_tile) mx_quant_chunk<true>(xs, t, do_row, do_col, active, row_codes + off, col_codes + off, K, re, ce, ruf, cuf);
        else mx_quant_chunk<false>(xs, t, do_row, do_col, active, row_codes + off, col_codes + off, K, re, ce, ruf, cuf);

        // ---- 3. totals; exact redo of a direction whose fp32 error sum is not finite
        if (do_row) {
            if (isfinite(re)) {
                row_err += ted_f2d(re);
                uf_row += ted_byte_total(ruf);
            } else {
                const MxRedo r = mx_redo(xs, rcodes, 0u, 1, row_codes + off, K, active);
                row_err += r.err;
                uf_row += r.uf;
            }
        }
        if (do_col) {
            if (isfinite(ce)) {
                col_err += ted_f2d(ce);
                uf_col += ted_byte_total(cuf);
            } else {
                const uint2 cc = *reinterpret_cast<const uint2*>(&col_code[8 * lane]);
                const MxRedo r = mx_redo(xs, cc.x, cc.y, 0, col_codes + off, K, active);
                col_err += r.err;
                uf_col += r.uf;
            }
        }
        tm = ntm;
        tk = ntk;
        ntm += step_m;
        ntk += step_k;
        if (ntk >= n_tk) { ntk -= n_tk; ++ntm; }
    }
    ted_store_dir_stats((double)uf_row, row_err, (double)uf_col, col_err, partial);
    if (ted_last_block(ticket)) ted_finish_columns(partial, gridDim.x, 4, out, ticket);
}
#endif
