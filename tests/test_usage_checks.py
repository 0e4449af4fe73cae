"""Warnings instead of silence: a section selecting no layer by the end of the first iteration, step() never
called while layers ran, statistics dropped at end_debug(); a correct run warns about none of them."""

import warnings

import pytest
import torch

from tedebug import debug_api
from tedebug.nn import Linear

STATS = {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}}


def config(pattern="fc"):
    return {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": pattern}, "transformer_engine": STATS}}


def run(tmp_path, cfg, *, forwards, steps_after):
    """`forwards` forward passes; `steps_after[i]` says whether step() follows forward i.  Returns the tedebug
    warnings."""
    layer = Linear(8, 8, name="fc1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        debug_api.initialize(cfg, log_dir=str(tmp_path))
        try:
            for i in range(forwards):
                layer(torch.randn(2, 8))
                if steps_after[i]:
                    debug_api.step()
        finally:
            debug_api.end_debug()
    return [str(w.message) for w in caught if str(w.message).startswith("tedebug:")]


def test_correct_run_does_not_warn(tmp_path):
    assert run(tmp_path, config(), forwards=2, steps_after=[True, True]) == []


def test_section_that_selects_no_layer(tmp_path):
    messages = run(tmp_path, config("attn"), forwards=2, steps_after=[True, True])
    assert len(messages) == 1
    assert messages[0].startswith(
        "tedebug: config section 'sec' selected no layer by the end of the first iteration (0)"
    )
    assert messages[0].endswith("Layers that ran: fc1")


def test_no_layer_ran_at_all(tmp_path):
    messages = run(tmp_path, config(), forwards=0, steps_after=[])
    assert messages == []  # no layer, no step: nothing to say about sections yet
    debug_api.initialize(config(), log_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"Layers that ran: none \(convert the model with tedebug.convert_model\)"):
        debug_api.step()
    debug_api.end_debug()


def test_step_never_called(tmp_path):
    messages = run(tmp_path, config(), forwards=3, steps_after=[False] * 3)
    assert messages == [
        "tedebug: 1 layers ran but debug_api.step() was never called; statistics are emitted at "
        "step(), so nothing was logged. Call debug_api.step() at the end of every training "
        "iteration."
    ]


def test_statistics_dropped_at_end_debug(tmp_path):
    messages = run(tmp_path, config(), forwards=2, steps_after=[True, False])
    assert messages == [
        "tedebug: end_debug() drops the statistics of 1 tensors fed since the last debug_api.step() "
        "(iteration 1: fc1/activation); call debug_api.step() after the last iteration to write "
        "them."
    ]


def test_warnings_as_errors_still_close_the_session(tmp_path):
    layer = Linear(8, 8, name="fc1")
    debug_api.initialize(config(), log_dir=str(tmp_path))
    layer(torch.randn(2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="never called"):
            debug_api.end_debug()
    assert debug_api.DEBUG_MANAGER is None
    debug_api.initialize(config(), log_dir=str(tmp_path))  # closed cleanly: a new session starts
    debug_api.end_debug()
