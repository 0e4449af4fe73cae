"""Copies of a converted model: ``copy.deepcopy`` (an EMA model, a frozen reference model) and ``torch.save(model)``
/ ``torch.load`` work before, during and after a debug session, under every recipe, and the copy computes what the
original does; a copy that runs in the same session under the original's layer names is warned about (their
statistics would be merged), and `tedebug.nn.prefix_layer_names` gives it names of its own."""

from __future__ import annotations

import copy
import gc
import io
import subprocess
import sys
import warnings

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.nn import LayerNormMLP, Linear, prefix_layer_names
from tedebug.nn.state import STATE_KEY
from tedebug.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

from support.features import RecordingSink, debug_session, section
from support.hf_models import mixtral

CONFIG = section(
    {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation", "weight"], "freq": 1}}
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    model = tedebug.convert_model(model)
    model.add_module("mlp", LayerNormMLP(32, 64, name="mlp"))
    return model


def _saved_and_loaded(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _step(model, x, recipe):
    """Output and parameter gradients of one forward and backward (the gradients are cleared first)."""
    model.zero_grad()
    with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:tedebug. two modules run as layer")  # (the copy runs under the same names)
@pytest.mark.parametrize("recipe", [None, DelayedScaling(), Float8CurrentScaling(), MXFP8BlockScaling()])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("when", ["no session", "in a session", "after end_debug"])
def test_a_copy_computes_what_the_original_does(tmp_path, no_debug_session, recipe, how, when):
    """Before, a converted model could not be copied at all: its high-precision GEMMs share a read-only mapping,
    and a layer that ran in a session held the session's sinks and locks (TypeError: cannot pickle ...)."""
    model = _model()
    x = torch.randn(2, 32, 32)
    if when != "no session":
        debug_api.initialize(CONFIG, log_dir=str(tmp_path))
    _step(model, x, recipe)  # (delayed scaling: the amax history and scale now hold a step)
    if when != "no session":
        debug_api.step()
    if when == "after end_debug":
        debug_api.end_debug()
    twin = copy.deepcopy(model) if how == "deepcopy" else _saved_and_loaded(model)
    state, twin_state = model.state_dict(), twin.state_dict()
    assert list(state) == list(twin_state)
    for key, value in state.items():
        assert torch.equal(twin_state[key], value), key
    y, grads = _step(model, x, recipe)
    twin_y, twin_grads = _step(twin, x, recipe)
    assert torch.equal(twin_y, y)
    assert all(torch.equal(a, b) for a, b in zip(twin_grads, grads))
    if recipe is not None and recipe.delayed():  # the delayed-scaling state was copied (and stepped the same)
        history = f"0.{STATE_KEY}.gemm_state.input.0.amax_history"
        assert torch.equal(twin.state_dict()[history], model.state_dict()[history])


def _rows(sink):
    return {name: value for name, value, _ in sink.rows}


def test_a_copy_under_the_same_names_is_warned_about_once(tmp_path, no_debug_session):
    """An EMA copy running in the session feeds the original's layers' statistics: one UserWarning for the session,
    and the main log names every layer two modules ran as."""
    model = _model()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(2)
    x = torch.randn(2, 8, 32)
    sink = RecordingSink()
    with debug_session(CONFIG, tmp_path, sink=sink):
        model(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                ema(x)
                ema(x)  # (the same modules again: nothing more)
        debug_api.step()
    shared = [w for w in caught if "two modules run as layer" in str(w.message)]
    assert len(shared) == 1 and "'0'" in str(shared[0].message) and "prefix_layer_names" in str(shared[0].message)
    log = (tmp_path / "nvdlfw_inspect_logs" / "nvdlfw_inspect_globalrank-0.log").read_text()
    named = [line.split("layer ")[1].split(";")[0] for line in log.splitlines() if "a second module runs as" in line]
    assert named == ["'0'", "'2'", "'mlp.fc1'", "'mlp.fc2'"]
    # merged: a weight keeps the first module's feed
    assert _rows(sink)["0_weight_max"] == model[0].weight.max().item()


def test_prefixed_names_log_the_copy_apart(tmp_path, no_debug_session):
    model = _model()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(2)
    assert prefix_layer_names(ema, "ema.") == ["ema.0", "ema.2", "ema.mlp"]
    x = torch.randn(2, 8, 32)
    sink = RecordingSink()
    with debug_session(CONFIG, tmp_path, sink=sink):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning about shared names
            model(x)
            ema(x)
        debug_api.step()
    rows = _rows(sink)
    for name, layer in (("0", model[0]), ("ema.0", ema[0]), ("2", model[2]), ("ema.2", ema[2])):
        assert rows[f"{name}_weight_max"] == layer.weight.max().item()
        assert rows[f"{name}_activation_max"] > 0
    assert rows["ema.0_weight_max"] == 2 * rows["0_weight_max"]
    assert rows["ema.mlp.fc1_weight_max"] == ema.mlp.fc1_weight.max().item()


def test_one_module_called_twice_or_a_model_built_again_is_no_copy(tmp_path, no_debug_session):
    x = torch.randn(2, 8, 32)
    with debug_session(CONFIG, tmp_path), warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = Linear(32, 32, name="shared")
        torch.nn.Sequential(shared, shared)(x)  # one module under one name, twice in the iteration
        debug_api.step()
        model = _model()
        model(x)
        debug_api.step()
        del model
        gc.collect()
        _model()(x)  # the first model is gone: the new one takes its names
        debug_api.step()


def test_prefix_layer_names_refuses_what_it_cannot_use():
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        prefix_layer_names([Linear(4, 4)], "ema.")
    with pytest.raises(TypeError, match="non-empty str prefix"):
        prefix_layer_names(Linear(4, 4), "")


def test_converted_experts_load_in_a_process_that_never_converted(tmp_path):
    """transformers' experts are converted by a class made at conversion, which pickle cannot name: the saved model
    loads in a fresh process and computes the same logits."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tedebug.convert_model(mixtral())
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        logits = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    torch.save((ids, logits), tmp_path / "expected.pt")
    script = (
        "import sys, torch\n"
        "model = torch.load(sys.argv[1] + '/model.pt', weights_only=False)\n"
        "ids, logits = torch.load(sys.argv[1] + '/expected.pt')\n"
        "experts = model.model.layers[0].mlp.experts\n"
        "print(type(experts).__name__, experts.name)\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(model(ids).logits, logits)\n"
    )
    # (run from tmp_path: the repository's kernels/ folder would shadow the `kernels` package transformers imports)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["TedebugMixtralExperts", "model.layers.0.mlp.experts"]
