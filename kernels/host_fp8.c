/* Per-tensor FP8 quantization of CPU fp32 tensors in two passes of compiled code (the CPU host path of
 * tedebug/quantization/float8.py, loaded by tedebug/backends/host_kernels.py).
 *
 * Why: on the CPU a small tensor's quantization is bound by the number of Python-level calls, not by its bytes.
 * The numpy path reads |x|, reduces it, multiplies by the scale, casts through torch, views, transposes and copies:
 * ten calls per quantization, three quantizations per linear layer and step.  Here the amax is one call and the
 * product, the cast, the NaN code and the transposed copy another.
 *
 * Exactness: every value is the numpy/torch path's bit for bit.
 * - ted_host_amax: max|x| with NaN ignored (0 when every element is NaN), and whether a NaN is present.  The
 *   magnitudes of non-NaN floats order like their bit patterns (+Inf included), so the maximum is taken over the
 *   bits; it does not depend on the order of the elements.
 * - ted_host_fp8_cast: each product x * scale is one IEEE fp32 multiplication (compiled without contraction or
 *   fast-math), clamped to [-fp8_max, fp8_max] when `clip` is set (NaN stays NaN, as with numpy.clip), then rounded
 *   to the FP8 format to nearest, ties to even, as torch's fp32 -> float8 cast rounds.  Normal results round the
 *   fp32 mantissa with the carry-into-the-exponent addition; results below the smallest normal are multiples of
 *   the smallest subnormal, and the quotient by it (an exact product with a power of two) is rounded to an integer
 *   by adding 2^23, whose fp32 neighbours are 1 apart (in the default rounding mode, to nearest even, which numpy
 *   and torch assume as well).  NaN stores 0x7F, the canonical NaN code of both formats, whatever its sign.  The caller
 *   guarantees that no product reaches the format's overflow threshold (464 for E4M3, 61440 for E5M2) unless `clip`
 *   is set: the encoding has no Inf/NaN-on-overflow case.
 *
 * Speed: the amax and cast loops are compare-and-select code without branches, which the compiler vectorizes
 * (with -fno-trapping-math, which lets it evaluate both sides of a select; no value changes): a layer-step casts
 * thousands of elements, and scalar code would spend more instructions on them than numpy does.
 *
 * Layout: x is [m, k] row-major; `row` receives the [m, k] codes (always: the caller passes scratch when it keeps
 * only the transpose), `col` their [k, m] transpose (NULL for none).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

int ted_host_amax(const float* x, int64_t n, float* amax_out) {
    /* the magnitudes' bits as signed ints (below 2^31, so they order alike): compare-and-select loops vectorize */
    int32_t best = 0, nan = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t a = (int32_t)(bits_of(x[i]) & 0x7FFFFFFFu);
        const int32_t is_nan = a > 0x7F800000;
        const int32_t kept = is_nan ? 0 : a;
        best = kept > best ? kept : best;
        nan |= is_nan;
    }
    memcpy(amax_out, &best, sizeof best);
    return (int)nan;
}

/* The FP8 code of one fp32 value that is NaN or below the format's overflow threshold, without a branch (the loop
 * below vectorizes): mbits mantissa bits, exponent bias `bias`. */
static inline uint8_t fp8_code(float v, int mbits, int bias) {
    const uint32_t u = bits_of(v);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    const int shift = 23 - mbits;
    /* normal: the mantissa rounded to mbits bits (the carry may raise the exponent), the exponent re-biased */
    const uint32_t rounded = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
    const uint32_t normal = (rounded >> shift) - ((uint32_t)(127 - bias) << mbits);
    /* below the smallest normal 2^(1 - bias): the value in units of the smallest subnormal 2^(1 - bias - mbits)
     * (an exact product with a power of two), rounded to an integer by adding 2^23, whose fp32 spacing is 1 (round
     * to nearest even, the default rounding mode); 2^mbits units is the smallest normal's code */
    float magnitude;
    memcpy(&magnitude, &a, sizeof a);
    const float units = magnitude * (float)(1u << (bias - 1 + mbits)) + 8388608.0f;
    const uint32_t subnormal = bits_of(units) - 0x4B000000u;
    const uint32_t code = a < ((uint32_t)(127 + 1 - bias) << 23) ? subnormal : normal;
    return (uint8_t)(a > 0x7F800000u ? 0x7Fu : (sign | code));
}

/* x[i] * scale clamped to [-limit, limit] (NaN stays NaN: both comparisons are false), then its code; `mbits` and
 * `bias` are constants at each call, so each format gets its own vectorized loop */
static inline void cast_loop(const float* x, int64_t n, float scale, float limit, uint8_t* row, int mbits, int bias) {
    for (int64_t i = 0; i < n; ++i) {
        float v = x[i] * scale;
        v = v > limit ? limit : v;
        v = v < -limit ? -limit : v;
        row[i] = fp8_code(v, mbits, bias);
    }
}

void ted_host_fp8_cast(const float* x, int64_t m, int64_t k, float scale, int fmt, int clip, float fp8_max,
                       uint8_t* row, uint8_t* col) {
    const float limit = clip ? fp8_max : INFINITY; /* no clamp: every product is below the limit anyway */
    if (fmt)
        cast_loop(x, m * k, scale, limit, row, 2, 15);
    else
        cast_loop(x, m * k, scale, limit, row, 3, 7);
    if (col)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < k; ++j) col[j * m + i] = row[i * k + j];
}
