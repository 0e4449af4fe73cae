"""What Python's cyclic garbage collector costs per training step of the `tedebug bench --e2e` model, per setting:

    python tools/gc_cost.py --setting fp8-both [--steps 400] [--device cuda] [--hidden 256 --batch 1 --seq 128]

The collector runs a young collection each time about 700 more tracked objects (tensors, tuples, lists, class
instances) have been made than freed; every tenth young one is a middle one, and a full one walks every tracked
object of the process (some 300 k here: 100-200 ms on the H200 hosts so far) once the objects moved to the old
generation since the last full one reach a quarter of it.  A debug setting that makes more tracked objects per step
runs all three more often.  The tool runs `--steps` synchronised steps after a full collection and prints, with
`bench.CollectorClock`, the collections per step of each generation and their host time per step, and the step's
median; ``--cycles`` instead checks that a step leaves no cyclic garbage (three steps with the collector off, then
one collection that keeps what it finds: ``gc.DEBUG_SAVEALL``).

Measured answers are in docs/performance.md, section 19.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import tempfile
import time

import torch

from tedebug import bench, debug_api
from tedebug import recipe as recipe_module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--setting", default="fp8-both", choices=("hp", "hp-log", "fp8", "fp8-log", "fp8-both"))
    bench.add_shape_arguments(p, hidden=256, heads=2, batch=1, seq=128, layers=12)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cycles", action="store_true", help="count the cyclic garbage a step leaves instead")
    a = p.parse_args()
    on_gpu = a.device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        torch.set_num_threads(1)
    model, x, opt = bench.training_setup(a.layers, a.hidden, a.heads, a.batch, a.seq, a.device, dtype)
    recipe = recipe_module.Float8CurrentScaling() if a.setting.startswith("fp8") else None
    cfg = bench.logging_config(a.setting) if a.setting in bench.LOGGED_PER_LAYER else None

    def one() -> None:
        bench.train_step(model, x, opt, recipe)
        if on_gpu:
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as log_dir:
        if cfg is not None:
            debug_api.initialize(cfg, log_dir=log_dir)
        try:
            for _ in range(5):
                one()
            gc.collect()
            if a.cycles:
                print(cycles_report(a.setting, one))
                return
            times = []
            with bench.CollectorClock() as clock:
                for _ in range(a.steps):
                    start = time.perf_counter()
                    one()
                    times.append(time.perf_counter() - start)
        finally:
            if cfg is not None:
                debug_api.end_debug()
    per_step = [f"gen{g} {n / a.steps:.3f} per step" for g, n in enumerate(clock.collections)]
    print(
        f"{a.setting}, {a.steps} steps: median step {statistics.median(times) * 1e3:.2f} ms; collections: "
        f"{', '.join(per_step)}; collector {clock.seconds * 1e6 / a.steps:.0f} us per step "
        f"({len(gc.get_objects())} tracked objects in the process)"
    )


def cycles_report(setting: str, one) -> str:
    """After a full collection, three steps with the collector off, then one collection keeping its garbage: what a
    step leaves in cycles (per step)."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            one()
        gc.set_debug(gc.DEBUG_SAVEALL)
        found = gc.collect()
        kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    top = ", ".join(f"{name} {count / 3:.1f}" for name, count in kinds.most_common(8))
    return f"{setting}: {found / 3:.1f} unreachable objects per step" + (f" ({top})" if top else "")


if __name__ == "__main__":
    main()
