"""Time the tensor- and data-parallel GPT of examples/train_gpt_tp.py with and without debug, and check in a profiler
trace that ``debug_api.step()`` never waits for the GPU:

    torchrun --nproc-per-node 2 tools/bench_parallel.py --tp 2 [--sequence-parallel]   # TP=2
    torchrun --nproc-per-node 2 tools/bench_parallel.py --tp 1                         # DP=2
    python tools/bench_parallel.py --device cpu --n-layer 1 --rounds 1                  # one process, no GPU

The model, its process groups and its gradient reduction are the example's (`train_gpt_tp.ParallelGPT`, `groups`,
`reduce_gradients`; the size flags are the example's too, ``--n-embd --n-layer --n-head --batch-size``, the batch
being the global one), on one fixed batch of the example's data.  Every setting runs under FP8 current scaling, as
the example does:

- ``no debug_api``: the baseline;
- ``LogTensorStats``: the 8 statistics of ``tedebug bench --e2e`` on the six tensors of every GEMM, freq 1;
- ``LogFp8TensorStats``: underflows%, mse, scale_inv_min and scale_inv_max on activation, weight and gradient;
- ``both``: the two features above together.

Statistics are reduced as the example's are (activations and gradients over the world, weights over their TP
group), so a logged step also runs the deferred read-back's collectives.  The settings are measured in turn,
``--rounds`` times (interleaved, `tedebug.bench.timed_steps_ms`: CUDA events around ``--iters`` steps after
``--warmup``); a round's figure is the slowest rank's, and each row gives the median of those and their range, the
overhead over the baseline and the time per logged tensor (a rank's logged tensors per step: 4 GEMMs a block).

``--trace`` then profiles ``--trace-steps`` steps of the ``both`` setting (`torch.profiler`, CPU and CUDA) with
``debug_api.step()`` inside a ``tedebug.step`` range, and counts the CUDA calls that make the host wait for the GPU
(`SYNC_CALLS`) inside that range on the training thread: the deferred read-back promises none.  On a GPU a
control range holding one ``torch.cuda.synchronize()`` follows the steps, and the count of the waits seen in it is
printed: a count of none inside ``step()`` means something only where the control's is one or more.  The profiler sees
the CUDA runtime calls of every library in the process (torch's, CuPy's and NCCL's alike).  ``--trace-dir`` also
writes each rank's Chrome trace there.

``--cprofile DIR`` then runs ``--trace-steps`` steps of each setting under cProfile on every rank and writes the
functions with the most cumulative time to ``DIR/cprofile_<setting>_rank<R>.txt`` (where a rank's host time goes,
for the next run on a machine with several GPUs to read without a second call).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))

import train_gpt_tp as example  # noqa: E402
from data import VOCAB, make_sorting_dataset  # noqa: E402

import tedebug  # noqa: E402
from tedebug import bench, debug_api  # noqa: E402
from tedebug.recipe import Float8CurrentScaling  # noqa: E402

#: the CUDA runtime and driver calls after which the host has waited for the GPU
SYNC_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "cuMemcpyDtoH_v2",
    }
)
STEP_RANGE = "tedebug.step"
CONTROL_RANGE = "tedebug.control"  # a range holding one torch.cuda.synchronize(): the trace must show its wait
GEMMS_PER_BLOCK = 4  # q/k/v, the output projection, fc1, fc2


def settings() -> List[tuple]:
    """(label, debug config or None, tensors logged per GEMM) of each setting, the baseline first."""
    hp = {"stats": bench.LOG_STATS, "tensors": bench.ALL_TENSORS, "freq": 1}
    fp8 = {"stats": bench.FP8_LOG_STATS, "tensors": bench.INPUT_TENSORS, "freq": 1}
    return [
        ("FP8 current scaling, no debug_api", None, 0),
        ("FP8 + LogTensorStats, 6 tensors", bench.debug_section("hp", LogTensorStats=hp), len(bench.ALL_TENSORS)),
        ("FP8 + LogFp8TensorStats, 3 tensors", bench.debug_section("fp8", LogFp8TensorStats=fp8), 3),
        (
            "FP8 + both features",
            bench.debug_section("both", LogTensorStats=hp, LogFp8TensorStats=fp8),
            len(bench.ALL_TENSORS),
        ),
    ]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--rounds", type=int, default=5)
    own.add_argument("--iters", type=int, default=10, help="timed steps per round and setting")
    own.add_argument("--warmup", type=int, default=3)
    own.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    own.add_argument("--trace", action="store_true", help="profile the 'both' setting's steps (see the docstring)")
    own.add_argument("--trace-steps", type=int, default=3)
    own.add_argument("--trace-dir", default=None, help="with --trace: write each rank's Chrome trace here")
    own.add_argument("--cprofile", default=None, metavar="DIR", help="write each setting's cProfile per rank here")
    mine, rest = own.parse_known_args(argv)
    args = example.parse_args(rest)
    for key, value in vars(mine).items():
        setattr(args, key, value)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the example's setup then takes gloo and the CPU
    return args


def build(args: argparse.Namespace):
    """(rank, world, device, one training step, GEMMs per rank) for the example's model under FP8 current
    scaling."""
    rank, world, device = example.setup()
    tp = args.tp or world
    tp_group, dp_group = example.groups(rank, world, tp)
    dp_size, dp_rank = world // tp, rank // tp
    data = make_sorting_dataset(seed=args.seed)
    torch.manual_seed(args.seed + rank)  # the values do not matter here: no TP=1 reference to shard
    block_size = -(-data.seq_len // 8) * 8
    model = example.ParallelGPT(len(VOCAB), block_size, args, tp_group, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    x, y = next(data.batches(args.batch_size, seed=args.seed))
    x, y = x.chunk(dp_size)[dp_rank].to(device), y.chunk(dp_size)[dp_rank].to(device)
    recipe = Float8CurrentScaling()

    def one() -> None:
        with tedebug.autocast(recipe=recipe):
            loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        example.reduce_gradients(model, tp_group, dp_group, dp_size)
        optimizer.step()
        if debug_api.is_enabled():
            with torch.profiler.record_function(STEP_RANGE):
                debug_api.step()

    return rank, world, device, one, GEMMS_PER_BLOCK * args.n_layer


def _gather(value, world: int) -> list:
    if world == 1:
        return [value]
    values: list = [None] * world
    dist.all_gather_object(values, value)
    return values


@contextlib.contextmanager
def session(config: Optional[dict]) -> Iterator[None]:
    """A debug session of `config` (None: none) writing into a temporary directory, ended on the way out."""
    if config is None:
        yield
        return
    with tempfile.TemporaryDirectory() as log_dir:
        debug_api.initialize(config, log_dir=log_dir)
        try:
            yield
        finally:
            debug_api.end_debug()


def measure(args: argparse.Namespace, rank: int, world: int, device, one, gemms: int) -> List[Dict[str, object]]:
    """The rows of the table (rank 0's; every rank computes the same from the gathered rounds)."""
    on_gpu = device.type == "cuda"
    runs = settings()
    samples: Dict[str, List[float]] = {label: [] for label, _, _ in runs}
    collected: Dict[str, List[float]] = {label: [] for label, _, _ in runs}  # the collector's ms per step
    for _ in range(max(1, args.rounds)):
        for label, config, _ in runs:
            if world > 1:
                dist.barrier()
            clock = bench.CollectorClock()
            with session(config):
                ms = bench.timed_steps_ms(one, args.warmup, args.iters, on_gpu, clock)
            ranks = _gather((ms, clock.seconds * 1e3 / args.iters), world)
            slowest = max(ranks)  # the round's slowest rank
            samples[label].append(slowest[0])
            collected[label].append(slowest[1])
    rows = bench.median_rows(samples)
    base = rows[0]["ms"]
    for row, (label, _, per_gemm) in zip(rows, runs):
        row["gc_ms"] = statistics.median(collected[label])
        row["overhead"] = row["ms"] / base - 1.0
        row["per_tensor_us"] = (row["ms"] - base) * 1e3 / (per_gemm * gemms) if per_gemm else None
    return rows


def trace(args: argparse.Namespace, rank: int, device, one) -> Dict[str, object]:
    """Profile the 'both' setting's steps: `count_waits` of their events, with the setting's label."""
    from torch.profiler import ProfilerActivity, profile

    label, config, _ = settings()[-1]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with session(config):
        for _ in range(args.warmup):
            one()
        with profile(activities=activities) as prof:
            for _ in range(args.trace_steps):
                one()
            if device.type == "cuda":  # the control: a wait the count must see
                with torch.profiler.record_function(CONTROL_RANGE):
                    torch.cuda.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"bench_parallel_rank{rank}.json"))
    return {"setting": label, **count_waits(prof.events())}


def count_waits(events) -> Dict[str, object]:
    """Of the profiler's `events` (``prof.events()``): the host-side ``tedebug.step`` ranges (`steps`: how many),
    the calls of `SYNC_CALLS` that start inside one of them on its thread (`inside`: name -> (calls, microseconds
    in them)) and the others (`outside`), and the control ranges with the waits seen in them (`control`)."""
    host = torch.autograd.DeviceType.CPU  # (a range is also recorded on the GPU's timeline)
    steps = [e for e in events if e.name == STEP_RANGE and e.device_type == host]
    controls = [e for e in events if e.name == CONTROL_RANGE and e.device_type == host]
    inside: Dict[str, tuple] = {}
    outside: Dict[str, tuple] = {}
    control_seen = 0
    for e in events:
        if e.name not in SYNC_CALLS:
            continue
        if any(_within(e, c) for c in controls):
            control_seen += 1
            continue
        counts = inside if any(_within(e, s) for s in steps) else outside
        calls, waited = counts.get(e.name, (0, 0.0))
        counts[e.name] = (calls + 1, waited + e.time_range.elapsed_us())
    return {"steps": len(steps), "inside": inside, "outside": outside, "control": (len(controls), control_seen)}


def _within(event, span) -> bool:
    """Whether `event` starts inside `span` on the same thread."""
    return event.thread == span.thread and span.time_range.start <= event.time_range.start <= span.time_range.end


#: the settings' short names in the cProfile files, in `settings` order
SHORT_NAMES = ("baseline", "hp", "fp8", "both")


def profile_settings(args: argparse.Namespace, rank: int, device, one) -> List[str]:
    """``--cprofile``: each setting's steps under cProfile on this rank; the paths of the files written."""
    import cProfile
    import io
    import pstats

    os.makedirs(args.cprofile, exist_ok=True)
    written = []
    for short, (label, config, _) in zip(SHORT_NAMES, settings()):
        with session(config):
            for _ in range(args.warmup):
                one()
            if device.type == "cuda":
                torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.trace_steps):
                one()
            if device.type == "cuda":
                torch.cuda.synchronize()
            profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
        path = os.path.join(args.cprofile, f"cprofile_{short}_rank{rank}.txt")
        with open(path, "w") as f:
            f.write(f"{label}: {args.trace_steps} steps\n{text.getvalue()}")
        written.append(path)
    return written


def _calls(counts: Dict[str, tuple]) -> str:
    return ", ".join(f"{name} x {calls} ({us:.0f} us)" for name, (calls, us) in counts.items()) or "none"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    rank, world, device, one, gemms = build(args)
    try:
        rows = measure(args, rank, world, device, one, gemms)
        traced = _gather(trace(args, rank, device, one), world) if args.trace else None
        if args.cprofile:
            profile_settings(args, rank, device, one)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        tp = args.tp or world
        print(
            f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} x {world}, "
            f"TP={tp} x DP={world // tp}{' (sequence parallel)' if args.sequence_parallel else ''}, "
            f"{args.n_layer} blocks, hidden {args.n_embd}, {args.n_head} heads, global batch {args.batch_size}; "
            f"ms per step, the slowest rank's, median of {args.rounds} interleaved rounds of {args.iters} steps"
        )
        print(bench.format_e2e(rows))
        for r, result in enumerate(traced or []):
            print(
                f"rank {r}: {result['steps']} x debug_api.step() ({result['setting']}) traced; CUDA calls that wait "
                f"for the GPU inside it: {_calls(result['inside'])}; elsewhere in those steps: "
                f"{_calls(result['outside'])}"
                + (f"; the control's synchronize seen: {result['control'][1]}" if result["control"][0] else "")
            )
    return {"rows": rows, "trace": traced}


if __name__ == "__main__":
    main()
