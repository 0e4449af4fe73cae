"""nvdlfw's generic LogTensorStats across 2 CPU ranks (gloo): gather to the last rank by default, all-gather over a
reduction group (per call or set globally), local values with skip_reduction."""

import os
import pickle
import socket

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 90
CONFIG = {
    "s": {
        "enabled": True,
        "layers": {"layer_types": ["fc1"]},
        "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["min", "max", "mean"]},
    }
}


def local_tensor(rank):
    return (torch.arange(4.0) + 10 * rank).reshape(2, 2).requires_grad_()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, out_dir):
    import torch.distributed as dist

    from tedebug import debug_api

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        debug_api.initialize(CONFIG, log_dir=os.path.join(out_dir, f"logs{rank}"))
        x = local_tensor(rank)

        def call(**kw):
            stats = debug_api.log_tensor_stats("fc1", tensor=x, tensor_name="activation", **kw)
            return {k: v.item() for k, v in stats.items()}

        results = {
            "default": call(),
            "group": call(reduction_group=dist.group.WORLD),
            "skip": call(skip_reduction=True),
        }
        debug_api.set_tensor_reduction_group(dist.group.WORLD)
        results["global_group"] = call()
        debug_api.end_debug()
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        # both ranks done with every collective before either tears the group down (a gloo peer that closes while
        # the other still talks to it was seen to abort the process at exit, rarely)
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.distributed
def test_generic_log_tensor_stats_reduction(tmp_path):
    ctx = mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn"
    )
    try:
        import time

        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "workers did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = []
    for rank in range(WORLD):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            out.append(pickle.load(f))
    both = {"min": 0.0, "max": 13.0, "mean": 6.5}  # [0, 1, 2, 3, 10, 11, 12, 13]
    assert out[0]["default"] == {} and out[1]["default"] == both  # gathered on the last rank only
    for rank in range(WORLD):
        assert out[rank]["group"] == both and out[rank]["global_group"] == both
        assert out[rank]["skip"] == {"min": 10.0 * rank, "max": 10.0 * rank + 3, "mean": 10.0 * rank + 1.5}
