"""Can the statistics launches hide behind the model's GEMMs on a second CUDA stream?  (A GPU question: run it on
the machine whose answer you need.)

    python tools/overlap_probe.py [rounds]

Runs the GEMMs of `tedebug bench --e2e`'s 12 blocks at the full size (hidden 2048, 8 × 1024 tokens, bf16: the
forward, dgrad and wgrad GEMMs of qkv, proj, fc1 and fc2) with the six statistics rows of each GEMM call
(`cupy_stats.basic_stats_group_into`, three tensors per launch as the layers group them), in these arrangements, and
prints each one's GPU time per step (CUDA events, medians of interleaved rounds):

- ``none``: the GEMMs alone;
- ``serial``: the statistics on the GEMMs' stream after each GEMM call, as tedebug launches them;
- ``reads``: the operands' statistics (x and W; dy) on a second stream beside the GEMMs that read them, the
  outputs' after them on the GEMMs' stream (the only overlap that is safe whatever the model does with a tensor
  after the layer returns it);
- ``after``: each group on the second stream right after its GEMM call, joined before the next call's end (an
  upper bound: it lets the statistics of a tensor run after the layer returned it);
- ``reads-hi``: ``reads`` with the second stream at a higher priority.

Measured on an H200 (2026-12-04, three runs on two leases): none 44.45 / 44.32 / 44.97 ms, serial +5.10 / +5.61 /
+4.22 ms, reads +6.55 / +6.56 / +6.74 ms, after +5.21 / +5.62 / +5.14 ms, reads-hi +6.63 / +6.85 / +6.22 ms: no
arrangement hides the statistics behind the GEMMs (the GEMM kernels fill every SM; a second stream only interleaves
blocks, and the safe one costs more than one stream), so tedebug keeps one stream.
"""

from __future__ import annotations

import statistics
import sys

import torch

from tedebug.backends import cupy_stats
from tedebug.bench import timed_steps_ms

HIDDEN, TOKENS, BLOCKS = 2048, 8192, 12
SHAPES = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN), (4 * HIDDEN, HIDDEN)]  # (in, out) per GEMM


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = []
    for _ in range(BLOCKS):
        for fan_in, fan_out in SHAPES:
            x = torch.randn(TOKENS, fan_in, device=device, dtype=torch.bfloat16)  # [T, in]
            w = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16) * 0.02  # [out, in]
            dy = torch.randn(TOKENS, fan_out, device=device, dtype=torch.bfloat16)  # [T, out]
            layers.append((x, w, dy))
    slab = torch.zeros(len(layers) * 6, 13, dtype=torch.float64, device=device)
    rows = [slab[i].data_ptr() for i in range(slab.shape[0])]
    main_stream = torch.cuda.current_stream()
    side = {"low": torch.cuda.Stream(priority=0), "high": torch.cuda.Stream(priority=-1)}
    group = cupy_stats.basic_stats_group_into

    def on_side(stream, launch) -> None:
        """`launch` on `stream` after everything queued so far on the GEMMs' stream."""
        stream.wait_stream(main_stream)
        with torch.cuda.stream(stream):
            launch()

    def step(mode: str, stream) -> None:
        for layer, (x, w, dy) in enumerate(layers):
            r = rows[6 * layer : 6 * layer + 6]
            if mode == "none":
                x @ w.t(), dy @ w, dy.t() @ x
            elif mode == "serial":
                y = x @ w.t()  # [T, out]
                group([(x, r[0]), (w, r[1]), (y, r[2])])
                dx, dw = dy @ w, dy.t() @ x  # [T, in], [out, in]
                group([(dy, r[3]), (dx, r[4]), (dw, r[5])])
            elif mode == "reads":
                on_side(stream, lambda: group([(x, r[0]), (w, r[1])]))
                y = x @ w.t()
                main_stream.wait_stream(stream)
                cupy_stats.basic_stats_into(y, r[2])
                on_side(stream, lambda: cupy_stats.basic_stats_into(dy, r[3]))
                dx, dw = dy @ w, dy.t() @ x
                main_stream.wait_stream(stream)
                group([(dx, r[4]), (dw, r[5])])
            else:  # "after"
                y = x @ w.t()
                on_side(stream, lambda: group([(x, r[0]), (w, r[1]), (y, r[2])]))
                dx, dw = dy @ w, dy.t() @ x
                main_stream.wait_stream(stream)
                on_side(stream, lambda: group([(dy, r[3]), (dx, r[4]), (dw, r[5])]))
        for stream_ in side.values():
            main_stream.wait_stream(stream_)

    modes = {
        "none": ("none", None),
        "serial": ("serial", None),
        "reads": ("reads", side["low"]),
        "after": ("after", side["low"]),
        "reads-hi": ("reads", side["high"]),
    }
    times: dict = {name: [] for name in modes}
    for _ in range(rounds):
        for name, (mode, stream) in modes.items():
            times[name].append(timed_steps_ms(lambda: step(mode, stream), warmup=1, iters=5, on_gpu=True))
    base = statistics.median(times["none"])
    for name in modes:
        median = statistics.median(times[name])
        low, high = min(times[name]), max(times[name])
        print(f"{name:10s} {median:8.2f} ms/step  +{median - base:6.2f} ms  (rounds {low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
