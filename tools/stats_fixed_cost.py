"""What a statistics launch costs the GPU beyond reading its bytes.  (A GPU question: run it on the machine whose
answer you need.)

    python tools/stats_fixed_cost.py

Prints, for one bf16 tensor of 4 to 512 MB, the GPU time of a lone ``ted_stats`` launch, of the same launch without
its end (``ted_stats_scratch``: the blocks' partials left in a row scratch, no last block's merge) and of a plain
read kernel of the same bytes (16-byte streaming loads, 3 and 8 blocks per SM); for the three tensors of each
forward GEMM call of `tedebug bench --e2e`'s full size (x, W, y), one ``ted_stats_group`` launch (and without its
end) against three lone launches, one launch over the three concatenated, the GEMM alone and the GEMM followed by
the group launch (and without its end); and one ``ted_stats_finish_rows`` launch writing a full-size step's 288
rows from their scratch.  Times are GPU times per launch (CUDA events around 20 back-to-back launches, medians of
7 rounds).

Measured on an H200 (2026-12-04): the lone launch reads 512 MB in 153.6 µs and 256 MB in 83.3 µs (3.8 TB/s
between the two, and about 13 µs of fixed cost), a plain read with 8 blocks per SM 126.7 and 65.9 µs (4.4 TB/s,
5 µs); with 3 blocks per SM the plain read is slower than the statistics kernel (164.1 µs for 512 MB).  The
statistics pass does about 12 instructions per element (six fp32 sums for the sum, |x|, x² and the shifted
moments; the packed extrema, the non-zero count and the bf16 unpacking), so at 4 TB/s it is close to the SMs' issue
rate: it is bound by its arithmetic, not by memory, and the row's numerics set that arithmetic.  A group launch of
x, W and y costs what one launch over the three concatenated costs (54.0 against 56.3 µs for qkv's 159 MB; three
lone launches 80.7 µs).  After its GEMM the same group launch adds 58–94 µs (qkv, two runs) and 125–135 µs (fc1,
fc2) to the GEMM's time: it also pays for the GEMM's output leaving the L2 cache.  A later lease (2026-12-04, fifth
session): without their end the launches take about 7 µs less (512 MB 159.3 -> 149.1 µs; the group after its GEMM
+49.3 -> +42.3 µs for qkv, +60.0 -> +52.3 for fc2), and the 288 rows' finishing launch 41.6 µs.
"""

from __future__ import annotations

import statistics

import cupy as cp
import torch

from tedebug.backends import cupy_stats
from tedebug.backends.launch import _cupy_stream
from tedebug.bench import timed_steps_ms

_PLAIN_READ = r"""
extern "C" __global__ void plain_read(const uint4* x, long long n, unsigned int* out) {
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint4 v = __ldcs(x + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;  // (never in practice: keeps the loads)
}
"""


def gpu_us(launch) -> float:
    """GPU µs per call of `launch`: 20 back-to-back calls timed with CUDA events, median of 7 rounds."""
    return statistics.median(timed_steps_ms(launch, warmup=1, iters=20, on_gpu=True) * 1e3 for _ in range(7))


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    slab = torch.zeros(4, 13, dtype=torch.float64, device=device)
    rows = [slab[i].data_ptr() for i in range(4)]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plain_read = cp.RawKernel(_PLAIN_READ, "plain_read")
    stream = _cupy_stream(cp, device.index or 0, torch.cuda.current_stream().cuda_stream)  # torch's stream

    def read(x: torch.Tensor, blocks: int) -> None:
        with stream:
            plain_read((blocks,), (256,), (x.data_ptr(), cp.int64(x.numel() // 8), flag.data_ptr()))

    scratch_bytes = cupy_stats.row_scratch_bytes(device)
    scratch = torch.zeros((288, scratch_bytes), dtype=torch.uint8, device=device)
    areas = [scratch[i].data_ptr() for i in range(4)]
    print("  MB   lone ted_stats   without its end   plain read, 3/SM   plain read, 8/SM   (µs of GPU time)")
    for mb in (4, 16, 32, 64, 128, 256, 512):
        x = torch.randn(mb * 2**20 // 2, device=device, dtype=torch.bfloat16)
        lone = gpu_us(lambda: cupy_stats.basic_stats_into(x, rows[0]))
        no_end = gpu_us(lambda: cupy_stats.basic_stats_scratch_into(x, areas[0]))
        print(
            f"{mb:5d} {lone:14.1f} {no_end:17.1f} {gpu_us(lambda: read(x, 3 * sms)):18.1f} "
            f"{gpu_us(lambda: read(x, 8 * sms)):18.1f}"
        )
    hidden, tokens = 2048, 8192
    for fan_in, fan_out in ((hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)):
        x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16)
        w = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16)
        y = torch.randn(tokens, fan_out, device=device, dtype=torch.bfloat16)
        items = [(x, rows[0]), (w, rows[1]), (y, rows[2])]
        whole = torch.cat([x.flatten(), w.flatten(), y.flatten()])
        mb = whole.numel() * 2 / 1e6
        grouped = gpu_us(lambda: cupy_stats.basic_stats_group_into(items))
        scratch_items = [(x, areas[0]), (w, areas[1]), (y, areas[2])]
        grouped_no_end = gpu_us(lambda: cupy_stats.basic_stats_group_scratch_into(scratch_items))
        lone = gpu_us(lambda: [cupy_stats.basic_stats_into(t, row) for t, row in items])
        concatenated = gpu_us(lambda: cupy_stats.basic_stats_into(whole, rows[3]))
        gemm = gpu_us(lambda: torch.mm(x, w.t(), out=y))
        both = gpu_us(lambda: (torch.mm(x, w.t(), out=y), cupy_stats.basic_stats_group_into(items)))
        both_no_end = gpu_us(
            lambda: (torch.mm(x, w.t(), out=y), cupy_stats.basic_stats_group_scratch_into(scratch_items))
        )
        print(
            f"x·Wᵀ {fan_in}->{fan_out} ({mb:.1f} MB): group {grouped:.1f} µs (without its end {grouped_no_end:.1f}), "
            f"three lone {lone:.1f}, one over the three concatenated {concatenated:.1f}, GEMM {gemm:.1f}, GEMM + "
            f"group {both:.1f} (+{both - gemm:.1f}; without its end {both_no_end:.1f}, +{both_no_end - gemm:.1f})"
        )
    # a full-size step's 288 rows (six tensors of 48 GEMM calls) written from their scratch by one launch
    x = torch.randn(2**24, device=device, dtype=torch.bfloat16)
    out = torch.empty((288, len(cupy_stats.BASIC_ROW_KEYS)), dtype=torch.float64, device=device)

    def fill() -> None:  # partials waiting in 288 scratches (the step's launches)
        for i in range(288):
            cupy_stats.basic_stats_scratch_into(x[: 4096 * (i + 1)], scratch[i].data_ptr())

    def finish() -> None:
        cupy_stats.finish_rows(device, scratch.data_ptr(), scratch_bytes, out.data_ptr(), out.shape[1], 288)

    fill()
    finish()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    finish_times = []
    for _ in range(7):
        fill()
        begin.record()
        finish()
        end.record()
        torch.cuda.synchronize()
        finish_times.append(begin.elapsed_time(end) * 1e3)
    print(f"one launch writing 288 rows from their scratch: {statistics.median(finish_times):.1f} µs")


if __name__ == "__main__":
    main()
