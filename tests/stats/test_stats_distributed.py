"""Cross-rank reduction of statistics: 2 processes (gloo on CPU unless TEDEBUG_TEST_DIST_BACKEND=nccl; spawned once,
timeout-protected by tests/dist_harness.py).

Checks: rank-0 values equal the statistics of the concatenated tensors, all ranks emit identical values, a buffer
fed on one rank does not deadlock and is emitted only there, skip_reduction logs local values, and exactly one
all_gather_object runs per reduction group per step (none when a rank is idle)."""

import datetime
import math
import socket

import pytest
import torch
import torch.distributed as dist

import dist_harness
from tedebug.stats import StatsEngine

WORLD = 2
TIMEOUT_S = 90
REDUCED = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_tensor(rows_per_rank=48):
    g = torch.Generator().manual_seed(123)
    x = torch.randn(WORLD * rows_per_rank, 32, generator=g) * torch.linspace(0.01, 50.0, 32)
    x[x.abs() < 0.02] = 0.0
    return x


class Capture:
    def __init__(self):
        self.records = []

    def log_scalar(self, name, value, iteration, **kw):
        self.records.append((name, value, iteration))


_REAL_GATHER_OBJECT = dist.all_gather_object


def _count_gathers():
    counter = {"n": 0}
    real = dist.all_gather_object

    def counting(*args, **kwargs):
        counter["n"] += 1
        return real(*args, **kwargs)

    dist.all_gather_object = counting
    return counter


def _worker(rank, world):
    dev = dist_harness.device(rank)
    try:
        second_group = dist.new_group([0, 1])
        counter = _count_gathers()
        log = Capture()
        engine = StatsEngine(log)
        results = {}

        # step 1: each rank feeds its shard in two microbatches (world group); a buffer in a second group;
        # a buffer fed on rank 0 only; a skip-reduction weight
        shard = full_tensor().chunk(WORLD)[rank].to(dev)
        for part in shard.chunk(2):
            engine.feed("L", "activation", REDUCED, part, iteration=1)
        engine.feed("L", "gradient", ["max", "mean"], shard * (rank + 1), iteration=1, reduction_group=second_group)
        if rank == 0:
            engine.feed("only0", "activation", ["min", "max"], torch.tensor([-3.0, 9.0], device=dev), iteration=1)
        engine.feed(
            "L",
            "weight",
            ["max"],
            torch.tensor([float(10 + rank)], device=dev),
            iteration=1,
            skip_reduction=True,
            is_weight=True,
        )
        engine.step(1)
        results["step1"] = (list(log.records), counter["n"])

        # step 2: nobody fed, no layer due -> no collective at all
        log.records.clear()
        counter["n"] = 0
        engine.step(2)
        results["idle"] = (list(log.records), counter["n"])

        # step 3: only rank 0 feeds; rank 1 joins because its noted next iteration of "L" is due (3 <= 3)
        engine.note_next_iteration("L", 3)
        engine.note_next_iteration("never", None)
        counter["n"] = 0
        if rank == 0:
            engine.feed("L", "activation", REDUCED, shard, iteration=3)
        engine.step(3)
        results["due"] = (list(log.records), counter["n"])
        results["local"] = _local(rank, dev)
        results["deferred"] = _deferred(rank, dev)
        results["vectors"] = {mode: _deferred_vectors(rank, dev, mode) for mode in ("torch", "auto")}
        return results
    finally:
        dist.all_gather_object = _REAL_GATHER_OBJECT


def _local(rank, dev):
    """Step 1's activation statistics of this rank's shard alone (the same two microbatches, not reduced)."""
    log = Capture()
    engine = StatsEngine(log)
    for part in full_tensor().chunk(WORLD)[rank].to(dev).chunk(2):
        engine.feed("L", "activation", REDUCED, part, iteration=1, skip_reduction=True)
    engine.step(1)
    return _values(log.records)


def _deferred(rank, dev):
    """The deferred engine: iteration N is emitted at step N+1; a buffer fed on rank 0 only (new, then in the
    agreed layout, where rank 1 holds an empty slot) never blocks rank 1 and is emitted on rank 0 only."""
    log = Capture()
    engine = StatsEngine(log, defer_read_back=True)
    shard = full_tensor().chunk(WORLD)[rank].to(dev)
    emitted = []
    for it in (1, 2):
        engine.feed("L", "activation", REDUCED, shard * it, iteration=it)
        if rank == 0:
            engine.feed("only0", "activation", ["min", "max"], torch.tensor([-3.0, 9.0], device=dev) * it, iteration=it)
        engine.step(it)
        emitted.append(sorted({i for _, _, i in log.records}))
    engine.finish_pending()
    emitted.append(sorted({i for _, _, i in log.records}))
    return {"emitted": emitted, "records": list(log.records)}


FP8_STATS = ("underflows%", "mse", "scale_inv_min", "scale_inv_max")


def _with_vector(x):
    """x quantized with FP8 current scaling, carrying a quantize-kernel statistics vector (FP8_STATS_WITH_SCALE) whose
    values are the torch reference's partials (on CPU the engine reads such a vector unless the torch reference is
    asked for)."""
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer

    from support.kernel_inputs import with_reference_vector

    if x.is_cuda:
        return Float8CurrentScalingQuantizer("E4M3").quantize(x)  # the kernel wrote its own vector
    return with_reference_vector(x)


def _deferred_vectors(rank, dev, mode):
    """Quantization statistics in the deferred multi-rank path: under "auto" the feeds keep statistics vectors as
    rows (the first microbatch; the second one's vector is stale, so its row is computed), which the reduction
    gathers into its device rows; under "torch" every row is computed.  Both must emit the same values."""
    from tedebug.backends import dispatch
    from tedebug.stats import StatRequest

    requests = tuple(StatRequest(name, name) for name in FP8_STATS)
    log = Capture()
    engine = StatsEngine(log, defer_read_back=True)
    shard = full_tensor().chunk(WORLD)[rank].to(dev)
    with dispatch.use_backend(mode):
        for it in (1, 2):
            a, b = (part.clone() for part in (shard * it).chunk(2))  # own version counters
            qa, qb = _with_vector(a), _with_vector(b)
            b.mul_(1.0)  # a new version: qb's vector no longer counts as b's
            for x, q in ((a, qa), (b, qb)):
                engine.feed("L", "activation", requests, x, iteration=it, quantized={"": q})
            engine.step(it)
        engine.finish_pending()
    return list(log.records)


def oracle(kind, x):
    d = x.double().reshape(-1)
    nz = d.abs()[d != 0]
    return {
        "min": d.min().item(),
        "max": d.max().item(),
        "mean": d.mean().item(),
        "std": d.std().item(),
        "l1_norm": d.abs().sum().item(),
        "l2_norm": torch.linalg.vector_norm(d).item(),
        "cur_amax": d.abs().max().item(),
        "dynamic_range": math.log2(nz.max().item()) - math.log2(nz.min().item()),
    }[kind]


#: a fp32 rounding's relative error
U = 2.0**-24


def near_oracle(kind, x):
    """The oracle's value of `kind` on `x` as the test compares it.  The extrema are exact on every device.  CPU
    tensors (gloo) are summed in float64: 1e-12 relative.  CUDA tensors (nccl) go through the statistics kernel,
    which adds 16 elements at a time in fp32 before float64 (kernels/stats.cu), so a sum is off by at most about
    16·U of the sum of its terms' magnitudes; the bounds below take 32·U for the roundings of the terms themselves
    (x², the shifted d = x − K, K one of the block's elements, so |d| <= 2·amax):
    mean: Σd/n, off by 32·U·(Σ|x|/n + amax);  l1_norm, l2_norm: 32·U relative;  std: M2 = Σd² − (Σd)²/n, off by
    64·U·Σd² <= 256·U·n·amax², so the standard deviation is off by that over (n − 1)·2·std."""
    expected = oracle(kind, x)
    if kind in ("min", "max", "cur_amax"):
        return expected
    if dist_harness.backend() != "nccl" or kind == "dynamic_range":  # (a difference of two logarithms)
        return pytest.approx(expected, rel=1e-12)
    d = x.double().reshape(-1)
    n, amax = d.numel(), d.abs().max().item()
    if kind == "mean":
        return pytest.approx(expected, rel=0, abs=32 * U * (d.abs().sum().item() / n + amax))
    if kind == "std":
        return pytest.approx(expected, rel=0, abs=256 * U * n * amax**2 / ((n - 1) * 2 * expected))
    return pytest.approx(expected, rel=32 * U)


@pytest.fixture(scope="module")
def results():
    return dist_harness.spawn(_worker, WORLD)


def _values(records):
    return {name: value for name, value, _ in records}


@pytest.mark.distributed
def test_reduced_values_equal_concatenation(results):
    full = full_tensor()
    r0, r1 = (_values(r["step1"][0]) for r in results)
    for kind in REDUCED:
        assert r0[f"L_activation_{kind}"] == near_oracle(kind, full), kind
        assert r1[f"L_activation_{kind}"] == r0[f"L_activation_{kind}"], kind  # identical on all ranks
    shards = full.chunk(WORLD)
    grad = torch.cat([shards[r] * (r + 1) for r in range(WORLD)])
    assert r0["L_gradient_max"] == r1["L_gradient_max"] == grad.double().max().item()
    assert r0["L_gradient_mean"] == near_oracle("mean", grad)


def merged(locals_, n):
    """The statistics of the ranks' shards together, merged in float64 from each rank's own emitted values
    (`locals_`, `n` elements each): the extrema by min / max, the sums by adding, the variance by Chan's formula,
    the dynamic range from the amax and the smallest non-zero magnitude, log2(amax) − dynamic_range."""
    ranks = len(locals_)
    mean = sum(v["L_activation_mean"] for v in locals_) / ranks
    m2 = sum(v["L_activation_std"] ** 2 * (n - 1) + n * (v["L_activation_mean"] - mean) ** 2 for v in locals_)
    amax = max(v["L_activation_cur_amax"] for v in locals_)
    log2_nz_min = min(math.log2(v["L_activation_cur_amax"]) - v["L_activation_dynamic_range"] for v in locals_)
    return {
        "min": min(v["L_activation_min"] for v in locals_),
        "max": max(v["L_activation_max"] for v in locals_),
        "mean": mean,
        "std": math.sqrt(m2 / (ranks * n - 1)),
        "l1_norm": sum(v["L_activation_l1_norm"] for v in locals_),
        "l2_norm": math.sqrt(sum(v["L_activation_l2_norm"] ** 2 for v in locals_)),
        "cur_amax": amax,
        "dynamic_range": math.log2(amax) - log2_nz_min,
    }


@pytest.mark.distributed
def test_reduced_values_are_the_ranks_own_statistics_merged(results):
    """On every backend, tightly: the reduction merges what each rank computed of its shard (on CUDA the kernel's
    fp32 partial sums make both differ from the float64 oracle, by the same rows)."""
    n = full_tensor().numel() // WORLD
    expected = merged([r["local"] for r in results], n)
    reduced = _values(results[0]["step1"][0])
    scale = expected["l1_norm"] / (WORLD * n)  # the mean's terms' size: its error is relative to that
    for kind in REDUCED:
        got = reduced[f"L_activation_{kind}"]
        if kind in ("min", "max", "cur_amax"):
            assert got == expected[kind], kind
        elif kind == "mean":
            assert got == pytest.approx(expected[kind], rel=0, abs=1e-12 * scale), kind
        else:
            assert got == pytest.approx(expected[kind], rel=1e-12), kind


@pytest.mark.distributed
def test_one_rank_buffer_and_skip_reduction(results):
    r0, r1 = (_values(r["step1"][0]) for r in results)
    assert r0["only0_activation_min"] == -3.0 and r0["only0_activation_max"] == 9.0
    assert not any(name.startswith("only0") for name in r1)
    assert r0["L_weight_max"] == 10.0 and r1["L_weight_max"] == 11.0  # local values
    assert [n for n, _, _ in results[0]["step1"][0]] == [
        *(f"L_activation_{k}" for k in REDUCED),
        "L_gradient_max",
        "L_gradient_mean",
        "only0_activation_min",
        "only0_activation_max",
        "L_weight_max",
    ]


@pytest.mark.distributed
def test_collective_count(results):
    for r in results:
        assert r["step1"][1] == 2  # world group + second group: one each
        assert r["idle"] == ([], 0)
        assert r["due"][1] == 2
    r0_due = _values(results[0]["due"][0])
    assert results[1]["due"][0] == []  # rank 1 fed nothing: emits nothing
    shard0 = full_tensor().chunk(WORLD)[0]
    assert r0_due["L_activation_max"] == shard0.double().max().item()
    assert r0_due["L_activation_std"] == near_oracle("std", shard0)


def test_a_single_rank_group_keeps_the_deferred_read_back(monkeypatch):
    """torch.distributed with one rank (torchrun on one GPU) reduces locally and defers its read-back; with more
    ranks it defers too (an asynchronous collective per group, `tedebug.stats.distributed`)."""
    from tedebug.stats import reduce as reduce_module

    engine = StatsEngine(Capture(), defer_read_back=True)
    assert engine.defers()  # not initialised
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        assert reduce_module.distributed_ready() and not reduce_module.needs_communication()
        assert engine.defers()
        x = torch.tensor([1.0, -4.0, 2.5])
        engine.feed("L", "activation", ["min", "max"], x, iteration=0)
        engine.step(0)
        assert engine.has_in_flight and engine.metric_logger.records == []
        engine.finish_pending()
        assert engine.metric_logger.records == [("L_activation_min", -4.0, 0), ("L_activation_max", 2.5, 0)]
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        assert reduce_module.needs_communication() and engine.defers()  # several ranks: deferred as well
        assert not StatsEngine(Capture(), defer_read_back=False).defers()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_deferred_multi_rank_reduction(results):
    full = full_tensor()
    for rank, r in enumerate(results):
        deferred = r["deferred"]
        assert deferred["emitted"] == [[], [1], [1, 2]]  # iteration N is written when step N+1 ends
        values = {(name, it): v for name, v, it in deferred["records"]}
        for it in (1, 2):
            for kind in REDUCED:
                assert values[(f"L_activation_{kind}", it)] == near_oracle(kind, full * it), (rank, kind, it)
            if rank == 0:
                assert values[("only0_activation_min", it)] == -3.0 * it
                assert values[("only0_activation_max", it)] == 9.0 * it
        assert rank == 0 or not any(name.startswith("only0") for name, _, _ in deferred["records"])


@pytest.mark.distributed
def test_statistics_vectors_in_the_deferred_multi_rank_reduction(results):
    for r in results:
        by_mode = {mode: {(name, it): v for name, v, it in records} for mode, records in r["vectors"].items()}
        assert len(by_mode["torch"]) == 2 * len(FP8_STATS)
        auto, reference = by_mode["auto"], by_mode["torch"]
        if dist_harness.backend() == "nccl":
            # the quantize kernels add a thread's squared errors (4 in the general cast, 32 in the 16-bit one) in fp32
            # before float64, each error itself from fp32 operations (kernels/fp8_tensor.cu); the torch reference
            # works in float64: the two are within 64 roundings of the sum (every term is non-negative)
            mse = [key for key in reference if key[0] == "L_activation_mse"]
            assert [auto.pop(key) for key in mse] == [pytest.approx(reference.pop(key), rel=64 * U) for key in mse]
        assert auto == reference
    assert results[0]["vectors"]["auto"] == results[1]["vectors"]["auto"]  # reduced: every rank the same
