// Exact bf16 operands for the emulated block-scaled GEMMs, and the fp32 -> bf16 epilogue of the GEMMs that carry a
// device factor.  Bit-identical to the torch path of tedebug/quantization/gemm_values.py (see its docstring for why
// the values are exact in bf16).
//
// Dequantize kernels: one thread per group of 8 consecutive elements of a row of the stored [rows, cols] matrix
// (cols a multiple of 8 / 16), grid-stride; codes are read as one 8-byte (FP8) or 4-byte (NVFP4) load, the output
// written as 16 bytes.  value = decode(code) * scale with an IEEE fp32 multiply that does not flush
// subnormals (CuPy compiles with -ftz=true; the lifted MXFP8 values reach 2^-133); the product is a bf16 value, so
// its bf16 bits are the top 16 bits of the fp32 bits (no rounding happens).
//   MXFP8: scale = 2^(E - 127 + lift) from the E8M0 code E (code + lift > 254: +Inf; code 255: NaN), per 1x32
//          block along the row (`row_blocks` = 1, scales [rows, cols/32]) or 32x1 block down the column
//          (`row_blocks` = 0, scales [rows/32, cols]).
//   FP8 block: scale = scale_inv * 2^lift (a power of two, exact), per `block_rows` x 128 block, scales
//          [ceil(rows/block_rows), ceil(cols/128)].
//   NVFP4: E2M1 value (table) * E4M3 block scale per 1x16 block, scales [rows, cols/16]; even element in the low
//          nibble.
// Epilogue: out = bf16_rne((acc * (fa * fb)) + bias) in fp32, as the torch path (`factor = fa * fb`, `mul_`,
// `add_`, `.to(bfloat16)`): round to nearest even on the bits, subnormals kept, NaN -> 0x7FC0 (torch's rule).
#include "common.cuh"

__device__ __forceinline__ unsigned int ted_bf16_bits_exact(float v) { return __float_as_uint(v) >> 16; }

__device__ __forceinline__ unsigned int ted_bf16_bits_rne(float v) {
    const unsigned int b = __float_as_uint(v);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float ted_pow2_biased(unsigned int biased) {  // 2^(biased - 127), biased in [1, 254]
    return __uint_as_float(biased << 23);
}

// E2M1 code (sign bit 3) to its value from bits, no table (an indexed local array would live in local memory):
// magnitude codes 0..7 are 0, 0.5, then (1 + (c & 1) / 2) * 2^((c >> 1) - 1) = 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float ted_e2m1_value(unsigned int code) {
    const unsigned int c = code & 7u;
    const unsigned int bits = c == 0u ? 0u : (c == 1u ? 0x3F000000u : (((c >> 1) + 126u) << 23) | ((c & 1u) << 22));
    return __uint_as_float(bits | ((code & 8u) << 28));
}

// The grid-stride walk over the groups of 8 of a [rows, cols] matrix with the (row, group-in-row) of the current
// group kept up to date by additions: one 64-bit division per thread instead of one per group (a 64-bit division is
// a long instruction sequence, which made the MXFP8 / FP8 block kernels compute-bound).
struct TedGroupWalk {
    long long gpr, stride, sr, sc, r, cg;
    __device__ explicit TedGroupWalk(long long groups_per_row)
        : gpr(groups_per_row), stride((long long)gridDim.x * blockDim.x), sr(0), sc(0), r(0), cg(0) {}
    __device__ long long first() {
        const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        if (gpr > 0) {
            r = g / gpr;
            cg = g - r * gpr;
            sr = stride / gpr;
            sc = stride - sr * gpr;
        }
        return g;
    }
    __device__ long long next(long long g) {
        cg += sc;
        r += sr;
        if (cg >= gpr) {
            cg -= gpr;
            ++r;
        }
        return g + stride;
    }
};

__device__ __forceinline__ void ted_store8(unsigned short* out, const unsigned int* h) {  // 8 bf16 from 8 halves
    *reinterpret_cast<uint4*>(out) = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16),
                                                h[6] | (h[7] << 16));
}

extern "C" __global__ void __launch_bounds__(256)
ted_dequant_mxfp8(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
                  long long rows, long long cols, int row_blocks, int lift, unsigned short* __restrict__ out) {
    const long long groups_per_row = cols / 8, groups = rows * groups_per_row;
    TedGroupWalk w(groups_per_row);
    for (long long g = w.first(); g < groups; g = w.next(g)) {
        const long long r = w.r, c = w.cg * 8;
        const uint2 packed = *reinterpret_cast<const uint2*>(codes + r * cols + c);
        unsigned int sc[8];
        if (row_blocks) {
            const unsigned int s = scales[r * (cols / 32) + (c >> 5)];
#pragma unroll
            for (int i = 0; i < 8; ++i) sc[i] = s;
        } else {
            const uint2 s = *reinterpret_cast<const uint2*>(scales + (r >> 5) * cols + c);
#pragma unroll
            for (int i = 0; i < 4; ++i) { sc[i] = (s.x >> (8 * i)) & 0xFFu; sc[4 + i] = (s.y >> (8 * i)) & 0xFFu; }
        }
        unsigned int h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int code = ((i < 4 ? packed.x : packed.y) >> (8 * (i & 3))) & 0xFFu;
            const unsigned int biased = sc[i] + (unsigned int)lift;
            const float scale = sc[i] == 255u ? __uint_as_float(0x7FC00000u)
                              : (biased > 254u ? INFINITY : ted_pow2_biased(biased));
            h[i] = ted_bf16_bits_exact(ted_mul(ted_decode_fp8(code), scale));
        }
        ted_store8(out + r * cols + c, h);
    }
}

extern "C" __global__ void __launch_bounds__(256)
ted_dequant_fp8_block(const unsigned char* __restrict__ codes, const float* __restrict__ scale_inv,
                      long long rows, long long cols, int block_rows, float lift_factor,
                      unsigned short* __restrict__ out) {
    const long long groups_per_row = cols / 8, groups = rows * groups_per_row;
    const long long scale_cols = (cols + 127) / 128;
    TedGroupWalk w(groups_per_row);
    for (long long g = w.first(); g < groups; g = w.next(g)) {
        const long long r = w.r, c = w.cg * 8;
        const uint2 packed = *reinterpret_cast<const uint2*>(codes + r * cols + c);
        const long long br = block_rows == 128 ? (r >> 7) : (block_rows == 1 ? r : r / block_rows);
        const float scale = ted_mul(scale_inv[br * scale_cols + (c >> 7)], lift_factor);
        unsigned int h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int code = ((i < 4 ? packed.x : packed.y) >> (8 * (i & 3))) & 0xFFu;
            h[i] = ted_bf16_bits_exact(ted_mul(ted_decode_fp8(code), scale));
        }
        ted_store8(out + r * cols + c, h);
    }
}

// NVFP4: the codes [rows, cols/2], the scales [rows, cols/16] and the output are all contiguous row-major, so
// element i of the matrix has its nibble in byte i / 2 and its scale in byte i / 16: a thread takes 8 consecutive
// elements (one 4-byte code load, 16-byte store: a warp writes 512 contiguous bytes), no row / column arithmetic.
extern "C" __global__ void __launch_bounds__(256)
ted_dequant_nvfp4(const unsigned char* __restrict__ packed, const unsigned char* __restrict__ scales,
                  long long rows, long long cols, unsigned short* __restrict__ out) {
    const unsigned long long eighths = (unsigned long long)rows * (unsigned long long)cols / 8ull;
    const unsigned int* words = reinterpret_cast<const unsigned int*>(packed);
    for (unsigned long long g = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; g < eighths;
         g += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned int word = words[g];
        const __half_raw sh = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)scales[g >> 1], __NV_E4M3);
        const float scale = __half2float(__half(sh));
        unsigned int h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            h[i] = ted_bf16_bits_exact(ted_mul(ted_e2m1_value((word >> (4 * i)) & 0xFu), scale));
        ted_store8(out + 8 * g, h);
    }
}

extern "C" __global__ void __launch_bounds__(256)
ted_epilogue_bf16(const float* __restrict__ acc, long long n, long long cols, const float* __restrict__ fa,
                  const float* __restrict__ fb, const unsigned short* __restrict__ bias,
                  unsigned short* __restrict__ out) {
    const float f = ted_mul(fa[0], fb[0]);
    const long long groups = n / 4;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < groups;
         g += (long long)gridDim.x * blockDim.x) {
        const float4 a = *reinterpret_cast<const float4*>(acc + 4 * g);
        const float v[4] = {a.x, a.y, a.z, a.w};
        unsigned int h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float y = ted_mul(v[i], f);
            if (bias != nullptr) y = ted_add(y, __uint_as_float((unsigned int)bias[(4 * g + i) % cols] << 16));
            h[i] = ted_bf16_bits_rne(y);
        }
        *reinterpret_cast<uint2*>(out + 4 * g) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
    }
}
