"""A layer whose operands a block-scaled recipe cannot quantize (MXFP8's blocks of 32, NVFP4's of 16: a LoRA adapter
of rank 4, a small projection) raises `UnsupportedShapeError`, a ValueError, naming the layer, its operands' shapes,
the recipe and what to do, with the format's own message as its cause; before, only the format's message came
(``MXFP8Quantizer: MXFP8 needs ...``), and a model-wide recipe left the user to find the layer."""

import contextlib

import pytest
import torch

import tedebug
from tedebug.nn import Linear
from tedebug.quantization import UnsupportedShapeError
from tedebug.recipe import MXFP8BlockScaling, NVFP4BlockScaling

from support.features import debug_session, section


def _model() -> torch.nn.Module:
    """32 → 4 → 32: the middle width is no multiple of 16 or 32 (a rank-4 adapter's shapes)."""
    torch.manual_seed(0)
    return tedebug.convert_model(torch.nn.Sequential(torch.nn.Linear(32, 4), torch.nn.Linear(4, 32)))


@pytest.mark.filterwarnings("ignore:tedebug. 1 layers ran but debug_api.step")  # (the forward fails)
@pytest.mark.parametrize(
    "recipe, quantizer", [(MXFP8BlockScaling(), "MXFP8Quantizer"), (NVFP4BlockScaling(), "NVFP4Quantizer")]
)
@pytest.mark.parametrize("session", [False, True], ids=["no session", "in a session"])
def test_the_error_names_the_layer_its_shapes_and_the_way_out(tmp_path, no_debug_session, recipe, quantizer, session):
    model = _model()
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 1}})
    with debug_session(config, tmp_path) if session else contextlib.nullcontext():
        with pytest.raises(UnsupportedShapeError) as caught, tedebug.autocast(recipe=recipe):
            model(torch.randn(2, 16, 32))
    message = str(caught.value)
    assert message.startswith("layer '0' (input (2, 16, 32), weight (4, 32)): the recipe " + type(recipe).__name__)
    assert "filter_fn" in message and "outside tedebug.autocast" in message
    assert isinstance(caught.value, ValueError)
    cause = caught.value.__cause__
    assert type(cause) is UnsupportedShapeError and str(cause).startswith(quantizer) and str(cause) in message


def test_the_way_out_runs(no_debug_session):
    """What the message advises: the two narrow layers left out of convert_model run in high precision beside a
    converted one, and the model runs under MXFP8."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 4), torch.nn.Linear(4, 32), torch.nn.Linear(32, 32))
    model = tedebug.convert_model(plain, filter_fn=lambda fqn, module: 32 == module.in_features == module.out_features)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.Linear, Linear]
    with tedebug.autocast(recipe=MXFP8BlockScaling()):
        y = model(torch.randn(2, 16, 32))
    assert y.shape == (2, 16, 32) and bool(torch.isfinite(y).all())
