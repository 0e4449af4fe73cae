// The statistics pass of `kernels/stats.cu` as device code (`stats_run` and what it uses), so that a kernel of another
// source can run the very pass: the algorithm, its numerics and why the row is exact are in stats.cu's header.
// `stats_run(..., block, blocks)` reduces x as block `block` of a grid of `blocks`, whatever the launch's own grid: a
// kernel may run several such blocks in one of its own (`ted_fp8_current_stats_cast16` of fp8_tensor.cu), and every
// block's partial, hence the row, is bit for bit that of a `ted_stats` launch of `blocks` blocks.
#pragma once
#include "common.cuh"

struct Acc {
    double n, mean, m2, sum, abs_sum, sq_sum;
    float mn, mx, nzmin;
    unsigned long long nz, nan, inf;
};

// A row's scratch area (`ted_stats_scratch`, `ted_stats_group_scratch`, `ted_stats_finish_rows` of stats.cu): this
// header, then the pass's block partials (Acc[blocks]).  blocks == 0: no partials waiting to become a row.
struct RowScratch {
    long long n;
    unsigned int blocks;
    unsigned int pad;
};

// The host sizes workspaces and row scratches by these (tedebug.backends.cupy_runtime.ACC_BYTES, cupy_stats).
static_assert(sizeof(Acc) == 88, "sizeof(Acc) changed: update cupy_runtime.ACC_BYTES");
static_assert(sizeof(RowScratch) == 16, "sizeof(RowScratch) changed: update cupy_stats._SCRATCH_HEADER_BYTES");

__device__ __forceinline__ Acc* scratch_partials(RowScratch* s) { return reinterpret_cast<Acc*>(s + 1); }

__device__ __forceinline__ void acc_identity(Acc& a) {
    a.n = 0.0; a.mean = 0.0; a.m2 = 0.0; a.sum = 0.0; a.abs_sum = 0.0; a.sq_sum = 0.0;
    a.mn = INFINITY; a.mx = -INFINITY; a.nzmin = INFINITY;
    a.nz = 0ull; a.nan = 0ull; a.inf = 0ull;
}

// a <- a (+) b: Chan et al. for (n, mean, m2), plain sums / extrema / counts for the rest.  With SHIFTED, the
// (n, mean, m2) fields hold (n, Σd, Σd²) of one shift K and are simply added (the in-block reduction).
template <bool SHIFTED = false>
__device__ __forceinline__ void acc_merge(Acc& a, const Acc& b) {
    if (SHIFTED) {
        a.n += b.n; a.mean += b.mean; a.m2 += b.m2;
    } else if (b.n > 0.0) {
        if (a.n == 0.0) {
            a.mean = b.mean; a.m2 = b.m2; a.n = b.n;
        } else {
            double n = a.n + b.n;
            double delta = b.mean - a.mean;
            a.mean += delta * (b.n / n);
            a.m2 += b.m2 + delta * delta * (a.n * b.n / n);
            a.n = n;
        }
    }
    a.sum += b.sum; a.abs_sum += b.abs_sum; a.sq_sum += b.sq_sum;
    a.mn = ted_min(a.mn, b.mn); a.mx = ted_max(a.mx, b.mx);
    a.nzmin = ted_min(a.nzmin, b.nzmin);
    a.nz += b.nz; a.nan += b.nan; a.inf += b.inf;
}

__device__ __forceinline__ Acc acc_shfl_down(const Acc& a, int off) {
    const unsigned m = 0xFFFFFFFFu;
    Acc b;
    b.n = __shfl_down_sync(m, a.n, off); b.mean = __shfl_down_sync(m, a.mean, off);
    b.m2 = __shfl_down_sync(m, a.m2, off); b.sum = __shfl_down_sync(m, a.sum, off);
    b.abs_sum = __shfl_down_sync(m, a.abs_sum, off); b.sq_sum = __shfl_down_sync(m, a.sq_sum, off);
    b.mn = __shfl_down_sync(m, a.mn, off); b.mx = __shfl_down_sync(m, a.mx, off);
    b.nzmin = __shfl_down_sync(m, a.nzmin, off);
    b.nz = __shfl_down_sync(m, a.nz, off); b.nan = __shfl_down_sync(m, a.nan, off);
    b.inf = __shfl_down_sync(m, a.inf, off);
    return b;
}

// Fixed-order block reduction; the result is valid in thread 0.
template <bool SHIFTED = false>
__device__ __forceinline__ Acc acc_block_reduce(Acc a) {
    __shared__ Acc warp_acc[32];
    for (int off = 16; off > 0; off >>= 1) {
        Acc b = acc_shfl_down(a, off);
        acc_merge<SHIFTED>(a, b);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_acc[warp] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) acc_merge<SHIFTED>(a, warp_acc[w]);
    }
    return a;
}

// Per-thread state while streaming.
struct ThreadStats {
    float mn, mx, nzmin, K;
    unsigned long long nz, nan, inf, count;
    double S, A, Q, D, DD;
};

__device__ __forceinline__ void ts_elems(ThreadStats& t, const float* f, int cnt) {
    float cs = 0.f, ca = 0.f, cq = 0.f, cd = 0.f, cdd = 0.f;
    unsigned int nz = 0;
#pragma unroll
    for (int e = 0; e < cnt; ++e) {
        float v = f[e];
        float a = ted_abs(v);
        const bool nonzero = ted_nonzero(v);  // NaN counts as non-zero (torch.count_nonzero)
        t.mn = ted_min(t.mn, v);
        t.mx = ted_max(t.mx, v);
        t.nzmin = ted_min(t.nzmin, nonzero ? a : INFINITY);
        nz += nonzero ? 1u : 0u;
        cs = ted_add(cs, v);
        ca = ted_add(ca, a);
        cq = ted_fma(v, v, cq);
        float d = ted_sub(v, t.K);
        cd = ted_add(cd, d);
        cdd = ted_fma(d, d, cdd);
    }
    t.nz += nz;
    t.count += (unsigned long long)cnt;
    if (isfinite(ted_add(cq, cdd))) {
        t.S += ted_f2d(cs); t.A += ted_f2d(ca); t.Q += ted_f2d(cq); t.D += ted_f2d(cd); t.DD += ted_f2d(cdd);
    } else {  // rare: NaN / Inf present or fp32 overflow -> redo these elements in fp64
#pragma unroll
        for (int e = 0; e < cnt; ++e) {
            double v = ted_f2d(f[e]);
            t.nan += isnan(v) ? 1ull : 0ull;
            t.inf += isinf(v) ? 1ull : 0ull;
            t.S += v; t.A += fabs(v); t.Q += v * v;
            double d = v - ted_f2d(t.K);
            t.D += d; t.DD += d * d;
        }
    }
}

#define VEC (16 / TED_ELEM_BYTES)

// ------------------------------------------------------------------------------------------------ fused kernel
__device__ __forceinline__ Acc acc_load_cg(const Acc* p) {
    Acc a;
    a.n = __ldcg(&p->n); a.mean = __ldcg(&p->mean); a.m2 = __ldcg(&p->m2); a.sum = __ldcg(&p->sum);
    a.abs_sum = __ldcg(&p->abs_sum); a.sq_sum = __ldcg(&p->sq_sum);
    a.mn = __ldcg(&p->mn); a.mx = __ldcg(&p->mx); a.nzmin = __ldcg(&p->nzmin);
    a.nz = __ldcg(&p->nz); a.nan = __ldcg(&p->nan); a.inf = __ldcg(&p->inf);
    return a;
}

__device__ __forceinline__ void acc_write_results(const Acc& a, double* out) {
    const double qnan = __longlong_as_double(0x7FF8000000000000ll);
    const bool has_nan = a.nan > 0ull;
    const float amax = ted_abs(ted_max(0.0f, ted_max(a.mx, -a.mn)));  // +0 for no element or only zeros
    out[0] = has_nan ? qnan : ted_f2d(a.mn);
    out[1] = has_nan ? qnan : ted_f2d(a.mx);
    out[2] = a.sum;
    out[3] = (a.nan + a.inf > 0ull) ? qnan : a.m2;
    out[4] = a.abs_sum;
    out[5] = a.sq_sum;
    out[6] = has_nan ? qnan : ted_f2d(amax);
    out[7] = has_nan ? qnan : ted_f2d(a.nzmin);
    out[8] = has_nan ? qnan : ted_f2d(amax);
    out[9] = (double)a.nz;
    out[10] = (double)a.nan;
    out[11] = (double)a.inf;
}

template <int CNT> struct SumsChunk { float f[CNT]; };
struct Sums64 { double S, A, Q, D, DD; unsigned long long nan, inf; };

// The fp64 sums of a chunk and its NaN / Inf counts; by value and not inlined so the hot loop stays lean.
template <int CNT>
__device__ __noinline__ Sums64 sums_fp64(const SumsChunk<CNT> c, float K) {
    Sums64 r = {0.0, 0.0, 0.0, 0.0, 0.0, 0ull, 0ull};
    for (int e = 0; e < CNT; ++e) {
        const double v = ted_f2d(c.f[e]);
        r.nan += isnan(v) ? 1ull : 0ull;
        r.inf += isinf(v) ? 1ull : 0ull;
        r.S += v; r.A += fabs(v); r.Q += v * v;
        const double d = v - ted_f2d(K);
        r.D += d; r.DD += d * d;
    }
    return r;
}

// fp32 sums of `cnt` elements added to the fp64 accumulators (the fp64 redo when they are not finite).
template <int CNT>
__device__ __forceinline__ void ts_sums(ThreadStats& t, const float* f) {
    float cs = 0.f, ca = 0.f, cq = 0.f, cd = 0.f, cdd = 0.f;
#pragma unroll
    for (int e = 0; e < CNT; ++e) {
        const float v = f[e];
        cs = ted_add(cs, v);
        ca = ted_add_abs(ca, v);
        cq = ted_fma(v, v, cq);
        const float d = ted_sub(v, t.K);
        cd = ted_add(cd, d);
        cdd = ted_fma(d, d, cdd);
    }
    if (isfinite(ted_add(cq, cdd))) {
        t.S += ted_f2d(cs); t.A += ted_f2d(ca); t.Q += ted_f2d(cq); t.D += ted_f2d(cd); t.DD += ted_f2d(cdd);
    } else {  // rare: NaN / Inf present or fp32 overflow -> redo these elements in fp64
        SumsChunk<CNT> c;
#pragma unroll
        for (int e = 0; e < CNT; ++e) c.f[e] = f[e];
        const Sums64 r = sums_fp64<CNT>(c, t.K);
        t.S += r.S; t.A += r.A; t.Q += r.Q; t.D += r.D; t.DD += r.DD; t.nan += r.nan; t.inf += r.inf;
    }
}

#if TED_DTYPE != 0
// Packed extrema / non-zero state of one thread (bf16x2 or f16x2 words).
struct PackedStats {
    unsigned int mn, mx, nzneg, cnt;
};

__device__ __forceinline__ void pk_init(PackedStats& p) {
    p.mn = (TED_HINF << 16) | TED_HINF;                        // +Inf, +Inf
    p.mx = ((TED_HINF | 0x8000u) << 16) | (TED_HINF | 0x8000u);  // -Inf, -Inf
    p.nzneg = 0x7FFF7FFFu;                                     // NaN, NaN: "no non-zero element yet"
    p.cnt = 0u;
}

__device__ __forceinline__ void pk_word(PackedStats& p, unsigned int w) {
    const unsigned int a = w & 0x7FFF7FFFu;
    const unsigned int neg = a + 0x7FFF7FFFu;  // per half: 0x8000 | (|h| - 1) for h != 0, NaN (0x7FFF) for h == 0
    p.mn = ted_pmin(p.mn, w);
    p.mx = ted_pmax(p.mx, w);
    p.nzneg = ted_pmax(p.nzneg, neg);
    p.cnt += (neg >> 15) & 0x00010001u;
}

// Minimum non-zero |x| encoded in one half of nzneg (+Inf when the half never saw a non-zero element).
__device__ __forceinline__ float pk_nzmin_half(unsigned int h) {
    const unsigned int m = h & 0x7FFFu;
    if (m > TED_HINF) return INFINITY;  // still NaN: no non-zero element
    return ted_to_float(m + 1u);
}

__device__ __forceinline__ void pk_fold(ThreadStats& t, const PackedStats& p) {
    t.mn = ted_min(t.mn, ted_min(ted_lo(p.mn), ted_hi(p.mn)));
    t.mx = ted_max(t.mx, ted_max(ted_lo(p.mx), ted_hi(p.mx)));
    t.nzmin = ted_min(t.nzmin, ted_min(pk_nzmin_half(p.nzneg & 0xFFFFu), pk_nzmin_half(p.nzneg >> 16)));
}

// NW words (2 NW elements): packed extrema, then the sums as one fp32 chunk.
template <int NW>
__device__ __forceinline__ void stats_words(ThreadStats& t, PackedStats& p, const unsigned int* w) {
    float f[2 * NW];
#pragma unroll
    for (int k = 0; k < NW; ++k) {
        pk_word(p, w[k]);
        f[2 * k] = ted_lo(w[k]);
        f[2 * k + 1] = ted_hi(w[k]);
    }
    ts_sums<2 * NW>(t, f);
}
#endif

// The end of a pass: merges the `blocks` block partials in a fixed order and writes the row (and, with AMAX, what
// the amax pass writes), then sets *ticket to 0.  Run by the last block of the pass, or (`ted_stats_finish_rows`)
// by a later launch, one block per row: the same merges in the same order, so the same row bit for bit.
template <bool AMAX>
__device__ __forceinline__ void stats_finish(long long n, const Acc* __restrict__ partial, unsigned int blocks,
                                          unsigned int* __restrict__ ticket, double* __restrict__ out,
                                          float* __restrict__ amax_out, int mode, float fp8_max, float epsilon,
                                          int pow2, float* __restrict__ scale_out, float* __restrict__ scale_inv_out,
                                          unsigned long long* __restrict__ nz_out) {
    Acc r;
    acc_identity(r);
    for (int b = threadIdx.x; b < (int)blocks; b += blockDim.x) acc_merge(r, acc_load_cg(partial + b));
    r = acc_block_reduce(r);
    if (threadIdx.x == 0) {
        out[0] = (double)n;
        acc_write_results(r, out + 1);
        if (AMAX) {
            // max |x| is the magnitude of the maximum or of the minimum (bit-level |.|: no flush of a subnormal
            // under -ftz); no non-NaN element leaves min = +Inf > max = -Inf, whose amax is 0 as in the amax pass
            const float amax = r.mn <= r.mx ? ted_max(ted_abs(r.mn), ted_abs(r.mx)) : 0.0f;
            ted_amax_outputs(amax, amax_out, mode, fp8_max, epsilon, pow2, scale_out, scale_inv_out);
            if (nz_out != nullptr) *nz_out = r.nz;
        }
        *ticket = 0u;
    }
}

// SCRATCH: `partial` is a row's scratch area's partials (`scratch_partials`): the pass leaves its block partials
// there, block 0 fills in the header, and the row is written later (`ted_stats_finish_rows`): no ticket, no last
// block's merge inside the pass.
template <bool AMAX, bool SCRATCH = false>
__device__ __forceinline__ void stats_run(const ted_raw_t* __restrict__ x, long long n, Acc* __restrict__ partial,
                                          unsigned int* __restrict__ ticket, double* __restrict__ out,
                                          float* __restrict__ amax_out, int mode, float fp8_max, float epsilon,
                                          int pow2, float* __restrict__ scale_out, float* __restrict__ scale_inv_out,
                                          unsigned long long* __restrict__ nz_out, const unsigned int block,
                                          const unsigned int blocks) {
    // `block` of `blocks`: this block's place in the blocks that reduce x (blockIdx.x and gridDim.x for a lone launch)
    const long long nvec = n / VEC;
    const long long tail = n - nvec * VEC;
    const long long gtid = (long long)block * blockDim.x + threadIdx.x;
    const long long stride = (long long)blocks * blockDim.x;

    ThreadStats t;
    t.mn = INFINITY; t.mx = -INFINITY; t.nzmin = INFINITY;
    t.nz = 0ull; t.nan = 0ull; t.inf = 0ull; t.count = 0ull;
    t.S = 0.0; t.A = 0.0; t.Q = 0.0; t.D = 0.0; t.DD = 0.0;
    long long k_index = (long long)block * blockDim.x * VEC;  // the block's shift: its first element
    if (k_index >= n) k_index = 0;
    const float k0 = ted_load(x, k_index);
    t.K = isfinite(k0) ? k0 : 0.0f;

    const uint4* xv = reinterpret_cast<const uint4*>(x);
    long long i = gtid;
    unsigned long long vecs = 0ull;
#if TED_DTYPE != 0
    PackedStats p;
    pk_init(p);
    for (; i + 3 * stride < nvec; i += 4 * stride) {
        const uint4 a = __ldcs(xv + i), b = __ldcs(xv + i + stride);
        const uint4 c = __ldcs(xv + i + 2 * stride), d = __ldcs(xv + i + 3 * stride);
        const unsigned int w0[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        const unsigned int w1[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
        stats_words<8>(t, p, w0);
        stats_words<8>(t, p, w1);
        t.nz += ted_pk_total(p.cnt);  // <= 16 per half: flushed every iteration
        p.cnt = 0u;
        vecs += 4ull;
    }
    for (; i < nvec; i += stride) {
        const uint4 a = __ldcs(xv + i);
        const unsigned int w0[4] = {a.x, a.y, a.z, a.w};
        stats_words<4>(t, p, w0);
        t.nz += ted_pk_total(p.cnt);
        p.cnt = 0u;
        vecs += 1ull;
    }
    pk_fold(t, p);
#else
    for (; i + 3 * stride < nvec; i += 4 * stride) {
        const uint4 a = __ldcs(xv + i), b = __ldcs(xv + i + stride);
        const uint4 c = __ldcs(xv + i + 2 * stride), d = __ldcs(xv + i + 3 * stride);
        const float f0[8] = {__uint_as_float(a.x), __uint_as_float(a.y), __uint_as_float(a.z), __uint_as_float(a.w),
                             __uint_as_float(b.x), __uint_as_float(b.y), __uint_as_float(b.z), __uint_as_float(b.w)};
        const float f1[8] = {__uint_as_float(c.x), __uint_as_float(c.y), __uint_as_float(c.z), __uint_as_float(c.w),
                             __uint_as_float(d.x), __uint_as_float(d.y), __uint_as_float(d.z), __uint_as_float(d.w)};
        ts_elems(t, f0, 8);
        ts_elems(t, f1, 8);
        vecs += 4ull;
    }
    for (; i < nvec; i += stride) {
        const uint4 a = __ldcs(xv + i);
        const float f0[4] = {__uint_as_float(a.x), __uint_as_float(a.y), __uint_as_float(a.z), __uint_as_float(a.w)};
        ts_elems(t, f0, 4);
        vecs += 1ull;
    }
#endif
    t.count = vecs * (unsigned long long)VEC;
    if (gtid < tail) {  // the n % VEC last elements, one per thread (per-element fp32 code)
        float f[1];
        f[0] = ted_load(x, nvec * VEC + gtid);
        ts_elems(t, f, 1);  // adds 1 to t.count
    }

    Acc a;  // (n, mean, m2) hold (n, Σd, Σd²) of the block's shift until thread 0 converts them
    a.n = (double)t.count; a.mean = t.D; a.m2 = t.DD;
    a.sum = t.S; a.abs_sum = t.A; a.sq_sum = t.Q;
    a.mn = t.mn; a.mx = t.mx; a.nzmin = t.nzmin;
    a.nz = t.nz; a.nan = t.nan; a.inf = t.inf;
    a = acc_block_reduce<true>(a);
    if (threadIdx.x == 0) {
        const double cnt = a.n, d = a.mean, dd = a.m2;
        a.mean = cnt > 0.0 ? ted_f2d(t.K) + d / cnt : 0.0;
        a.m2 = cnt > 0.0 ? fmax(dd - d * (d / cnt), 0.0) : 0.0;
        partial[block] = a;
        if (SCRATCH && block == 0) {
            RowScratch* header = reinterpret_cast<RowScratch*>(partial) - 1;
            header->n = n;
            header->blocks = blocks;
        }
    }
    if (SCRATCH || !ted_last_block_of(ticket, blocks)) return;
    stats_finish<AMAX>(n, partial, blocks, ticket, out, amax_out, mode, fp8_max, epsilon, pow2, scale_out,
                       scale_inv_out, nz_out);
}
