// Basic statistics of one tensor in one read pass (tedebug.backends.torch_ref.basic_partials, bit-compatible).
// Stage 1 `ted_stats_partial`: grid-stride over 16-byte vectors, each thread keeps min / max / amax / min non-zero
// |x| / non-zero count in fp32 registers and short fp32 sums (one 16-byte vector = 4..8 elements) that are added to
// fp64 accumulators; the variance uses sums shifted by the thread's first element K (d = x - K) and is turned into
// (n, mean, M2) once per thread, then merged with Chan's formula in fp64 (warp shuffles, then shared memory) into
// one partial per block.  A vector whose fp32 sums are not finite (NaN / Inf present, or fp32 overflow) is redone in
// fp64 and counts NaN / Inf exactly.  Stage 2 `ted_stats_finalize`: one block merges the block partials in a fixed
// order and writes the 12 float64 partials in torch_ref order.
#include "common.cuh"

struct Acc {
    double n, mean, m2, sum, abs_sum, sq_sum;
    float mn, mx, amax, nzmin;
    unsigned long long nz, nan, inf;
};

__device__ __forceinline__ void acc_identity(Acc& a) {
    a.n = 0.0; a.mean = 0.0; a.m2 = 0.0; a.sum = 0.0; a.abs_sum = 0.0; a.sq_sum = 0.0;
    a.mn = INFINITY; a.mx = -INFINITY; a.amax = 0.0f; a.nzmin = INFINITY;
    a.nz = 0ull; a.nan = 0ull; a.inf = 0ull;
}

// a <- a (+) b: Chan et al. for (n, mean, m2), plain sums / extrema / counts for the rest.
__device__ __forceinline__ void acc_merge(Acc& a, const Acc& b) {
    if (b.n > 0.0) {
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
    a.amax = ted_max(a.amax, b.amax); a.nzmin = ted_min(a.nzmin, b.nzmin);
    a.nz += b.nz; a.nan += b.nan; a.inf += b.inf;
}

__device__ __forceinline__ Acc acc_shfl_down(const Acc& a, int off) {
    const unsigned m = 0xFFFFFFFFu;
    Acc b;
    b.n = __shfl_down_sync(m, a.n, off); b.mean = __shfl_down_sync(m, a.mean, off);
    b.m2 = __shfl_down_sync(m, a.m2, off); b.sum = __shfl_down_sync(m, a.sum, off);
    b.abs_sum = __shfl_down_sync(m, a.abs_sum, off); b.sq_sum = __shfl_down_sync(m, a.sq_sum, off);
    b.mn = __shfl_down_sync(m, a.mn, off); b.mx = __shfl_down_sync(m, a.mx, off);
    b.amax = __shfl_down_sync(m, a.amax, off); b.nzmin = __shfl_down_sync(m, a.nzmin, off);
    b.nz = __shfl_down_sync(m, a.nz, off); b.nan = __shfl_down_sync(m, a.nan, off);
    b.inf = __shfl_down_sync(m, a.inf, off);
    return b;
}

// Fixed-order block reduction; the result is valid in thread 0.
__device__ __forceinline__ Acc acc_block_reduce(Acc a) {
    __shared__ Acc warp_acc[32];
    for (int off = 16; off > 0; off >>= 1) {
        Acc b = acc_shfl_down(a, off);
        acc_merge(a, b);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_acc[warp] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) acc_merge(a, warp_acc[w]);
    }
    return a;
}

// Per-thread state while streaming.
struct ThreadStats {
    float mn, mx, amax, nzmin, K;
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
        t.amax = ted_max(t.amax, a);
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

extern "C" __global__ void __launch_bounds__(256)
ted_stats_partial(const ted_raw_t* __restrict__ x, long long n, Acc* __restrict__ partial) {
    const long long nvec = n / VEC;
    const long long tail = n - nvec * VEC;
    const long long gtid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;

    ThreadStats t;
    t.mn = INFINITY; t.mx = -INFINITY; t.amax = 0.0f; t.nzmin = INFINITY;
    t.nz = 0ull; t.nan = 0ull; t.inf = 0ull; t.count = 0ull;
    t.S = 0.0; t.A = 0.0; t.Q = 0.0; t.D = 0.0; t.DD = 0.0;
    float k0 = 0.0f;
    if (gtid < nvec) k0 = ted_load(x, gtid * VEC);
    else if (gtid < tail) k0 = ted_load(x, nvec * VEC + gtid);
    t.K = isfinite(k0) ? k0 : 0.0f;

    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (long long i = gtid; i < nvec; i += stride) {
        uint4 w = __ldcs(xv + i);
        float f[VEC];
        ted_unpack_word(w.x, f);
        ted_unpack_word(w.y, f + TED_PER_WORD);
        ted_unpack_word(w.z, f + 2 * TED_PER_WORD);
        ted_unpack_word(w.w, f + 3 * TED_PER_WORD);
        ts_elems(t, f, VEC);
    }
    if (gtid < tail) {
        float f[1];
        f[0] = ted_load(x, nvec * VEC + gtid);
        ts_elems(t, f, 1);
    }

    Acc a;
    acc_identity(a);
    if (t.count > 0ull) {
        double cnt = (double)t.count;
        a.n = cnt;
        a.mean = ted_f2d(t.K) + t.D / cnt;
        a.m2 = fmax(t.DD - t.D * (t.D / cnt), 0.0);
    }
    a.sum = t.S; a.abs_sum = t.A; a.sq_sum = t.Q;
    a.mn = t.mn; a.mx = t.mx; a.amax = t.amax; a.nzmin = t.nzmin;
    a.nz = t.nz; a.nan = t.nan; a.inf = t.inf;
    a = acc_block_reduce(a);
    if (threadIdx.x == 0) partial[blockIdx.x] = a;
}

// out (float64[12]): min, max, sum, m2, abs_sum, sq_sum, amax, nz_abs_min, nz_abs_max, nonzero_count,
// nan_count, inf_count.  NaN anywhere makes min / max / amax / nz_abs_min / nz_abs_max NaN (torch propagates NaN
// through amin / amax); NaN or Inf makes m2 NaN (the reference's mean is then not finite).
extern "C" __global__ void __launch_bounds__(256)
ted_stats_finalize(const Acc* __restrict__ partial, int nblocks, double* __restrict__ out) {
    Acc a;
    acc_identity(a);
    for (int b = threadIdx.x; b < nblocks; b += blockDim.x) acc_merge(a, partial[b]);
    a = acc_block_reduce(a);
    if (threadIdx.x != 0) return;
    const double qnan = __longlong_as_double(0x7FF8000000000000ll);
    const bool has_nan = a.nan > 0ull;
    out[0] = has_nan ? qnan : ted_f2d(a.mn);
    out[1] = has_nan ? qnan : ted_f2d(a.mx);
    out[2] = a.sum;
    out[3] = (a.nan + a.inf > 0ull) ? qnan : a.m2;
    out[4] = a.abs_sum;
    out[5] = a.sq_sum;
    out[6] = has_nan ? qnan : ted_f2d(a.amax);
    out[7] = has_nan ? qnan : ted_f2d(a.nzmin);
    out[8] = has_nan ? qnan : ted_f2d(a.amax);
    out[9] = (double)a.nz;
    out[10] = (double)a.nan;
    out[11] = (double)a.inf;
}
