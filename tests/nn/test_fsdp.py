"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a converted model while a debug session logs, on 2 ranks.
FSDP frees a gathered parameter after each use by resizing its storage to 0; the CPU statistics and FP8 paths read
parameters with numpy, and ``Tensor.numpy()`` marks a storage not resizable for good, so before, the first forward
of a logged step failed in FSDP ("Trying to resize storage that is not resizable").  They read parameters through
`tedebug.host_numpy.host_view` now: every step runs, and each rank logs the whole weight's statistics."""

from __future__ import annotations

import os

import pytest
import torch

import dist_harness

WORLD = 2
TENSORS = ["activation", "weight", "gradient", "wgrad"]


def _worker(rank, world, host_kernels_mode):
    import tempfile
    import warnings

    import tedebug
    from tedebug import debug_api
    from tedebug.recipe import DelayedScaling, Float8CurrentScaling
    from torch.distributed.fsdp import fully_shard

    from support.features import RecordingSink, section

    os.environ["TEDEBUG_HOST_KERNELS"] = host_kernels_mode
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    device = dist_harness.device(rank)  # (the CPU with gloo; a GPU per rank with TEDEBUG_TEST_DIST_BACKEND=nccl)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)).to(device)
    model = tedebug.convert_model(model)
    full_weight_max = model[0].weight.max().item()  # (before sharding: the same on every rank)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    features = {"LogTensorStats": {"enabled": True, "stats": ["max", "l1_norm"], "tensors": TENSORS, "freq": 1}}
    features["LogFp8TensorStats"] = {"enabled": True, "stats": ["underflows%"], "tensors": ["weight"], "freq": 1}
    sink = RecordingSink()
    debug_api.initialize(section(features), statistics_logger=sink, log_dir=tempfile.mkdtemp(prefix="tedebug-fsdp-"))
    try:
        for step, recipe in enumerate((None, Float8CurrentScaling(), DelayedScaling())):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * rank + step)).to(device)
            with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
                model(x).pow(2).mean().backward()
            debug_api.step()
    finally:
        debug_api.end_debug()
    return full_weight_max, sink.rows


@pytest.mark.distributed
@pytest.mark.parametrize("host_kernels_mode", ["auto", "numpy"])
def test_fsdp2_over_a_converted_model_logs_every_step(host_kernels_mode):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):  # (torch before 2.6 kept it elsewhere)
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard")
    results = dist_harness.spawn(_worker, WORLD, host_kernels_mode)
    (weight_max, rows), (_, other_rows) = results
    assert rows == other_rows  # reduced over the ranks: the same on both
    values = {(name, iteration): value for name, value, iteration in rows}
    assert {iteration for _, _, iteration in rows} == {0, 1, 2}
    assert values[("0_weight_max", 0)] == weight_max  # the whole weight, not this rank's shard
    assert ("2_wgrad_l1_norm", 2) in values and ("0_weight_underflows%", 1) in values
