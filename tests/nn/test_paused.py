"""`debug_api.paused()`: the GEMM calls that start inside the block run as without a session (an evaluation loop
between two steps), so the iteration's statistics are those of its training calls alone; a backward of an earlier
forward is still inspected; blocks nest; before initialize the block does nothing."""

from __future__ import annotations

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.recipe import Float8CurrentScaling

from support.features import RecordingSink, debug_session, section

STATS = {
    "LogTensorStats": {"enabled": True, "stats": ["max", "l1_norm"], "tensors": ["activation", "wgrad"], "freq": 1}
}


def _model():
    torch.manual_seed(0)
    return tedebug.convert_model(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)))


def _run(tmp_path, evaluate):
    """Statistics of 3 training steps; `evaluate(model, batch)` runs after each step's `debug_api.step()`."""
    model, sink = _model(), RecordingSink()
    g = torch.Generator().manual_seed(1)
    with debug_session(section(STATS), tmp_path / str(len(list(tmp_path.iterdir()))), sink=sink):
        for _ in range(3):
            model(torch.randn(4, 16, generator=g)).square().sum().backward()
            debug_api.step()
            evaluate(model, 10 * torch.randn(64, 16, generator=g))  # (larger values: they would show)
    return sink.values()


def _paused_eval(model, batch):
    with debug_api.paused(), torch.no_grad():
        model(batch)


def _plain_eval(model, batch):
    with torch.no_grad():
        model(batch)


@pytest.mark.filterwarnings("ignore:tedebug. end_debug.. drops the statistics")  # (the unpaused run's last evaluation)
def test_an_evaluation_loop_inside_paused_leaves_the_statistics_as_without_it(tmp_path, no_debug_session):
    without = _run(tmp_path, lambda model, batch: None)
    assert _run(tmp_path, _paused_eval) == without and ("0_activation_max", 2) in without
    polluted = _run(tmp_path, _plain_eval)  # (what the block keeps out: the next iteration counts the evaluation)
    assert polluted[("0_activation_max", 1)] > without[("0_activation_max", 1)]


def test_a_backward_of_an_earlier_forward_is_inspected(tmp_path, no_debug_session):
    model, sink = _model(), RecordingSink()
    with debug_session(section(STATS), tmp_path, sink=sink):
        loss = model(torch.randn(4, 16)).sum()
        with debug_api.paused():
            loss.backward()
            assert debug_api.DEBUG_MANAGER.paused == 1
        debug_api.step()
    assert {name for name, _, _ in sink.rows} == {
        f"{layer}_{tensor}_{stat}"
        for layer in "02"
        for tensor in ("activation", "wgrad")
        for stat in ("max", "l1_norm")
    }


def test_paused_calls_run_the_layers_own_recipe_and_blocks_nest(tmp_path, no_debug_session):
    """DisableQuantizationGEMM turns fprop to high precision in the session; inside the block the layer quantizes
    as it would without a session."""
    model, x = _model(), torch.randn(4, 16)
    with torch.no_grad(), tedebug.autocast(recipe=Float8CurrentScaling()):
        quantized = model(x)
        config = section({"DisableQuantizationGEMM": {"enabled": True, "gemms": ["fprop", "dgrad", "wgrad"]}})
        with debug_session(config, tmp_path):
            debugged = model(x)
            with debug_api.paused():
                with debug_api.paused():
                    inner = model(x)
                outer = model(x)
            after = model(x)
            assert debug_api.DEBUG_MANAGER.paused == 0
            debug_api.step()
    with torch.no_grad():
        high_precision = model(x)
    assert not torch.equal(quantized, high_precision)
    assert torch.equal(debugged, high_precision) and torch.equal(after, high_precision)
    assert torch.equal(inner, quantized) and torch.equal(outer, quantized)


def test_before_initialize_the_block_does_nothing(no_debug_session):
    with debug_api.paused():
        y = _model()(torch.ones(2, 16))
    assert y.shape == (2, 8)
