"""Statistics of tensor-parallel layers across groups: DP x TP = 2 x 2 on 4 ranks (gloo unless
TEDEBUG_TEST_DIST_BACKEND=nccl), through a real debug session with the default (deferred, background) logging.

A column-parallel Linear ("col") feeds a row-parallel Linear ("row"), Megatron's MLP pair.  Rank r is TP rank r % 2
of DP replica r // 2 and holds that DP replica's part of the global batch (NCCL with 2 GPUs: DP=1 x TP=2).  The
oracle is the statistics of the TP=1 tensors of the global batch (global input, full weights, gradients of the full
outputs), computed directly.

- default reduction group (world), weight TP reduction on: every statistic equals the oracle, on every rank; the
  tensors that every rank of a TP group holds whole (col's activation, row's gradient) count once;
- weight TP reduction off (and the synchronous, foreground-logging reduction): each rank logs its own weight shard,
  the TP replicas still count once;
- `set_tensor_reduction_group(dp_group)`: col's gradient, a TP shard, is reduced over DP only (its column slice);
- two iterations: the first goes through the layout agreement, the second through one asynchronous all-gather per
  group and no all_gather_object; `step()` leaves each iteration in flight until the next one.
"""

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import dist_harness


def _world():
    """4 ranks (DP=2 x TP=2); on NCCL with only 2 GPUs, 2 ranks (DP=1 x TP=2)."""
    if dist_harness.backend() == "nccl":
        import torch.cuda

        return 2 if torch.cuda.device_count() in (2, 3) else 4
    return 4


WORLD = _world()
TP = 2
S, B, H, F = 4, 3, 8, 8
STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax"]


def config():
    return {
        "tp": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": "^(col|row)$"},
            "transformer_engine": {
                "LogTensorStats": {
                    "enabled": True,
                    "tensors": ["activation", "gradient", "weight"],
                    "stats": STATS,
                    "freq": 1,
                }
            },
        }
    }


def global_tensors(it):
    g = torch.Generator().manual_seed(100 + it)
    x = torch.randn(S, 2 * B, H, generator=g) * (it + 1)
    w1 = torch.randn(F, H, generator=torch.Generator().manual_seed(7))
    w2 = torch.randn(H, F, generator=torch.Generator().manual_seed(8))
    dy = torch.randn(S, 2 * B, H, generator=g)
    return x, w1, w2, dy


def reference(it):
    """TP=1 tensors of the global batch: {(layer, tensor): tensor}."""
    x, w1, w2, dy = global_tensors(it)
    x = x.clone().requires_grad_(True)
    h = (x @ w1.T).detach().requires_grad_(True)
    y = h @ w2.T
    y.backward(dy)
    return {
        ("col", "activation"): x.detach(),
        ("col", "weight"): w1,
        ("col", "gradient"): h.grad,
        ("row", "activation"): h.detach(),
        ("row", "weight"): w2,
        ("row", "gradient"): dy,
    }


def oracle(t):
    d = t.double().reshape(-1)
    return {
        "min": d.min().item(),
        "max": d.max().item(),
        "mean": d.mean().item(),
        "std": d.std().item(),
        "l1_norm": d.abs().sum().item(),
        "l2_norm": torch.linalg.vector_norm(d).item(),
        "cur_amax": d.abs().max().item(),
    }


def _session(rank, world, log_dir, tp_group, dp_group, case, dev):
    """Two iterations of col -> row under a debug session; the logged records and the statistics' collectives."""
    import tedebug.stats.distributed as sd
    from tedebug import debug_api
    from tedebug.nn import Linear

    counter = {"tensor": 0, "object": 0}
    tensor_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real_tensor, real_object = getattr(dist, tensor_name), dist.all_gather_object

    def tensor(*a, **k):
        counter["tensor"] += 1
        return real_tensor(*a, **k)

    def obj(*a, **k):
        counter["object"] += 1
        return real_object(*a, **k)

    tp_rank, dp_rank = rank % TP, rank // TP
    if case == "weights_local":
        debug_api.set_weight_tensor_tp_group_reduce(False)
    # weights_local also runs the synchronous reduction (foreground logging: one all_gather_object per group)
    debug_api.initialize(config(), log_dir=log_dir, background_logging=case != "weights_local")
    if case == "dp_group":
        debug_api.set_tensor_reduction_group(dp_group)
    col = Linear(H, F, bias=False, name="col", tp_group=tp_group, parallel_mode="column", device=dev)
    row = Linear(F, H, bias=False, name="row", tp_group=tp_group, parallel_mode="row", device=dev)
    info = {"collectives": []}
    # count the statistics' collectives only (the layers communicate with all_reduce here)
    setattr(sd.dist, tensor_name, tensor)
    sd.dist.all_gather_object = obj
    try:
        for it in range(2):
            x, w1, w2, dy = global_tensors(it)
            with torch.no_grad():
                col.weight.copy_(w1.chunk(TP, 0)[tp_rank])
                row.weight.copy_(w2.chunk(TP, 1)[tp_rank])
            dp = world // TP
            x = x.chunk(dp, 1)[dp_rank].to(dev).requires_grad_(True)
            y = row(col(x))
            y.backward(dy.chunk(dp, 1)[dp_rank].to(dev))
            counter.update(tensor=0, object=0)
            debug_api.step()
            info["collectives"].append(dict(counter))
            info[f"in_flight{it}"] = debug_api.DEBUG_MANAGER.stats.has_in_flight
        info["defers"] = debug_api.DEBUG_MANAGER.stats.defers()
        counter.update(tensor=0, object=0)
        debug_api.end_debug()
        info["collectives"].append(dict(counter))
    finally:
        setattr(sd.dist, tensor_name, real_tensor)
        sd.dist.all_gather_object = real_object
        debug_api.set_weight_tensor_tp_group_reduce(True)
    path = os.path.join(log_dir, "tedebug_statistics", f"metrics_globalrank-{rank}.jsonl")
    with open(path) as f:
        info["records"] = [json.loads(line) for line in f if line.strip()]
    return info


def _worker(rank, world):
    dev = dist_harness.device(rank)
    tp_groups = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(world // TP)]
    dp_groups = [dist.new_group(list(range(t, world, TP))) for t in range(TP)]
    tp_group, dp_group = tp_groups[rank // TP], dp_groups[rank % TP]
    root = tempfile.mkdtemp(prefix=f"tedebug-tp-stats-{rank}-")
    return {
        case: _session(rank, world, os.path.join(root, case), tp_group, dp_group, case, dev)
        for case in ("world", "weights_local", "dp_group")
    }


@pytest.fixture(scope="module")
def runs():
    return dist_harness.spawn(_worker, WORLD)


def _logged(records):
    return {(r["layer"], r["tensor"], r["stat"], r["iteration"]): r["value"] for r in records}


def _assert_stats(logged, layer, tensor, it, tensor_value, rank):
    expected = oracle(tensor_value)
    for stat in STATS:
        got = logged[(layer, tensor, stat, it)]
        assert got == pytest.approx(expected[stat], rel=1e-5, abs=1e-6), (rank, layer, tensor, stat, it)


@pytest.mark.distributed
def test_tp2_dp2_statistics_equal_the_tp1_global_batch(runs):
    for rank, run in enumerate(runs):
        logged = _logged(run["world"]["records"])
        for it in range(2):
            ref = reference(it)
            for (layer, tensor), value in ref.items():
                _assert_stats(logged, layer, tensor, it, value, rank)
        assert len(run["world"]["records"]) == 2 * 6 * len(STATS)  # nothing duplicated


@pytest.mark.distributed
def test_weight_statistics_per_shard_when_tp_reduction_is_off(runs):
    for rank, run in enumerate(runs):
        logged = _logged(run["weights_local"]["records"])
        ref = reference(0)
        _assert_stats(logged, "col", "weight", 0, ref[("col", "weight")].chunk(TP, 0)[rank % TP], rank)
        _assert_stats(logged, "row", "weight", 0, ref[("row", "weight")].chunk(TP, 1)[rank % TP], rank)
        _assert_stats(logged, "col", "activation", 0, ref[("col", "activation")], rank)
        _assert_stats(logged, "row", "gradient", 0, ref[("row", "gradient")], rank)
        assert run["weights_local"]["defers"] is False


@pytest.mark.distributed
def test_dp_reduction_group_reduces_a_tp_shard_over_dp_only(runs):
    for rank, run in enumerate(runs):
        logged = _logged(run["dp_group"]["records"])
        for it in range(2):
            ref = reference(it)
            _assert_stats(logged, "col", "gradient", it, ref[("col", "gradient")].chunk(TP, 2)[rank % TP], rank)
            _assert_stats(logged, "col", "activation", it, ref[("col", "activation")], rank)
            _assert_stats(logged, "row", "gradient", it, ref[("row", "gradient")], rank)


@pytest.mark.distributed
def test_deferred_read_back_one_async_collective_per_group(runs):
    for run in runs:
        info = run["world"]
        assert info["defers"] is True
        assert info["in_flight0"] and info["in_flight1"]  # each step leaves its iteration in flight
        step0, step1, end = info["collectives"]
        # two reduction groups: the world (activations, gradients) and this rank's TP group (weights).
        # step 0 starts iteration 0 (new buffers: their rows travel apart); step 1 agrees on the layout while
        # emitting iteration 0 (one all_gather_object per group) and starts iteration 1 in the agreed layout, which
        # the end of the session emits without any all_gather_object
        assert step0 == {"tensor": 2, "object": 0}
        assert step1 == {"tensor": 2, "object": 2}
        assert end == {"tensor": 0, "object": 0}
