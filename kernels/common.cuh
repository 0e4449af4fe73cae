// Shared device helpers of the tedebug kernels: element loads (fp32 / bf16 / fp16 picked by TED_DTYPE),
// FP8 encode/decode (TED_FP8: 0 = E4M3, 1 = E5M2), E8M0 RCEIL codes, and fixed-order reductions.
// Compile-time switches (passed as -D options by tedebug/backends/cupy_runtime.py's dtype_options):
//   TED_DTYPE 0 = float32, 1 = bfloat16, 2 = float16;  TED_FP8 0 = E4M3, 1 = E5M2.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#ifndef INFINITY  // NVRTC does not provide <math.h>'s macro
#define INFINITY __int_as_float(0x7f800000)
#endif

#ifndef TED_DTYPE
#define TED_DTYPE 1
#endif
#ifndef TED_FP8
#define TED_FP8 0
#endif

#if TED_DTYPE == 0
typedef unsigned int ted_raw_t;     // raw bits of one element
#else
typedef unsigned short ted_raw_t;
#endif
#define TED_ELEM_BYTES ((int)sizeof(ted_raw_t))

// ---------------------------------------------------------------------------------------------- IEEE fp32 ops
// CuPy appends -ftz=true to every NVRTC compile (cupy/cuda/compiler.py), which would flush fp32 subnormals in
// plain C arithmetic and comparisons.  Everything whose result must match the torch reference bit for bit goes
// through these inline-PTX helpers (no .ftz) or through integer bit tests.
__device__ __forceinline__ float ted_mul(float a, float b) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float ted_add(float a, float b) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float ted_sub(float a, float b) { float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float ted_fma(float a, float b, float c) { float r; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c)); return r; }
__device__ __forceinline__ float ted_div(float a, float b) { float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float ted_min(float a, float b) { float r; asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }  // NaN dropped
__device__ __forceinline__ float ted_max(float a, float b) { float r; asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }  // NaN dropped
__device__ __forceinline__ double ted_f2d(float a) { double r; asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a)); return r; }
__device__ __forceinline__ float ted_abs(float a) { return __uint_as_float(__float_as_uint(a) & 0x7FFFFFFFu); }
__device__ __forceinline__ bool ted_nonzero(float a) { return (__float_as_uint(a) & 0x7FFFFFFFu) != 0u; }  // NaN: true

// Exact conversion of one raw element to fp32.
__device__ __forceinline__ float ted_to_float(unsigned int raw) {
#if TED_DTYPE == 0
    return __uint_as_float(raw);
#elif TED_DTYPE == 1
    return __uint_as_float(raw << 16);
#else
    return __half2float(__ushort_as_half((unsigned short)raw));
#endif
}

__device__ __forceinline__ float ted_load(const ted_raw_t* p, long long i) {
    return ted_to_float((unsigned int)p[i]);
}

// Unpack one 32-bit word of packed elements (1 fp32 or 2 half-width elements) into out[0..].
__device__ __forceinline__ void ted_unpack_word(unsigned int w, float* out) {
#if TED_DTYPE == 0
    out[0] = __uint_as_float(w);
#else
    out[0] = ted_to_float(w & 0xFFFFu);
    out[1] = ted_to_float(w >> 16);
#endif
}
#define TED_PER_WORD (4 / TED_ELEM_BYTES)

// ---------------------------------------------------------------------------------------------- FP8
#if TED_FP8 == 0
#define TED_FP8_INTERP __NV_E4M3
#else
#define TED_FP8_INTERP __NV_E5M2
#endif

// RNE, saturating (finite overflow and +-Inf -> +-max normal); NaN -> 0x7F (the torch reference's code).
__device__ __forceinline__ unsigned int ted_encode_fp8(float y) {
    if (isnan(y)) return 0x7Fu;
    return (unsigned int)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, TED_FP8_INTERP);
}

__device__ __forceinline__ float ted_decode_fp8(unsigned int code) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, TED_FP8_INTERP);
    return __half2float(__half(h));
}

__device__ __forceinline__ bool ted_fp8_is_zero(unsigned int code) { return (code & 0x7Fu) == 0u; }

// ---------------------------------------------------------------------------------------------- E8M0
// Code of a non-negative fp32 ratio rounded toward +Inf to a power of two (TE's MXFP8 scale rule "RCEIL"):
// NaN -> 255, +Inf -> 254, 0 -> 0, fp32-subnormal ratio -> 1 iff > 2^-127, no increment at exponent 254.
__device__ __forceinline__ unsigned int ted_e8m0_rceil(float ratio) {
    unsigned int bits = __float_as_uint(ratio);
    unsigned int e = (bits >> 23) & 0xFFu;
    unsigned int mant = bits & 0x7FFFFFu;
    if (e == 255u) return mant ? 255u : 254u;
    if (e == 0u) return (bits & 0x7FFFFFFFu) > 0x00400000u ? 1u : 0u;
    return e + ((mant != 0u && e < 254u) ? 1u : 0u);
}

// Decode scale 2^(code-127) (code 0 -> 2^-127 subnormal, 255 -> NaN).
__device__ __forceinline__ float ted_e8m0_to_float(unsigned int code) {
    if (code == 255u) return __uint_as_float(0x7FC00000u);
    return __uint_as_float(code == 0u ? 0x00400000u : (code << 23));
}

// Encode multiplier 2^(127-code) (code 254 -> 2^-127, code 0 -> 2^127, 255 -> NaN).
__device__ __forceinline__ float ted_e8m0_encode_multiplier(unsigned int code) {
    if (code == 255u) return __uint_as_float(0x7FC00000u);
    int e = 254 - (int)code;
    return __uint_as_float(e >= 1 ? ((unsigned int)e << 23) : 0x00400000u);
}

// ---------------------------------------------------------------------------------------------- reductions
// Fixed-order (deterministic) sum of a double over the block; result valid in thread 0. `scratch` >= 32 doubles.
__device__ __forceinline__ double ted_block_sum(double v, double* scratch) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double r = 0.0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) r += scratch[w];
    }
    return r;
}

// The largest of the non-negative `am` of the block's threads, folded by thread 0 into *amax_bits (atomicMax on the
// bits: non-negative floats order like their bits; ted_max drops NaN).  Call from all threads.
__device__ __forceinline__ void ted_block_amax_into(float am, unsigned int* amax_bits) {
    __shared__ float warp_max[32];
    for (int off = 16; off > 0; off >>= 1) am = ted_max(am, __shfl_down_sync(0xFFFFFFFFu, am, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = am;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) am = ted_max(am, warp_max[w]);
        atomicMax(amax_bits, __float_as_uint(am));
    }
}

// The four error statistics of a row + column quantize kernel (row underflows, row squared error, column
// underflows, column squared error): block sums in a fixed order, stored by thread 0 as partial[blockIdx.x][0..3].
// Call from all threads; the caller then finishes the columns (ted_last_block + ted_finish_columns, or a launch of
// ted_sum_columns).
__device__ __forceinline__ void ted_store_dir_stats(double row_uf, double row_err, double col_uf, double col_err,
                                                    double* __restrict__ partial) {
    __shared__ double scratch[32];
    const double t0 = ted_block_sum(row_uf, scratch);
    const double t1 = ted_block_sum(row_err, scratch);
    const double t2 = ted_block_sum(col_uf, scratch);
    const double t3 = ted_block_sum(col_err, scratch);
    if (threadIdx.x == 0) {
        double* p = partial + (long long)blockIdx.x * 4;
        p[0] = t0; p[1] = t1; p[2] = t2; p[3] = t3;
    }
}

// Sum each of `ncols` columns of a [nrows, ncols] double array in a fixed order (one block, any size).
extern "C" __global__ void ted_sum_columns(const double* __restrict__ part, int nrows, int ncols,
                                           double* __restrict__ out) {
    __shared__ double scratch[32];
    for (int c = 0; c < ncols; ++c) {
        double v = 0.0;
        for (int r = threadIdx.x; r < nrows; r += blockDim.x) v += part[(long long)r * ncols + c];
        double total = ted_block_sum(v, scratch);
        if (threadIdx.x == 0) out[c] = total;
    }
}

// ---------------------------------------------------------------------------------------------- packed 16-bit
// bf16x2 / f16x2 words (two elements, the first in the low half).  min / max drop NaN (PTX min/max without .NaN)
// and keep subnormals (no .ftz).  TED_HINF: the bit pattern of +Inf of the element type.
#if TED_DTYPE != 0
#if TED_DTYPE == 1
#define TED_PK "bf16x2"
#define TED_HINF 0x7F80u
#else
#define TED_PK "f16x2"
#define TED_HINF 0x7C00u
#endif
__device__ __forceinline__ unsigned int ted_pmin(unsigned int a, unsigned int b) {
    unsigned int r; asm("min." TED_PK " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}
__device__ __forceinline__ unsigned int ted_pmax(unsigned int a, unsigned int b) {
    unsigned int r; asm("max." TED_PK " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}
__device__ __forceinline__ float ted_lo(unsigned int w) { return ted_to_float(w & 0xFFFFu); }
__device__ __forceinline__ float ted_hi(unsigned int w) { return ted_to_float(w >> 16); }
// Non-zero elements of a word as a packed count (0 or 1 in each 16-bit half): bit 15 of |h| + 0x7FFF is set iff h != 0.
__device__ __forceinline__ unsigned int ted_pk_nonzero(unsigned int w) {
    return (((w & 0x7FFF7FFFu) + 0x7FFF7FFFu) >> 15) & 0x00010001u;
}
// Sum of the two halves of a packed counter.
__device__ __forceinline__ unsigned int ted_pk_total(unsigned int c) { return (c & 0xFFFFu) + (c >> 16); }
#endif

// Non-zero FP8 codes of a word of four codes, as a per-byte count (0 or 1 per byte): low 7 bits != 0.
__device__ __forceinline__ unsigned int ted_fp8x4_nonzero(unsigned int c) {
    return (((c & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) >> 7) & 0x01010101u;
}
// Sum of the four bytes of a per-byte counter whose total is below 256.
__device__ __forceinline__ unsigned int ted_byte_total(unsigned int c) { return (c * 0x01010101u) >> 24; }

// Two fp32 values to two FP8 codes (RNE, SATFINITE; low byte = a).  A NaN input gives a NaN code whose exact
// bits are the hardware's: callers replace it by 0x7F (ted_encode_fp8) on their non-finite path.
__device__ __forceinline__ unsigned int ted_encode_fp8x2(float a, float b) {
    return (unsigned int)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, TED_FP8_INTERP);
}
// Two FP8 codes (low byte first) to fp32 (exact).
__device__ __forceinline__ void ted_decode_fp8x2(unsigned int codes, float& a, float& b) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(codes & 0xFFFFu), TED_FP8_INTERP);
    a = __half2float(__half(__half_raw{h.x}));
    b = __half2float(__half(__half_raw{h.y}));
}
// |decode(code)| of byte j of a word of FP8 codes, up to a constant factor: the code's exponent / mantissa bits
// placed in an fp32 word give |value| * 2^-TED_FP8_MAG_EXP exactly (FP8 subnormals become fp32 subnormals), so
// ted_mul(ted_fp8_mag(c, j), TED_FP8_MAG_SCALE) is the exact magnitude.  Not valid for NaN codes (callers handle
// NaN on their non-finite path).  Integer ops only (no conversion unit).
#if TED_FP8 == 0
#define TED_FP8_MAG_SHIFT 20
#define TED_FP8_MAG_SCALE __uint_as_float(0x7B800000u)  // 2^120
#else
#define TED_FP8_MAG_SHIFT 21
#define TED_FP8_MAG_SCALE __uint_as_float(0x77800000u)  // 2^112
#endif
__device__ __forceinline__ float ted_fp8_mag(unsigned int c, int j) {
    return __uint_as_float(((c >> (8 * j)) & 0x7Fu) << TED_FP8_MAG_SHIFT);
}
// |v| - d (IEEE, no flush).
__device__ __forceinline__ float ted_abs_sub(float v, float d) {
    float r; asm("{.reg .f32 t; abs.f32 t, %1; sub.rn.f32 %0, t, %2;}" : "=f"(r) : "f"(v), "f"(d)); return r;
}
__device__ __forceinline__ float ted_add_abs(float acc, float v) {  // acc + |v|, IEEE, no flush
    float r; asm("{.reg .f32 t; abs.f32 t, %2; add.rn.f32 %0, %1, t;}" : "=f"(r) : "f"(acc), "f"(v)); return r;
}

// ---------------------------------------------------------------------------------------------- last block
// Single-launch reductions: every block stores its partial, then takes a ticket; the block with the last ticket
// sees all partials (read them with __ldcg) and resets the ticket to 0 for the next launch.  Call from all threads.
// `ted_last_block_of` is the same for `blocks` blocks that share a ticket (a part of the grid: a launch that reduces
// several tensors gives each its own blocks and its own ticket).
__device__ __forceinline__ bool ted_last_block_of(unsigned int* ticket, unsigned int blocks) {
    __shared__ unsigned int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = (atomicAdd(ticket, 1u) == blocks - 1) ? 1u : 0u;
    __syncthreads();
    if (s_last) __threadfence();
    return s_last != 0u;
}

__device__ __forceinline__ bool ted_last_block(unsigned int* ticket) { return ted_last_block_of(ticket, gridDim.x); }

// TE's compute_scale_from_amax for current scaling (amax >= 0; amax < epsilon -> epsilon; 0 / Inf / NaN amax -> 1;
// else fp8_max / amax rounded once, Inf -> FLT_MAX; pow2 rounds down to a power of two), and scale_inv = 1 / scale:
// the rule of ted_fp8_current_scale, shared by the amax pass (fp8_tensor.cu) and the statistics pass (stats.cu).
__device__ __forceinline__ void ted_current_scale(float amax, float fp8_max, float epsilon, int pow2, float& scale,
                                                  float& scale_inv) {
    if (epsilon > 0.0f && __float_as_uint(amax) < __float_as_uint(epsilon)) amax = epsilon;  // bits: no flush
    if (!ted_nonzero(amax) || !isfinite(amax)) scale = 1.0f;
    else {
        scale = ted_div(fp8_max, amax);  // IEEE division, no flush
        if (isinf(scale)) scale = 3.402823466e+38f;
    }
    if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
    scale_inv = ted_div(1.0f, scale);
}

// What the last block of an amax pass writes for the NaN-ignoring `amax` (`ted_fp8_amax_scale` / `ted_amax_count`
// and the statistics pass `ted_stats_amax`): mode 0: amax_out[0] = amax; mode 1: also the current-scaling scale and
// scale_inv; mode 2: amax_out[0] = amax_out[1] = amax (NVFP4's rowwise and columnwise global amaxes); mode 3 (delayed
// scaling): amax_out[0] = maximum(amax_out[0], amax) as torch.maximum (NaN kept), a history entry, and
// scale_inv_out[0] = 1 / scale_out[0] of the (stale) scale.
__device__ __forceinline__ void ted_amax_outputs(float amax, float* amax_out, int mode, float fp8_max, float epsilon,
                                                 int pow2, float* scale_out, float* scale_inv_out) {
    if (mode != 3) amax_out[0] = amax;
    if (mode == 1) {
        float scale, scale_inv;
        ted_current_scale(amax, fp8_max, epsilon, pow2, scale, scale_inv);
        scale_out[0] = scale;
        scale_inv_out[0] = scale_inv;
    } else if (mode == 2) {
        amax_out[1] = amax;
    } else if (mode == 3) {
        const float old = amax_out[0];
        amax_out[0] = isnan(old) ? old : ted_max(old, amax);
        scale_inv_out[0] = ted_div(1.0f, scale_out[0]);
    }
}

// Last block: out[c] = sum over rows of part[row][c] in a fixed order (deterministic), then reset the ticket.
__device__ __forceinline__ void ted_finish_columns(const double* part, int nrows, int ncols, double* out,
                                                   unsigned int* ticket) {
    __shared__ double scratch[32];
    for (int c = 0; c < ncols; ++c) {
        double v = 0.0;
        for (int r = threadIdx.x; r < nrows; r += blockDim.x) v += __ldcg(part + (long long)r * ncols + c);
        double total = ted_block_sum(v, scratch);
        if (threadIdx.x == 0) out[c] = total;
    }
    if (threadIdx.x == 0) *ticket = 0u;
}
