"""Spawning torch.distributed workers for the multi-rank tests (tensor parallelism, group reductions).

The backend comes from ``TEDEBUG_TEST_DIST_BACKEND``: ``gloo`` (default; CPU tensors, any machine) or ``nccl`` (one
CUDA device per rank; the tests then need as many GPUs as ranks).  `spawn(worker, world, *args)` starts `world`
processes running ``worker(rank, world, out_dir, *args)`` after `init` (process group + device), waits with a
timeout (a hang fails the test instead of blocking CI) and returns the objects each rank pickled with `save`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 120


def backend() -> str:
    name = os.environ.get("TEDEBUG_TEST_DIST_BACKEND", "gloo").strip().lower()
    if name not in ("gloo", "nccl"):
        raise ValueError(f"TEDEBUG_TEST_DIST_BACKEND must be 'gloo' or 'nccl', got {name!r}")
    return name


def skip_unless_runnable(world: int) -> None:
    """Skip when the selected backend cannot run `world` ranks here (NCCL without enough GPUs)."""
    if backend() == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL backend needs {world} GPUs, found {torch.cuda.device_count()}")


def device(rank: int) -> torch.device:
    """The device of rank `rank`'s tensors for the selected backend."""
    return torch.device("cuda", rank) if backend() == "nccl" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, name, worker, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend() == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend(), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        result = worker(rank, world, *args)
        with open(os.path.join(out_dir, f"{name}-rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn(worker, world: int, *args):
    """Run ``worker(rank, world, *args)`` on `world` ranks; the list of what each returned (picklable)."""
    skip_unless_runnable(world)
    out_dir = tempfile.mkdtemp(prefix="tedebug-dist-")
    name = worker.__name__
    ctx = mp.start_processes(
        _entry, args=(world, _free_port(), out_dir, name, worker, args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"{name}: distributed workers did not finish within {TIMEOUT_S}s (deadlock?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    out = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"{name}-rank{rank}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out
