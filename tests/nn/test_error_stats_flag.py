"""`Quantizer.error_stats`: a layer's own quantizers skip the costly quantization-error statistics outside the debug
path, and a `DebugQuantizer` turns them on for exactly the quantizations it inspects (then restores the flag)."""

import torch

import tedebug
from tedebug import debug_api
from tedebug.debug_quantization import DebugQuantizer
from tedebug.quantization.hybrid import HybridQuantizer
from tedebug.quantization.nvfp4 import NVFP4Quantizer
from tedebug.recipe import Float8CurrentScaling, NVFP4BlockScaling

from support.features import RecordingSink, debug_session, section


def test_a_layers_quantizers_skip_the_statistics_outside_the_debug_path():
    layer = tedebug.nn.Linear(32, 16, name="lin")
    x = torch.randn(16, 32)
    for recipe in (Float8CurrentScaling(), NVFP4BlockScaling()):
        with tedebug.autocast(recipe=recipe):
            layer(x).sum().backward()
        quantizers = [q for q in layer.gemm_state.quantizers.values() if q is not None]
        assert quantizers and all(q.error_stats is False for q in quantizers), recipe
    assert NVFP4Quantizer().error_stats is True  # a quantizer made by hand (tests, what-if features) computes them


def _spied_parent(monkeypatch):
    """A parent NVFP4 quantizer with the flag off, and the list of the flag's value at each of its quantizations."""
    seen = []
    parent = NVFP4Quantizer()
    parent.error_stats = False
    real = NVFP4Quantizer.quantize

    def spying(self, tensor, **kwargs):
        seen.append(self.error_stats)
        return real(self, tensor, **kwargs)

    monkeypatch.setattr(NVFP4Quantizer, "quantize", spying)
    return seen, parent


def test_debug_quantizer_turns_them_on_for_its_call_only(tmp_path, monkeypatch):
    seen, parent = _spied_parent(monkeypatch)
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"]}})
    with debug_session(config, tmp_path, RecordingSink()):
        q = DebugQuantizer("L", "activation", parent, None)
        q.quantize(torch.randn(32, 64))
        debug_api.step()
    assert seen == [True] and parent.error_stats is False


def test_debug_quantizer_leaves_them_off_when_it_inspects_nothing(tmp_path, monkeypatch):
    """An iteration at which the tensor is not inspected (LogTensorStats at freq 2, iteration 1): the parent
    quantization computes no error statistics; at iteration 2 it does again."""
    seen, parent = _spied_parent(monkeypatch)
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 2}})
    with debug_session(config, tmp_path, RecordingSink()):
        for _ in range(3):
            DebugQuantizer("L", "activation", parent, None).quantize(torch.randn(32, 64))
            debug_api.step()
    assert seen == [True, False, True] and parent.error_stats is False


def test_hybrid_flag_is_its_childrens():
    hybrid = HybridQuantizer(NVFP4Quantizer(), NVFP4Quantizer())
    assert hybrid.error_stats is True
    hybrid.error_stats = False
    assert hybrid.rowwise_quantizer.error_stats is False and hybrid.columnwise_quantizer.error_stats is False
    assert hybrid.error_stats is False
