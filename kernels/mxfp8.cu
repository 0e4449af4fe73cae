// MXFP8 quantize (tedebug.quantization.mxfp8, bit-identical): rowwise 1x32 and columnwise 32x1 blocks from one
// read of x [M, K] (M, K multiples of 32), with fused error statistics per direction.
// Fast kernel `ted_mxfp8_quantize16` (bf16 / fp16, used by tedebug/backends/cupy_kernels.py): a block of 8 warps
// owns a tile of 32 rows x 256 columns; warp w holds rows w, w+8, w+16, w+24 and lane l columns 8l..8l+7 (one
// 16-byte load per row, double-buffered with cp.async so the next tile streams in while this one is processed).
// Row block amax: packed bf16x2/f16x2 max over the lane's 8 values, two rows packed per
// word, two xor shuffles over the 4 lanes of a 32-column block.  Column amax: each warp's packed max over its 4
// rows goes to shared memory; thread t reduces column t over the 8 warps and publishes the column's multiplier and
// decode scale in shared memory.  Per element and direction: q = satfinite-RNE-FP8(x * 2^(127-code)) (two per
// cvt), deq = decode(q) * 2^(code-127) in fp32, (x - deq)^2 summed in fp32 over the thread's 32 elements then in
// fp64 (a non-finite chunk is redone exactly, NaN codes -> 0x7F); underflows = count_nonzero(x) - non-zero codes.
// 8-byte code stores (a warp writes 256 contiguous bytes per row).  The last block (atomic ticket) sums the
// per-block statistics into out[4] = (row underflows, row sq_err, col underflows, col sq_err).
// `ted_mxfp8_quantize` (below the fast kernel's helpers) is the general kernel used for fp32 inputs: a warp owns
// 32 rows x 64 columns held in registers, per-block partials [grid, 4] summed by ted_sum_columns.
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


// ------------------------------------------------------------------------------------------------ fast kernel
#if TED_DTYPE != 0
#define MX_K 256  // tile columns: 8 per lane
#ifndef MX_MIN_BLOCKS
#define MX_MIN_BLOCKS 3  // resident blocks per SM (register cap); cupy_kernels.MX_BLOCKS_PER_SM must match
#endif

struct MxChunk { uint4 v[4]; };                       // rows i = 0..3 (tile rows w + 8 i), 8 columns each
struct MxScales { float mult[8]; float sinv[8]; };    // per row (index i) or per column (index e)
struct MxRedo { unsigned int c[4][2]; double err; };

// Rare path of one direction (a non-finite fp32 error sum): exact codes (NaN -> 0x7F) and the fp64 error.
// By value and not inlined, so the hot loop keeps its arrays in registers.
__device__ __noinline__ MxRedo mx_redo(const MxChunk ch, const MxScales s, int by_row) {
    MxRedo r;
    r.err = 0.0;
    for (int i = 0; i < 4; ++i) {
        const unsigned int w[4] = {ch.v[i].x, ch.v[i].y, ch.v[i].z, ch.v[i].w};
        r.c[i][0] = 0u;
        r.c[i][1] = 0u;
        for (int e = 0; e < 8; ++e) {
            const float f = (e & 1) ? ted_hi(w[e >> 1]) : ted_lo(w[e >> 1]);
            const int j = by_row ? i : e;
            const unsigned int c = ted_encode_fp8(ted_mul(f, s.mult[j]));
            r.c[i][e >> 2] |= c << (8 * (e & 3));
            const double d = ted_f2d(f) - ted_f2d(ted_mul(ted_decode_fp8(c), s.sinv[j]));
            r.err += d * d;
        }
    }
    return r;
}

__device__ __forceinline__ unsigned int mx_code_count(const unsigned int (*c)[2]) {
    unsigned int cnt = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) cnt += ted_fp8x4_nonzero(c[i][0]) + ted_fp8x4_nonzero(c[i][1]);
    return ted_byte_total(cnt);  // <= 32
}

// Start the asynchronous copy of this thread's 4 x 16 bytes of `tile` into its slots of `dst` (inactive lanes,
// beyond K, copy nothing and later read zeros).
__device__ __forceinline__ void mx_prefetch(const ted_raw_t* x, long long K, long long n_tk, long long tile, int wid,
                                            int lane, uint4 (*dst)[256]) {
    const long long m0 = (tile / n_tk) * 32, kc = (tile % n_tk) * MX_K + 8 * lane;
    if (kc >= K) return;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int saddr = (unsigned int)__cvta_generic_to_shared(&dst[i][threadIdx.x]);
        const ted_raw_t* src = x + (m0 + wid + 8 * i) * K + kc;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(saddr), "l"(src) : "memory");
    }
}

extern "C" __global__ void __launch_bounds__(256, MX_MIN_BLOCKS)
ted_mxfp8_quantize16(const ted_raw_t* __restrict__ x, long long M, long long K, float inv_fp8_max,
                     int do_row, int do_col,
                     unsigned char* __restrict__ row_codes, unsigned char* __restrict__ row_scales,
                     unsigned char* __restrict__ col_codes, unsigned char* __restrict__ col_scales,
                     double* __restrict__ partial, unsigned int* __restrict__ ticket, double* __restrict__ out) {
    __shared__ __align__(16) unsigned int col_part[8][MX_K / 2];  // per warp: packed column max of its 4 rows
    __shared__ __align__(16) float col_mult[MX_K];
    __shared__ __align__(16) float col_sinv[MX_K];
    __shared__ double scratch[32];
    __shared__ __align__(16) uint4 stage[2][4][256];  // [buffer][row i][thread]: 32 KB
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const long long n_tk = (K + MX_K - 1) / MX_K;
    const long long n_tiles = (M / 32) * n_tk;

    double row_err = 0.0, col_err = 0.0;
    unsigned long long nzx = 0ull, nz_row = 0ull, nz_col = 0ull;
    // Double-buffered input: while a tile is processed, the thread's 4 x 16 bytes of the next tile are in flight
    // (cp.async into its own slots of stage[buf ^ 1]; each thread reads back only what it copied, so no barrier).
    int buf = 0;
    if ((long long)blockIdx.x < n_tiles) mx_prefetch(x, K, n_tk, (long long)blockIdx.x, wid, lane, stage[0]);
    asm volatile("cp.async.commit_group;\n" ::);
    for (long long tile = blockIdx.x; tile < n_tiles; tile += gridDim.x, buf ^= 1) {
        const long long m0 = (tile / n_tk) * 32, k0 = (tile % n_tk) * MX_K;
        const long long kc = k0 + 8 * lane;
        const bool active = kc < K;  // K % 32 == 0: the 4 lanes of a 32-column block agree
        if (tile + gridDim.x < n_tiles) mx_prefetch(x, K, n_tk, tile + gridDim.x, wid, lane, stage[buf ^ 1]);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        MxChunk ch;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            ch.v[i] = active ? stage[buf][i][threadIdx.x] : make_uint4(0u, 0u, 0u, 0u);
        // |x| maxima (packed, NaN dropped against the initial 0) and the non-zero count
        unsigned int xcnt = 0u, rmax[4], cmax[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int w[4] = {ch.v[i].x, ch.v[i].y, ch.v[i].z, ch.v[i].w};
            rmax[i] = 0u;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned int a = w[k] & 0x7FFF7FFFu;
                xcnt += ted_pk_nonzero(w[k]);
                rmax[i] = ted_pmax(rmax[i], a);
                cmax[k] = ted_pmax(cmax[k], a);
            }
        }
        nzx += ted_pk_total(xcnt);
        *reinterpret_cast<uint4*>(&col_part[wid][4 * lane]) = make_uint4(cmax[0], cmax[1], cmax[2], cmax[3]);
        // row block amax: rows (0, 1) and (2, 3) packed in one word each, reduced over the 4 lanes of the block
        unsigned int r01 = ted_pmax(__byte_perm(rmax[0], rmax[1], 0x5410), __byte_perm(rmax[0], rmax[1], 0x7632));
        unsigned int r23 = ted_pmax(__byte_perm(rmax[2], rmax[3], 0x5410), __byte_perm(rmax[2], rmax[3], 0x7632));
        r01 = ted_pmax(r01, __shfl_xor_sync(0xFFFFFFFFu, r01, 1));
        r23 = ted_pmax(r23, __shfl_xor_sync(0xFFFFFFFFu, r23, 1));
        r01 = ted_pmax(r01, __shfl_xor_sync(0xFFFFFFFFu, r01, 2));
        r23 = ted_pmax(r23, __shfl_xor_sync(0xFFFFFFFFu, r23, 2));
        const float ramax[4] = {ted_lo(r01), ted_hi(r01), ted_lo(r23), ted_hi(r23)};
        __syncthreads();  // col_part complete; the previous tile's col_mult / col_sinv readers are done
        {
            const int c = threadIdx.x;  // tile column c lives in word c / 2 of every warp's col_part row
            unsigned int m = col_part[0][c >> 1];
#pragma unroll
            for (int w = 1; w < 8; ++w) m = ted_pmax(m, col_part[w][c >> 1]);
            const float am = (c & 1) ? ted_hi(m) : ted_lo(m);
            const unsigned int code = ted_e8m0_rceil(ted_mul(am, inv_fp8_max));
            col_mult[c] = ted_e8m0_encode_multiplier(code);
            col_sinv[c] = ted_e8m0_to_float(code);
            if (do_col && k0 + c < K) col_scales[(m0 / 32) * K + k0 + c] = (unsigned char)code;
        }
        __syncthreads();  // col_mult / col_sinv complete; col_part readers are done
        MxScales rs, cs;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int code = ted_e8m0_rceil(ted_mul(ramax[i], inv_fp8_max));
            rs.mult[i] = ted_e8m0_encode_multiplier(code);
            rs.sinv[i] = ted_e8m0_to_float(code);
            rs.mult[i + 4] = 0.0f;
            rs.sinv[i + 4] = 0.0f;
            if (do_row && active && (lane & 3) == 0)
                row_scales[(m0 + wid + 8 * i) * (K / 32) + (kc >> 5)] = (unsigned char)code;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            cs.mult[e] = col_mult[8 * lane + e];
            cs.sinv[e] = col_sinv[8 * lane + e];
        }
        unsigned int rc[4][2], cc[4][2];
        float re32 = 0.0f, ce32 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int w[4] = {ch.v[i].x, ch.v[i].y, ch.v[i].z, ch.v[i].w};
            unsigned int rq[4], cq[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float f0 = ted_lo(w[k]), f1 = ted_hi(w[k]);
                rq[k] = 0u;
                cq[k] = 0u;
                // (x - deq)^2 = (|x| - |deq|)^2 (deq has the sign of x or is 0); |deq| = |decode(q)| * scale
                if (do_row) {
                    rq[k] = ted_encode_fp8x2(ted_mul(f0, rs.mult[i]), ted_mul(f1, rs.mult[i]));
                    const float d0 = ted_abs_sub(f0, ted_mul(ted_mul(ted_fp8_mag(rq[k], 0), TED_FP8_MAG_SCALE), rs.sinv[i]));
                    const float d1 = ted_abs_sub(f1, ted_mul(ted_mul(ted_fp8_mag(rq[k], 1), TED_FP8_MAG_SCALE), rs.sinv[i]));
                    re32 = ted_fma(d0, d0, re32);
                    re32 = ted_fma(d1, d1, re32);
                }
                if (do_col) {
                    cq[k] = ted_encode_fp8x2(ted_mul(f0, cs.mult[2 * k]), ted_mul(f1, cs.mult[2 * k + 1]));
                    const float d0 = ted_abs_sub(f0, ted_mul(ted_mul(ted_fp8_mag(cq[k], 0), TED_FP8_MAG_SCALE), cs.sinv[2 * k]));
                    const float d1 = ted_abs_sub(f1, ted_mul(ted_mul(ted_fp8_mag(cq[k], 1), TED_FP8_MAG_SCALE), cs.sinv[2 * k + 1]));
                    ce32 = ted_fma(d0, d0, ce32);
                    ce32 = ted_fma(d1, d1, ce32);
                }
            }
            rc[i][0] = rq[0] | (rq[1] << 16);
            rc[i][1] = rq[2] | (rq[3] << 16);
            cc[i][0] = cq[0] | (cq[1] << 16);
            cc[i][1] = cq[2] | (cq[3] << 16);
        }
        if (do_row) {
            if (isfinite(re32)) row_err += ted_f2d(re32);
            else {
                const MxRedo r = mx_redo(ch, rs, 1);
#pragma unroll
                for (int i = 0; i < 4; ++i) { rc[i][0] = r.c[i][0]; rc[i][1] = r.c[i][1]; }
                row_err += r.err;
            }
            nz_row += mx_code_count(rc);
            if (active) {
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    *reinterpret_cast<uint2*>(row_codes + (m0 + wid + 8 * i) * K + kc) = make_uint2(rc[i][0], rc[i][1]);
            }
        }
        if (do_col) {
            if (isfinite(ce32)) col_err += ted_f2d(ce32);
            else {
                const MxRedo r = mx_redo(ch, cs, 0);
#pragma unroll
                for (int i = 0; i < 4; ++i) { cc[i][0] = r.c[i][0]; cc[i][1] = r.c[i][1]; }
                col_err += r.err;
            }
            nz_col += mx_code_count(cc);
            if (active) {
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    *reinterpret_cast<uint2*>(col_codes + (m0 + wid + 8 * i) * K + kc) = make_uint2(cc[i][0], cc[i][1]);
            }
        }
    }
    const double t0 = ted_block_sum((double)nzx - (double)nz_row, scratch);
    const double t1 = ted_block_sum(row_err, scratch);
    const double t2 = ted_block_sum((double)nzx - (double)nz_col, scratch);
    const double t3 = ted_block_sum(col_err, scratch);
    if (threadIdx.x == 0) {
        double* p = partial + (long long)blockIdx.x * 4;
        p[0] = t0; p[1] = t1; p[2] = t2; p[3] = t3;
    }
    if (ted_last_block(ticket)) ted_finish_columns(partial, gridDim.x, 4, out, ticket);
}
#endif
