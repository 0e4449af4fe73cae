"""Activation checkpointing with tedebug layers: a checkpointed run (torch.utils.checkpoint, reentrant and
non-reentrant) gives the same losses and the same statistics as the plain run, under current and delayed scaling,
also when backward runs inside `tedebug.autocast` (the recompute is not inspected again), and in high precision
with and without a debug session."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tedebug
from tedebug import debug_api
from tedebug.recipe import DelayedScaling, Float8CurrentScaling

from support.features import RecordingSink, section

CONFIG = section(
    {
        "LogTensorStats": {
            "enabled": True,
            "stats": ["l1_norm", "max", "std"],
            "tensors": ["activation", "gradient", "weight", "output"],
            "freq": 1,
        },
        "LogFp8TensorStats": {
            "enabled": True,
            "stats": ["underflows%", "mse", "mxfp8_mse"],
            "tensors": ["activation", "gradient", "weight"],
            "freq": 1,
        },
    }
)


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Model(torch.nn.Module):
    def __init__(self, dim=32, blocks=2, mode=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(blocks))
        self.mode = mode  # None, "reentrant", "non_reentrant"

    def forward(self, x):
        for block in self.blocks:
            if self.mode is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def train(tmp_path, recipe, mode, *, backward_in_autocast=False, steps=3, config=CONFIG):
    """(losses, statistics, parameters) of a few steps; `config` None: without a debug session."""
    torch.manual_seed(0)
    model = tedebug.convert_model(Model(mode=mode))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, 32, generator=g, requires_grad=mode == "reentrant") for _ in range(steps)]
    sink = RecordingSink()
    losses = []
    if config is not None:
        debug_api.initialize(config, statistics_logger=sink, log_dir=str(tmp_path / str(mode)))
    try:
        for x in data:
            with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
                loss = model(x).pow(2).mean()
                if backward_in_autocast:
                    loss.backward()
            if not backward_in_autocast:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if config is not None:
                debug_api.step()
    finally:
        debug_api.end_debug()
    return torch.stack(losses), sink.values(), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "recipe", [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=["current", "delayed"]
)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_run_equals_the_plain_run(tmp_path, recipe, mode):
    ref_losses, ref_stats, ref_params = train(tmp_path, recipe, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's reentrant-checkpoint notes
        losses, stats, params = train(tmp_path, recipe, mode)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert stats == ref_stats  # same statistics, each emitted once per iteration
    assert ("blocks.0.fc1_activation_l1_norm", 2) in stats
    assert ("blocks.1.fc2_gradient_underflows%", 0) in stats


def test_backward_inside_autocast_counts_statistics_once(tmp_path):
    ref_losses, ref_stats, _ = train(tmp_path, Float8CurrentScaling(), None)
    losses, stats, _ = train(tmp_path, Float8CurrentScaling(), "non_reentrant", backward_in_autocast=True)
    assert torch.equal(losses, ref_losses)
    assert stats == ref_stats


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("session", ["no session", "fc1 logged"])
def test_high_precision_checkpointing(tmp_path, no_debug_session, mode, session):
    """In high precision a GEMM call with no debug path runs torch's own linear, and its recompute must too: before,
    the recompute ran tedebug's autograd function, which saves other tensors, and a non-reentrant checkpoint
    failed (CheckpointError: recomputed values ... have different metadata; a converted Hugging Face model with
    gradient checkpointing and no session).  With fc1 logged, fc2 still takes that path inside the session."""
    config = None
    if session == "fc1 logged":
        features = {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 1}}
        config = section(features, layer_name_regex_pattern=r".*fc1")
    ref_losses, ref_stats, ref_params = train(tmp_path, None, None, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's reentrant-checkpoint notes
        losses, stats, params = train(tmp_path, None, mode, config=config)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert stats == ref_stats and len(stats) == (0 if config is None else 2 * 3)
