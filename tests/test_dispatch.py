"""Backend dispatch on CPU: torch is chosen for CPU tensors, the switch (use_backend / TEDEBUG_BACKEND) works, and
forcing the CuPy kernels on a CPU tensor or without CUDA is a clear error."""

import pytest
import torch

from tedebug.backends import backend_for, dispatch, torch_ref
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer


@pytest.fixture(autouse=True)
def clean_switch(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "_override", None)


def test_cpu_tensor_uses_torch_reference():
    x = torch.randn(8, 32)
    assert dispatch.requested_backend() == "auto"
    assert backend_for(x) is torch_ref
    assert dispatch.quantize_mxfp8(x, "E4M3", True, True) is None
    assert dispatch.quantize_fp8_current(x, "E4M3", 0.0, False, True, True) is None
    assert not hasattr(Float8CurrentScalingQuantizer().quantize(x), "_fused_error_stats")  # the torch path


def test_use_backend_context_manager_restores_previous():
    with dispatch.use_backend("torch"):
        assert dispatch.requested_backend() == "torch"
        with dispatch.use_backend("AUTO"):
            assert dispatch.requested_backend() == "auto"
        assert dispatch.requested_backend() == "torch"
    assert dispatch.requested_backend() == "auto"


def test_use_backend_as_plain_function_persists():
    dispatch.use_backend("torch")
    assert dispatch.requested_backend() == "torch"


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.requested_backend() == "torch"
    with dispatch.use_backend("auto"):  # the explicit switch wins over the environment
        assert dispatch.requested_backend() == "auto"
    monkeypatch.setenv(dispatch.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="TEDEBUG_BACKEND.*'gpu'"):
        dispatch.requested_backend()


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown backend 'numpy'"):
        dispatch.use_backend("numpy")


def test_forcing_cupy_on_cpu_tensor_is_an_error():
    x = torch.randn(32, 32)
    with dispatch.use_backend("cupy"):
        with pytest.raises(RuntimeError, match="'cupy'.*cpu"):
            backend_for(x)
        with pytest.raises(RuntimeError, match="only run on CUDA tensors"):
            MXFP8Quantizer().quantize(x)


def test_forcing_cupy_without_cuda_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake_cuda = torch.empty(0)
    monkeypatch.setattr(type(fake_cuda), "is_cuda", property(lambda self: True))
    with dispatch.use_backend("cupy"):
        with pytest.raises(RuntimeError, match="CuPy or CUDA is not available"):
            dispatch.use_kernels(fake_cuda)
    assert dispatch.cupy_available() is False


def test_torch_backend_never_uses_kernels():
    with dispatch.use_backend("torch"):
        assert dispatch.use_kernels(torch.randn(4)) is False
