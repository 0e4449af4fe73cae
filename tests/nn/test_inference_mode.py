"""A debug session through ``torch.inference_mode()`` (a validation loop; Lightning runs validation in it): the
statistics are those of the same forward under ``torch.no_grad()``, under every recipe, and a training step after
it logs what it logs after a ``no_grad`` step.  Before, a quantizing recipe stopped the forward: a tensor made under
inference mode has no version counter, and the quantizers keep their fused statistics keyed by it.  Both the
statistics engine's CPU path and the GPU path's bookkeeping (the stand-in kernel backend) are run."""

from __future__ import annotations

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling
from tedebug.stats import engine as engine_module

from support.features import RecordingSink, debug_session, section
from support.slab_backend import slab_backend

HP_STATS = {"stats": ["max", "l1_norm", "std"], "tensors": ["activation", "weight", "output"], "freq": 1}
QUANTIZED = {"stats": ["underflows%", "mse", "scale_inv_min"], "tensors": ["activation", "weight"], "freq": 1}
RECIPES = [None, Float8CurrentScaling(), DelayedScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()]


def _config(recipe, quantized: bool):
    features = {"LogTensorStats": {"enabled": True, **HP_STATS}}
    if quantized:
        features["LogFp8TensorStats"] = {"enabled": True, **QUANTIZED}
    return section(features)


def _per_tensor_fp8(recipe) -> bool:
    return isinstance(recipe, (Float8CurrentScaling, DelayedScaling))


def _rows(tmp_path, recipe, evaluation, name, quantized):
    """Rows of a session whose iteration 0 is a forward under `evaluation` and iteration 1 a training step."""
    torch.manual_seed(0)
    model = tedebug.convert_model(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    )
    x = torch.randn(2, 32, 64)
    sink = RecordingSink()
    with debug_session(_config(recipe, quantized), tmp_path / name, sink=sink):
        with evaluation(), tedebug.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        debug_api.step()
        with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
            model(x).pow(2).sum().backward()
        debug_api.step()
    return y, sink.rows


@pytest.mark.parametrize("path", ["cpu", "gpu-path"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_inference_mode_logs_what_no_grad_logs(tmp_path, no_debug_session, monkeypatch, recipe, path):
    quantized = _per_tensor_fp8(recipe) and path == "cpu"  # (the stand-in backend has only the basic partials)
    if path == "gpu-path":
        stand_in = slab_backend(scratch=True)
        monkeypatch.setattr(engine_module, "backend_for", lambda x: stand_in)
    y, rows = _rows(tmp_path, recipe, torch.inference_mode, "inference", quantized)
    expected_y, expected = _rows(tmp_path, recipe, torch.no_grad, "no_grad", quantized)
    assert y.is_inference() and torch.equal(y, expected_y)
    assert rows == expected
    for step in (0, 1):  # the inference step, and the training step after it
        names = {name for name, _, iteration in rows if iteration == step}
        assert {"0_activation_max", "2_output_l1_norm"} <= names
        if quantized:
            assert {"0_activation_underflows%", "2_weight_mse"} <= names


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", RECIPES[1:], ids=lambda r: type(r).__name__)
def test_training_after_a_first_forward_in_inference_mode(recipe, device):
    """A first forward under inference mode (a sanity validation before training) builds the layers' quantizers;
    training after it computes what it computes without that forward (before, delayed scaling's state was made in
    inference mode and its first update raised; on a GPU the state is also moved there by the first forward)."""

    def trained(validate_first: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(device)
        model = tedebug.convert_model(model)
        x = torch.randn(2, 32, 64, device=device)
        if validate_first:
            with torch.inference_mode(), tedebug.autocast(enabled=True, recipe=recipe):
                model(x)
        else:
            with torch.no_grad(), tedebug.autocast(enabled=True, recipe=recipe):
                model(x)
        for _ in range(2):
            with tedebug.autocast(enabled=True, recipe=recipe):
                y = model(x)
            y.pow(2).sum().backward()
        return y.detach(), [p.grad for p in model.parameters()]

    y, grads = trained(True)
    expected_y, expected_grads = trained(False)
    assert torch.equal(y, expected_y)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
