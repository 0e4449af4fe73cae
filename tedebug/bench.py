"""The ``tedebug bench`` command: time the CuPy kernels against the torch reference path on the current GPU.

For each size (square bf16 matrices, default 8192 and 16384) and in the same run: the torch path, the kernel path,
a plain ``x.sum(dtype=float32)`` read pass and a device-to-device copy (bandwidth = bytes read + written / time).
Times are GPU time per call: the timed calls of the kernels, the copy and the sum are queued behind a GPU wait
(`time_us`), so the host's launch cost does not count (the end-to-end rows below do include it).
Rows: basic statistics; MXFP8 rowwise + columnwise quantize with error statistics; per-tensor FP8 current scaling
(amax + cast + transpose, with underflow / error / overflow statistics); NVFP4 rowwise + columnwise (global amax +
quantize, round-to-nearest, no RHT); FP8 block scaling 1x128 and 128x128 rowwise + columnwise.  A format with a
global amax pass counts two reads of the input.  Timing: `torch.cuda.Event`, warm-up, >= 20 iterations, rotating
between >= 2 input buffers so that no
buffer is re-read from L2.  Printed: microseconds per call, speed-up vs torch, achieved bandwidth, and the
fraction of copy bandwidth (or, for statistics, the time relative to the x.sum() pass).

``--e2e`` adds the end-to-end measurement (``--no-kernels``: it alone; ``--device cpu``: a tiny float32 version;
``--layers --hidden --heads --batch --seq`` change the shape): a 12-block GPT-style stack of tedebug layers (hidden
2048, 16 heads, 8 x 1024 tokens, bf16, 48 linear GEMMs, high-precision GEMMs so only tedebug's own cost is
measured), step time (forward, backward, SGD) without debug_api, with an initialised config where nothing is
active, and with LogTensorStats (min, max, mean, std, l1_norm, l2_norm, cur_amax, dynamic_range) on all six tensors
of every layer at freq 1.  ``--fp8`` adds the same model under FP8 current scaling without debug_api, with
LogFp8TensorStats and with both features on activation, weight and gradient.  The settings are measured in
interleaved rounds of 20 timed steps each and reported as medians with their range (with 10 steps per round, two
series of the very same setting differed by about 1 %), the overhead against their baseline, the added time
per logged tensor and the host time Python's garbage collector took per step inside the rounds.  Every round starts
after a full collection (`timed_steps_ms`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tedebug.backends import dispatch, torch_ref


@functools.lru_cache(maxsize=None)
def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles of `torch.cuda._sleep` per millisecond (measured once)."""
    cycles = 10**7
    torch.cuda._sleep(cycles // 10)  # wake the clocks up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def time_us(
    fn: Callable[[torch.Tensor], object], buffers: Sequence[torch.Tensor], iters: int, warmup: int, queue: bool = True
) -> float:
    """Mean GPU microseconds per call of fn(buffer), rotating over `buffers`.

    With `queue` the timed calls are enqueued behind a GPU spin-wait (`torch.cuda._sleep`) that lasts longer
    than the host takes to enqueue them all, so the events time the GPU running them back to back: a kernel of
    100 us is measured as such even on a host whose launch path takes longer than that.  If the host was not done
    before the wait ended, the wait doubles and the measurement is repeated (at most 4 times).  Calls that
    synchronise with the device (or take milliseconds each, like the torch reference) use `queue=False`."""
    for i in range(warmup):
        fn(buffers[i % len(buffers)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(buffers[0])
    host_ms = (time.perf_counter() - t0) * 1e3  # host time to enqueue one call
    torch.cuda.synchronize()
    wait_ms = max(1.0, 3.0 * host_ms * iters)
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queue:
            torch.cuda._sleep(int(wait_ms * _sleep_cycles_per_ms()))
        t0 = time.perf_counter()
        start.record()
        for i in range(iters):
            fn(buffers[i % len(buffers)])
        end.record()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        if not queue or enqueue_ms < 0.8 * wait_ms:
            break
        wait_ms *= 2
    return start.elapsed_time(end) * 1000.0 / iters


def _torch_mxfp8(x):
    from tedebug.quantization.mxfp8 import MXFP8Quantizer

    with dispatch.use_backend("torch"):
        q = MXFP8Quantizer("E4M3").quantize(x)
        return [torch_ref.underflow_partials(x, q, u) for u in ("rowwise", "columnwise")] + [
            torch_ref.mse_partials(x, q, u) for u in ("rowwise", "columnwise")
        ]


def _kernel_mxfp8(x):
    from tedebug.backends import cupy_mxfp8

    m, k = x.shape
    return cupy_mxfp8.mxfp8_quantize_raw(x, "E4M3", True, True)


@functools.lru_cache(maxsize=None)
def _fp8_current_quantizer():
    """One quantizer for every timed call (a training layer keeps its quantizers too)."""
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    return Float8CurrentScalingQuantizer("E4M3")


def _torch_fp8(x):
    with dispatch.use_backend("torch"):
        q = _fp8_current_quantizer().quantize(x)
        return (
            torch_ref.underflow_partials(x, q, "rowwise"),
            torch_ref.mse_partials(x, q, "rowwise"),
            torch_ref.overflow_partials(x, q, "rowwise"),
        )


def _kernel_fp8(x):
    with dispatch.use_backend("cupy"):
        return _fp8_current_quantizer().quantize(x)


def _quantizer_pair(make: Callable[[], object], backend: str) -> Callable[[torch.Tensor], object]:
    """fn(x): quantize x on `backend` with one quantizer made by `make` (kept for every call, as a layer keeps it)."""
    quantizer = make()

    def run(x):
        with dispatch.use_backend(backend):
            return quantizer.quantize(x)

    return run


def _nvfp4():
    from tedebug.quantization.nvfp4 import NVFP4Quantizer

    return NVFP4Quantizer()


def _fp8_block(dim: int):
    from tedebug.quantization.float8_block import Float8BlockQuantizer

    return lambda: Float8BlockQuantizer("E4M3", block_scaling_dim=dim)


def _kernel_stats(x):
    from tedebug.backends import cupy_stats

    return cupy_stats.basic_stats_tensor(x)


def bench_size(n: int, iters: int, warmup: int, nbuf: int) -> List[Dict[str, object]]:
    """Rows of measurements for an n x n bf16 input."""
    bufs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(nbuf)]
    dst = torch.empty_like(bufs[0])
    numel = n * n
    in_bytes = numel * 2
    copy_us = time_us(lambda x: dst.copy_(x), bufs, iters, warmup)
    copy_bw = 2 * in_bytes / copy_us / 1e6  # TB/s
    sum_us = time_us(lambda x: x.sum(dtype=torch.float32), bufs, iters, warmup)
    torch_iters = max(3, iters // 4)
    rows = [
        {"size": n, "op": "copy (read+write)", "kernel_us": copy_us, "bytes": 2 * in_bytes},
        {"size": n, "op": "x.sum() read pass", "kernel_us": sum_us, "bytes": in_bytes},
    ]
    # bytes: reads of the input (two for formats with a global amax pass) + codes + scales written
    cases = [
        ("basic statistics", lambda x: torch_ref.basic_partials(x), _kernel_stats, in_bytes),
        ("MXFP8 row+col + err stats", _torch_mxfp8, _kernel_mxfp8, in_bytes + 2 * numel + 2 * numel // 32),
        ("FP8 current cast+transpose", _torch_fp8, _kernel_fp8, 2 * in_bytes + 2 * numel),
        (
            "NVFP4 row+col (amax + quantize)",
            _quantizer_pair(_nvfp4, "torch"),
            _quantizer_pair(_nvfp4, "cupy"),
            2 * in_bytes + numel + numel // 8,
        ),
        (
            "FP8 block 1x128 row+col",
            _quantizer_pair(_fp8_block(1), "torch"),
            _quantizer_pair(_fp8_block(1), "cupy"),
            in_bytes + 2 * numel + numel // 16,
        ),
        (
            "FP8 block 128x128 row+col",
            _quantizer_pair(_fp8_block(2), "torch"),
            _quantizer_pair(_fp8_block(2), "cupy"),
            in_bytes + 2 * numel + 8 * numel // (128 * 128),
        ),
    ]
    for name, torch_fn, kernel_fn, nbytes in cases:
        t_us = time_us(torch_fn, bufs, torch_iters, 1, queue=False)
        k_us = time_us(kernel_fn, bufs, iters, warmup)
        rows.append({"size": n, "op": name, "torch_us": t_us, "kernel_us": k_us, "bytes": nbytes})
    for row in rows:
        row["copy_bw"] = copy_bw
        row["sum_us"] = sum_us
    return rows


# ------------------------------------------------------------------------------------------------ end to end
class _Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, index: int) -> None:
        from tedebug.nn import LayerNormLinear, LayerNormMLP, Linear

        super().__init__()
        self.heads = heads
        self.qkv = LayerNormLinear(hidden, 3 * hidden, name=f"blocks.{index}.qkv")
        self.proj = Linear(hidden, hidden, name=f"blocks.{index}.proj")
        self.mlp = LayerNormMLP(hidden, 4 * hidden, name=f"blocks.{index}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(x)


#: the statistics of the e2e rows: LogTensorStats' eight basic ones, LogFp8TensorStats' four
LOG_STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
FP8_LOG_STATS = ["underflows%", "mse", "scale_inv_min", "scale_inv_max"]


def debug_section(name: str, **features: dict) -> dict:
    """A config of one section selecting every layer, with `features` (name -> params) enabled under
    ``transformer_engine``."""
    return {
        name: {
            "enabled": True,
            "layers": {"layer_types": ["all"]},
            "transformer_engine": {feature: {"enabled": True, **params} for feature, params in features.items()},
        }
    }


#: the six tensors of a GEMM call, and the three a quantization reads
ALL_TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]
INPUT_TENSORS = ["activation", "weight", "gradient"]
#: the logging settings of the end-to-end benchmark and its tools (`logging_config`), and the tensors each logs per
#: linear layer and step
LOGGED_PER_LAYER = {"hp-log": len(ALL_TENSORS), "fp8-log": len(INPUT_TENSORS), "fp8-both": len(INPUT_TENSORS)}


def logging_config(setting: str) -> dict:
    """The debug config of a logging setting, at freq 1 on every layer: ``hp-log`` LogTensorStats (`LOG_STATS`) on
    the six tensors; ``fp8-log`` LogFp8TensorStats (`FP8_LOG_STATS`) on activation, weight and gradient;
    ``fp8-both`` both features on those three (the FP8 settings are measured under FP8 current scaling)."""
    fp8_params = {"stats": FP8_LOG_STATS, "tensors": INPUT_TENSORS, "freq": 1}
    if setting == "hp-log":
        return debug_section(setting, LogTensorStats={"stats": LOG_STATS, "tensors": ALL_TENSORS, "freq": 1})
    if setting == "fp8-log":
        return debug_section(setting, LogFp8TensorStats=fp8_params)
    if setting == "fp8-both":
        hp_params = {"stats": LOG_STATS, "tensors": INPUT_TENSORS, "freq": 1}
        return debug_section(setting, LogTensorStats=hp_params, LogFp8TensorStats=fp8_params)
    raise ValueError(f"unknown logging setting {setting!r}; expected one of {sorted(LOGGED_PER_LAYER)}")


def training_setup(
    layers: int, hidden: int, heads: int, batch: int, seq: int, device: str, dtype: torch.dtype
) -> Tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer]:
    """The end-to-end benchmark's stack of `layers` blocks (seed 0), one input batch ``[batch, seq, hidden]`` and
    its SGD optimizer: ``(model, x, optimizer)``, what `train_step` takes (the tools that profile that step use it
    too).  The compiled linear of inspect-only GEMM calls is built (or loaded) here, not during the timed steps
    (`tedebug.nn.compiled_linear.prepare`)."""
    from tedebug.nn import compiled_linear

    compiled_linear.prepare()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(hidden, heads, i) for i in range(layers)]).to(device=device, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    return model, x, optimizer


def add_shape_arguments(
    parser: Any, hidden: int, heads: int, batch: int, seq: int, layers: Optional[int] = None
) -> None:
    """The model-shape flags (``--hidden --heads --batch --seq``, and ``--layers`` when `layers` is given) of a tool
    that times `training_setup`'s stack, with its defaults."""
    shape = (("layers", layers),) if layers is not None else ()
    for flag, default in shape + (("hidden", hidden), ("heads", heads), ("batch", batch), ("seq", seq)):
        parser.add_argument(f"--{flag}", type=int, default=default)


def train_step(model: torch.nn.Module, x: torch.Tensor, optimizer, recipe, phases: Optional[list] = None) -> None:
    """One training step of the benchmarks: forward under ``tedebug.autocast(recipe=...)`` (off for None),
    backward outside it (as in TransformerEngine), the optimizer step, and ``debug_api.step()`` in a debug session.
    `phases`, when given, gets the host time in seconds of each of the four as one tuple (forward, backward,
    optimizer, then ``debug_api.step()`` with the check whether a session is on; `time.perf_counter`, no
    synchronisation: on a CUDA step bound by the host, where each phase's time goes)."""
    import tedebug
    from tedebug import debug_api

    start = time.perf_counter() if phases is not None else 0.0
    with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    forward = time.perf_counter() if phases is not None else 0.0
    y.float().square().mean().backward()
    backward = time.perf_counter() if phases is not None else 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    optimized = time.perf_counter() if phases is not None else 0.0
    if debug_api.is_enabled():
        debug_api.step()
    if phases is not None:
        end = time.perf_counter()
        phases.append((forward - start, backward - forward, optimized - backward, end - optimized))


class CollectorClock:
    """The host time Python's garbage collector takes while the clock is entered, and its collections by
    generation (through `gc.callbacks`).  A full collection walks every tracked object of the process (about
    300 k in the benchmark's process: 75-185 ms on the hosts measured), so one landing in a round of 20 steps
    moves that round by several ms per step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def __enter__(self) -> "CollectorClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def timed_steps_ms(
    one: Callable[[], None], warmup: int, iters: int, on_gpu: bool, collector: Optional[CollectorClock] = None
) -> float:
    """Milliseconds per call of `one` (a training step) over `iters` calls after `warmup` untimed ones: CUDA events
    around the calls on a GPU (so a loop that never waits for the GPU is timed by the GPU), the wall clock on CPU.

    The timed calls start after a full collection (`gc.collect`): every round starts with the collector's
    generations empty, so a full collection that earlier rounds or settings made due does not land in this one
    (the collections the timed steps themselves make do count).  `collector`, when given, times the collections
    inside the timed calls."""
    for _ in range(warmup):
        one()
    gc.collect()
    with collector if collector is not None else contextlib.nullcontext():
        if not on_gpu:
            start = time.perf_counter()
            for _ in range(iters):
                one()
            return (time.perf_counter() - start) * 1e3 / iters
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            one()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / iters


def median_rows(samples: Dict[str, List[float]]) -> List[Dict[str, object]]:
    """One row per setting (in insertion order): the median of its rounds and their range."""
    return [
        {"setting": label, "ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
        for label, v in samples.items()
    ]


def bench_end_to_end(
    layers: int = 12,
    hidden: int = 2048,
    heads: int = 16,
    batch: int = 8,
    seq: int = 1024,
    iters: int = 20,
    warmup: int = 3,
    rounds: int = 5,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    writer_thread: bool = False,
    tensorboard: bool = False,
) -> List[Dict[str, object]]:
    """ms per training step of the GPT-style stack in three debug settings (see the module docstring), and with
    `fp8` three more under ``tedebug.autocast(recipe=Float8CurrentScaling())``: no debug_api (the baseline of
    those rows), LogFp8TensorStats (underflows%, mse, scale_inv_min, scale_inv_max) on activation, weight and
    gradient, and that plus LogTensorStats (the 8 statistics) on the same three tensors, all at freq 1.

    The settings are measured in turn, `rounds` times (interleaved, so that a drift of the machine hits all of
    them alike); each row gives the median and the range of its rounds, the overhead of the medians against its
    baseline's (the high-precision one, or the FP8 one for FP8 rows) and, for rows that log, the added time per
    logged tensor (``per_tensor_us``: the difference of the medians over the tensors fed per step).
    The sessions write their statistics files as by default (the writer process, `tedebug.sinks.process_writer`);
    `writer_thread` adds, after each row that logs, the same setting with ``background_logging=True`` (the writer
    thread, which writes a step's batch inside the next `step()`).  `tensorboard` adds, after the LogTensorStats row,
    the same setting with a TensorBoard sink: a `TensorBoardSink(log_dir=...)` added to the default files (all
    written by the writer process), and a torch ``SummaryWriter`` given as ``initialize(tb_writer=...)``
    (TransformerEngine's way: no text file then; the JSONL file in the writer process, the events in the training
    process), both against the high-precision baseline.
    `device="cpu"` (float32, small shapes) exercises the same code without a GPU."""
    import tempfile

    from tedebug import debug_api
    from tedebug.recipe import Float8CurrentScaling

    model, x, opt = training_setup(layers, hidden, heads, batch, seq, device, dtype)
    on_gpu = torch.device(device).type == "cuda"

    def one(recipe) -> None:
        train_step(model, x, opt, recipe)

    def debug_ms(cfg, recipe, background_logging, board, collector: CollectorClock) -> float:
        if cfg is None:
            return timed_steps_ms(lambda: one(recipe), warmup, iters, on_gpu, collector)
        with tempfile.TemporaryDirectory() as log_dir:
            tb_writer = None
            if board == _TB_WRITER:
                from torch.utils.tensorboard import SummaryWriter

                tb_writer = SummaryWriter(os.path.join(log_dir, "tb_writer"))
            # (with a tb_writer and no default_logging_enabled, TransformerEngine's way, there is no text file)
            debug_api.initialize(cfg, log_dir=log_dir, background_logging=background_logging, tb_writer=tb_writer)
            if board == _TB_SINK:
                from tedebug.sinks.tensorboard import TensorBoardSink

                debug_api.add_statistics_sink(TensorBoardSink(log_dir=os.path.join(log_dir, "tensorboard")))
            try:
                return timed_steps_ms(lambda: one(recipe), warmup, iters, on_gpu, collector)
            finally:
                debug_api.end_debug()
                if tb_writer is not None:
                    tb_writer.close()

    gemms = 4 * layers

    def fed(setting: str) -> int:  # the tensors a logging setting feeds per step
        return LOGGED_PER_LAYER[setting] * gemms

    idle = debug_section("idle", LogTensorStats={"stats": LOG_STATS, "tensors": ALL_TENSORS, "start_step": 10**9})
    # (label, config, recipe or None, index of the baseline row, tensors fed per step)
    settings = [
        ("no debug_api (baseline)", None, None, 0, 0),
        ("initialised, nothing active", idle, None, 0, 0),
        (f"LogTensorStats, 6 tensors x {gemms} GEMMs, freq 1", logging_config("hp-log"), None, 0, fed("hp-log")),
    ]
    if fp8:
        recipe = Float8CurrentScaling()
        base = len(settings)
        settings += [
            ("FP8 current scaling, no debug_api (FP8 baseline)", None, recipe, base, 0),
            (
                f"FP8 + LogFp8TensorStats, 3 tensors x {gemms} GEMMs",
                logging_config("fp8-log"),
                recipe,
                base,
                fed("fp8-log"),
            ),
            (
                f"FP8 + LogTensorStats + LogFp8TensorStats, 3 x {gemms}",
                logging_config("fp8-both"),
                recipe,
                base,
                fed("fp8-both"),
            ),
        ]
    # (the settings above, each as (label, config, recipe, baseline index, tensors fed, background_logging, board))
    runs = [setting + ("process", None) for setting in settings]
    if tensorboard:
        logged = runs[2]
        runs[3:3] = [
            ("LogTensorStats + TensorBoardSink(log_dir)", *logged[1:6], _TB_SINK),
            ("LogTensorStats + tb_writer (no text file)", *logged[1:6], _TB_WRITER),
        ]
    if writer_thread:
        runs = [r for setting in runs for r in [setting] + ([_with_writer_thread(setting)] if setting[4] else [])]
    # the baseline indices, from places in `settings` to places in `runs`
    position = {label: i for i, (label, *_) in enumerate(runs)}
    baseline_of = {i: label for i, (label, *_) in enumerate(settings)}
    runs = [(*r[:3], position[baseline_of[r[3]]], *r[4:]) for r in runs]
    samples: Dict[str, List[float]] = {label: [] for label, *_ in runs}
    collected: Dict[str, List[float]] = {label: [] for label, *_ in runs}  # the collector's ms per step, by round
    for _ in range(max(1, rounds)):
        for label, cfg, recipe, _, _, background_logging, board in runs:
            clock = CollectorClock()
            samples[label].append(debug_ms(cfg, recipe, background_logging, board, clock))
            collected[label].append(clock.seconds * 1e3 / iters)
    rows = median_rows(samples)
    for row, (label, _, _, base_index, fed, _, _) in zip(rows, runs):
        row["gc_ms"] = statistics.median(collected[label])
        base_ms = rows[base_index]["ms"]
        row["overhead"] = row["ms"] / base_ms - 1.0
        row["per_tensor_us"] = (row["ms"] - base_ms) * 1e3 / fed if fed else None
    return rows


#: the TensorBoard sinks of `bench_end_to_end(tensorboard=True)`: a sink owning its writer, a torch SummaryWriter
_TB_SINK, _TB_WRITER = "sink", "tb_writer"


def _with_writer_thread(setting: tuple) -> tuple:
    """A setting of `bench_end_to_end` with its statistics files written by the writer thread."""
    label, cfg, recipe, base, fed, _, board = setting
    return (f"{label}, writer thread", cfg, recipe, base, fed, True, board)


class _TorchBlock(torch.nn.Module):
    """One pre-norm GPT block of plain torch modules (`torch.nn.Linear` with bias): what a user brings, converted
    with `tedebug.convert_model` for the recipe rows."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape  # [batch, seq, hidden]
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, h/heads]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


#: The recipes `bench_recipes` times, by the name its table prints (each built with its defaults).
RECIPES = ("Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling")


def bench_recipes(
    layers: int = 12,
    hidden: int = 2048,
    heads: int = 16,
    batch: int = 8,
    seq: int = 1024,
    iters: int = 20,
    warmup: int = 3,
    rounds: int = 5,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    recipes: Sequence[str] = RECIPES,
) -> List[Dict[str, object]]:
    """ms per training step of a GPT stack of plain torch modules under each recipe (no debug_api).

    Rows: the plain torch model (the baseline), the same weights converted with `tedebug.convert_model` run in high
    precision, and the converted model under ``tedebug.autocast(recipe=R())`` for each name in `recipes` (backward
    outside the autocast block, as in TransformerEngine).  Settings are measured in `rounds` interleaved rounds of
    `iters` timed steps (forward, backward, SGD); each row gives the median and range over rounds and the ratio of
    the medians to the baseline.  `device="cpu"` (float32, small shapes) runs the same code without a GPU."""
    import copy

    import tedebug
    from tedebug import recipe as recipe_module

    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[_TorchBlock(hidden, heads) for _ in range(layers)]).to(device=device, dtype=dtype)
    converted = tedebug.convert_model(copy.deepcopy(plain))
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    on_gpu = torch.device(device).type == "cuda"
    optims = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, converted)}

    def one(model, recipe) -> None:
        train_step(model, x, optims[id(model)], recipe)

    settings = [("plain torch (baseline)", plain, None), ("converted, high precision", converted, None)]
    settings += [(name, converted, getattr(recipe_module, name)()) for name in recipes]
    samples: Dict[str, List[float]] = {label: [] for label, _, _ in settings}
    for _ in range(max(1, rounds)):
        for label, model, recipe in settings:
            samples[label].append(timed_steps_ms(lambda: one(model, recipe), warmup, iters, on_gpu))
    rows = median_rows(samples)
    for row in rows:
        row["ratio"] = row["ms"] / rows[0]["ms"]
    return rows


def _format_steps(
    rows: List[Dict[str, object]], width: int, columns: Sequence[Tuple[str, Callable[[dict], str]]]
) -> str:
    """A table of `median_rows` rows: setting, ms/step, range of the rounds, then one column per (title, cell)."""
    cells = [[cell(r) for r in rows] for _, cell in columns]
    widths = [max([10, len(title)] + [len(c) for c in column]) for (title, _), column in zip(columns, cells)]
    head = f"{'setting':<{width}} | {'ms/step':>9} | {'range (rounds)':>19}" + "".join(
        f" | {title:>{w}}" for (title, _), w in zip(columns, widths)
    )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows):
        spread = f"{r['min_ms']:.2f}-{r['max_ms']:.2f}"
        lines.append(
            f"{r['setting']:<{width}} | {r['ms']:>9.2f} | {spread:>19}"
            + "".join(f" | {column[i]:>{w}}" for column, w in zip(cells, widths))
        )
    return "\n".join(lines)


def format_recipes(rows: List[Dict[str, object]]) -> str:
    return _format_steps(rows, 28, [("x baseline", lambda r: f"{r['ratio']:.2f}x")])


def format_e2e(rows: List[Dict[str, object]]) -> str:
    """The e2e table: the overhead against the row's baseline, the added time per logged tensor, and the host time
    the garbage collector took per step inside the timed rounds (median)."""

    def cell(r: dict) -> str:
        per = r.get("per_tensor_us")
        return f"{100 * r['overhead']:.1f}%" + ("" if per is None else f" ({per:.0f} us/tensor)")

    return _format_steps(rows, 52, [("GC ms/step", lambda r: f"{r['gc_ms']:.2f}"), ("overhead", cell)])


def format_table(rows: List[Dict[str, object]]) -> str:
    head = (
        f"{'size':>6} | {'operation':<32} | {'torch us':>10} | {'kernel us':>10} | {'speed-up':>8} | "
        f"{'TB/s':>6} | {'% copy BW':>9} | {'x / sum()':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        t, k, b = r.get("torch_us"), r.get("kernel_us"), r.get("bytes")
        bw = b / k / 1e6 if (k and b) else None
        lines.append(
            f"{r['size']:>6} | {r['op']:<32} | {_f(t, 1):>10} | {_f(k, 1):>10} | "
            f"{_f(t / k if (t and k) else None, 1, 'x'):>8} | {_f(bw, 2):>6} | "
            f"{_f(100 * bw / r['copy_bw'] if bw else None, 0, '%'):>9} | "
            f"{_f(k / r['sum_us'] if k else None, 2, 'x'):>9}"
        )
    return "\n".join(lines)


def _f(v, digits: int, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


def run_recipes(args: argparse.Namespace) -> int:
    """``tedebug bench --e2e --recipes``: the recipe table alone (on `--device cpu` a tiny float32 model)."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "tedebug bench: error: --device cuda needs a CUDA GPU; use --device cpu for the tiny CPU version",
            file=sys.stderr,
        )
        return 1
    shape, dtype = _e2e_shape(args)
    rows = bench_recipes(
        **shape, iters=args.steps, rounds=args.rounds, device=device, dtype=dtype, recipes=args.only or RECIPES
    )
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(
        f"recipes: {where}, torch {torch.__version__}, {shape['layers']}-block GPT stack of torch.nn.Linear "
        f"(with bias), hidden {shape['hidden']}, {shape['heads']} heads, {shape['batch']} x {shape['seq']} "
        f"tokens, {str(dtype).replace('torch.', '')}, SGD; ms per training step, median of {args.rounds} "
        f"interleaved rounds of {args.steps} steps"
    )
    print(format_recipes(rows))
    return 0


def _e2e_shape(args: argparse.Namespace) -> Tuple[Dict[str, int], torch.dtype]:
    """The model shape of ``--e2e`` from the flags: the defaults of the device, overridden by --layers etc."""
    given = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "batch", "seq") if getattr(args, k) is not None}
    if args.device == "cpu":
        return {**dict(layers=2, hidden=64, heads=2, batch=2, seq=32), **given}, torch.float32
    return {**dict(layers=12, hidden=2048, heads=16, batch=8, seq=1024), **given}, torch.bfloat16


def run_e2e(args: argparse.Namespace) -> int:
    """``tedebug bench --e2e --no-kernels`` (or ``--device cpu``): the end-to-end logging table alone."""
    shape, dtype = _e2e_shape(args)
    rows = bench_end_to_end(
        **shape,
        iters=args.steps,
        rounds=args.rounds,
        device=args.device,
        dtype=dtype,
        fp8=args.fp8,
        writer_thread=args.writer_thread,
        tensorboard=args.tensorboard,
    )
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"end to end: {where}, torch {torch.__version__}, {shape['layers']}-block GPT-style stack of tedebug "
        f"layers, hidden {shape['hidden']}, {shape['heads']} heads, {shape['batch']} x {shape['seq']} tokens, "
        f"{str(dtype).replace('torch.', '')}; ms per training step, median of {args.rounds} interleaved rounds "
        f"of {args.steps} steps"
    )
    print(format_e2e(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    """Body of ``tedebug bench``; returns the exit code."""
    if args.recipes or args.fp8 or args.no_kernels or args.writer_thread or args.tensorboard:
        if not args.e2e:
            print(
                "tedebug bench: error: --recipes, --fp8, --no-kernels, --writer-thread and --tensorboard go with --e2e",
                file=sys.stderr,
            )
            return 2
    if args.recipes:
        return run_recipes(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "tedebug bench: error: needs a CUDA GPU (torch.cuda.is_available() is False); "
            "--e2e --device cpu runs a tiny CPU version",
            file=sys.stderr,
        )
        return 1
    if args.e2e and (args.no_kernels or args.device == "cpu"):
        return run_e2e(args)
    if not torch.cuda.is_available():
        print("tedebug bench: error: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    if not dispatch.cupy_available():
        print("tedebug bench: error: CuPy is not importable; install cupy-cuda12x or cupy-cuda13x", file=sys.stderr)
        return 1
    rows: List[Dict[str, object]] = []
    for n in args.sizes:
        rows.extend(bench_size(n, args.iters, args.warmup, args.buffers))
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 inputs, "
        f"{args.iters} iterations, {args.buffers} rotating buffers, GPU time per call (launch cost excluded)"
    )
    print(format_table(rows))
    if args.e2e:
        print()
        return run_e2e(args)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384], help="square matrix sizes")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per measurement (>= 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls")
    parser.add_argument("--buffers", type=int, default=2, help="rotating input buffers (>= 2 defeats the L2)")
    parser.add_argument(
        "--e2e",
        action="store_true",
        help="also time training steps of a GPT-style stack with and without debug logging",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="--e2e: interleaved rounds of the settings (the median is reported)"
    )
    parser.add_argument(
        "--recipes",
        action="store_true",
        help="with --e2e: ms/step of a plain-torch GPT stack under each recipe (no debug) instead",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=RECIPES,
        metavar="RECIPE",
        help=f"--recipes: time only these recipes (default: all of {', '.join(RECIPES)})",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="with --e2e: add FP8 current-scaling rows (no debug, LogFp8TensorStats, both features)",
    )
    parser.add_argument(
        "--no-kernels", action="store_true", help="with --e2e: skip the kernel table, time only the end-to-end settings"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="--e2e: cuda (the full model) or cpu (a tiny float32 version, for tests)",
    )
    parser.add_argument("--steps", type=int, default=20, help="--e2e: timed steps per round")
    parser.add_argument(
        "--writer-thread",
        action="store_true",
        help="with --e2e: also time each logging setting with background_logging=True (the statistics files written "
        "by the writer thread instead of the writer process)",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="with --e2e: also time LogTensorStats with a TensorBoardSink(log_dir=...) and with a tb_writer",
    )
    for flag in ("layers", "hidden", "heads", "batch", "seq"):
        parser.add_argument(
            f"--{flag}",
            type=int,
            default=None,
            help=f"--e2e: model {flag} (default 12/2048/16/8/1024 on cuda, 2/64/2/2/32 on cpu; "
            f"the host-bound size of the docs is --hidden 256 --heads 2 --batch 1 --seq 128)",
        )
