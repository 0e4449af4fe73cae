// Basic statistics of one tensor in one read pass (tedebug.backends.torch_ref.basic_partials, bit-compatible).
// `ted_stats` (one launch): a grid-stride loop that keeps four 16-byte loads in flight per thread.  For bf16 / fp16
// the extrema work on packed bf16x2 / f16x2 words (min / max with packed NaN-dropping min/max; the minimum
// non-zero |x| as the packed max of -(|h| - 1), where a zero element becomes NaN and drops out; the non-zero count
// from bit 15 of |h| + 0x7FFF); fp32 inputs use per-element fp32 code.  The sums (x, |x|, x^2 and the shifted
// d = x - K, d^2 with K the block's first element, shared by its threads) are taken in fp32 over 16 elements and
// then added in fp64; a chunk whose fp32 sums are not finite (NaN / Inf present, or fp32 overflow) is redone in
// fp64 and counts NaN / Inf exactly.  The threads of a block add their (count, Σd, Σd²) (one shift: no division);
// the block turns them into (n, mean, M2) once, and blocks merge with Chan's formula in fp64 in a fixed order (a
// bad shift, e.g. a huge first element, so spoils at most one block's share); the last block to finish (atomic
// ticket) merges the block partials and writes
// 13 float64: numel, then the 12 results in torch_ref order (the statistics engine's row layout).
// amax is not tracked: max |x| = max(max x, -min x) (and 0 for no element) is exact, so it comes from the extrema.
// `ted_stats_amax` is the same pass (same code, same grid: the same 13 values bit for bit) whose last block also
// writes what the amax pass (`ted_fp8_amax_scale` / `ted_amax_count` of fp8_tensor.cu) writes in each of its modes
// (`ted_amax_outputs`: the amax, the current-scaling scale and scale_inv, NVFP4's two slots, or a delayed-scaling
// history entry), from amax = max |x| ignoring NaN (the extrema drop NaN as that pass's maxima do), and with a
// non-null nz_out the non-zero count (NaN counts, -0 does not: the statistic's own count).  A tensor that is logged
// and quantized is then read once for its statistics and its scale, not twice.
// `ted_stats_group` reduces up to three tensors in one launch: the grid is split into consecutive ranges of blocks,
// one per tensor, each with its own ticket and partials, and a tensor's range runs exactly the code of a lone
// `ted_stats` launch whose grid is that range's length (`stats_run` takes the block index and block count it
// works with).  The blocks of all the tensors are resident at once, so a launch pays the ramp-up and the drain of
// one pass, not of three (measured: three tensors of 33.6, 25.2 and 100.7 MB in 54 µs instead of 77 µs).  A
// tensor's row is bit for bit that of `ted_stats` launched alone with the same number of blocks; a group gives it
// fewer blocks than a lone launch, so its sums may differ from the lone launch's in the last bits (float64
// summation order), never its extrema or counts.
// `ted_stats_scratch` and `ted_stats_group_scratch` are those two launches without their end: each tensor's blocks
// leave their partials in the tensor's row scratch (a `RowScratch` header, then the partials), and a later
// `ted_stats_finish_rows` launch turns every waiting scratch of a slab chunk into its row, one block per row, with
// the very merges of the last block (`stats_finish`), so the rows are bit for bit those of `ted_stats` and
// `ted_stats_group`.  Why: that end is one block merging up to a wave of partials in float64 while the rest of the
// GPU waits, about 7 µs per launch on an H200 (docs/performance.md, section 23); a training step's statistics
// launches pay it once per step instead of once per GEMM call, and skip the tickets' atomics and fences.
#include "stats_pass.cuh"  // the pass itself (stats_run), shared with fp8_tensor.cu

extern "C" __global__ void __launch_bounds__(256, 3)
ted_stats(const ted_raw_t* __restrict__ x, long long n, Acc* __restrict__ partial, unsigned int* __restrict__ ticket,
          double* __restrict__ out) {
    stats_run<false>(x, n, partial, ticket, out, nullptr, 0, 0.0f, 0.0f, 0, nullptr, nullptr, nullptr, blockIdx.x,
                     gridDim.x);
}

extern "C" __global__ void __launch_bounds__(256, 3)
ted_stats_amax(const ted_raw_t* __restrict__ x, long long n, Acc* __restrict__ partial,
               unsigned int* __restrict__ ticket, double* __restrict__ out, float* __restrict__ amax_out, int mode,
               float fp8_max, float epsilon, int pow2, float* __restrict__ scale_out,
               float* __restrict__ scale_inv_out, unsigned long long* __restrict__ nz_out) {
    stats_run<true>(x, n, partial, ticket, out, amax_out, mode, fp8_max, epsilon, pow2, scale_out, scale_inv_out,
                    nz_out, blockIdx.x, gridDim.x);
}

// Blocks [0, g0) reduce x0, [g0, g0 + g1) x1, the rest x2 (g2 blocks; a count of 0 leaves its tensor out).  Tensor t
// uses the partials from row g0 + ... + g(t-1) on and tickets[t].  The pass is written out once per member (here and
// in `ted_stats_group_scratch`): one call site choosing its arguments by member gives the same rows and a kernel a
// third the size, but ran 1-3 % slower on an H200 (tools/stats_fixed_cost.py, the forward GEMMs' three tensors at
// the full size, two alternated pairs; the scratch kernel -1 to +2 %), so each member keeps a pass of its own.
extern "C" __global__ void __launch_bounds__(256, 3)
ted_stats_group(const ted_raw_t* __restrict__ x0, long long n0, unsigned int g0, double* __restrict__ out0,
                const ted_raw_t* __restrict__ x1, long long n1, unsigned int g1, double* __restrict__ out1,
                const ted_raw_t* __restrict__ x2, long long n2, unsigned int g2, double* __restrict__ out2,
                Acc* __restrict__ partial, unsigned int* __restrict__ tickets) {
    const unsigned int b = blockIdx.x;
    if (b < g0) {
        stats_run<false>(x0, n0, partial, tickets, out0, nullptr, 0, 0.0f, 0.0f, 0, nullptr, nullptr, nullptr, b, g0);
    } else if (b < g0 + g1) {
        stats_run<false>(x1, n1, partial + g0, tickets + 1, out1, nullptr, 0, 0.0f, 0.0f, 0, nullptr, nullptr, nullptr,
                         b - g0, g1);
    } else if (b < g0 + g1 + g2) {
        stats_run<false>(x2, n2, partial + g0 + g1, tickets + 2, out2, nullptr, 0, 0.0f, 0.0f, 0, nullptr, nullptr,
                         nullptr, b - g0 - g1, g2);
    }
}

// `ted_stats` leaving its partials in the row scratch at `scratch` (the row is written by `ted_stats_finish_rows`).
extern "C" __global__ void __launch_bounds__(256, 3)
ted_stats_scratch(const ted_raw_t* __restrict__ x, long long n, RowScratch* __restrict__ scratch) {
    stats_run<false, true>(x, n, scratch_partials(scratch), nullptr, nullptr, nullptr, 0, 0.0f, 0.0f, 0, nullptr,
                           nullptr, nullptr, blockIdx.x, gridDim.x);
}

// `ted_stats_group` leaving each tensor's partials in its row scratch s0, s1, s2.
extern "C" __global__ void __launch_bounds__(256, 3)
ted_stats_group_scratch(const ted_raw_t* __restrict__ x0, long long n0, unsigned int g0, RowScratch* __restrict__ s0,
                        const ted_raw_t* __restrict__ x1, long long n1, unsigned int g1, RowScratch* __restrict__ s1,
                        const ted_raw_t* __restrict__ x2, long long n2, unsigned int g2, RowScratch* __restrict__ s2) {
    const unsigned int b = blockIdx.x;
    if (b < g0) {
        stats_run<false, true>(x0, n0, scratch_partials(s0), nullptr, nullptr, nullptr, 0, 0.0f, 0.0f, 0, nullptr,
                               nullptr, nullptr, b, g0);
    } else if (b < g0 + g1) {
        stats_run<false, true>(x1, n1, scratch_partials(s1), nullptr, nullptr, nullptr, 0, 0.0f, 0.0f, 0, nullptr,
                               nullptr, nullptr, b - g0, g1);
    } else if (b < g0 + g1 + g2) {
        stats_run<false, true>(x2, n2, scratch_partials(s2), nullptr, nullptr, nullptr, 0, 0.0f, 0.0f, 0, nullptr,
                               nullptr, nullptr, b - g0 - g1, g2);
    }
}

// Block r: the row scratch at scratch + r * stride bytes, if partials wait there, becomes the row at rows + r * width
// (the 13 float64 of `ted_stats`); its header's block count is then set to 0, so a scratch is turned into a row once.
// Not a dtype kernel: the partials are the same whatever the input's dtype.  Three blocks per SM, as the passes whose
// end it is (a full-size step's 288 rows in 41.6 µs on an H200, against 51.7 µs with the compiler's own register
// budget; tools/stats_fixed_cost.py).
extern "C" __global__ void __launch_bounds__(256, 3)
ted_stats_finish_rows(unsigned char* __restrict__ scratch, long long stride, double* __restrict__ rows, int width) {
    RowScratch* header = reinterpret_cast<RowScratch*>(scratch + (long long)blockIdx.x * stride);
    const unsigned int blocks = header->blocks;
    if (blocks == 0u) return;
    stats_finish<false>(header->n, scratch_partials(header), blocks, &header->blocks,
                        rows + (long long)blockIdx.x * width, nullptr, 0, 0.0f, 0.0f, 0, nullptr, nullptr, nullptr);
}
