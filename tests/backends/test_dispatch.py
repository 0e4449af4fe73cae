"""Backend dispatch on CPU: torch is chosen for CPU tensors, the switch (use_backend / TEDEBUG_BACKEND) works, and
forcing the CuPy kernels on a CPU tensor or without CUDA is a clear error; an explicit ``kernel=`` (a dispatch
argument or a quantizer's) wins over the switch, which only supplies the default."""

import pytest
import torch

from tedebug.backends import backend_for, dispatch, torch_ref
from tedebug.backends.dispatch import KernelPreference
from tedebug.backends.fused_stats import fused_vector
from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from tedebug.quantization.float8_block import Float8BlockQuantizer
from tedebug.quantization.mxfp8 import MXFP8Quantizer
from tedebug.quantization.nvfp4 import NVFP4Quantizer


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
    # not the kernels: the CPU host cast, whose quantization statistics (attached since the host cast computes them
    # too) are a CPU vector
    assert fused_vector(Float8CurrentScalingQuantizer().quantize(x), x, "rowwise").vector.device == x.device


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


# ------------------------------------------------------------------------------------------------ kernel=
def test_kernel_preference_names_are_the_backend_names():
    assert [k.value for k in KernelPreference] == ["auto", "torch", "cupy"] == list(dispatch.BACKENDS)
    assert KernelPreference.TORCH == "torch"
    assert dispatch.kernel_preference("CuPy") is KernelPreference.CUPY
    assert dispatch.kernel_preference(KernelPreference.AUTO) is KernelPreference.AUTO
    assert dispatch.kernel_preference(None) is None
    with pytest.raises(ValueError, match=r"where: unknown backend 'gpu'; expected one of \('auto', 'torch', 'cupy'\)"):
        dispatch.kernel_preference("gpu", "where")
    with dispatch.use_backend(KernelPreference.TORCH):
        assert dispatch.requested_backend() == "torch"


def test_an_explicit_kernel_wins_over_use_backend_and_the_environment(monkeypatch):
    x = torch.randn(32, 32)
    with dispatch.use_backend("cupy"):
        assert dispatch.use_kernels(x, KernelPreference.TORCH) is False
        assert dispatch.use_kernels(x, "auto") is False  # auto: a CPU tensor stays on torch
        assert dispatch.stats_backend(x, "torch") is torch_ref
        assert backend_for(x, KernelPreference.AUTO) is torch_ref
        q = MXFP8Quantizer(kernel="torch").quantize(x)  # the default ("cupy") would refuse the CPU tensor
        assert not hasattr(q, "_fused_error_stats")
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    with pytest.raises(RuntimeError, match=r"'cupy' was requested \(kernel=\).*only run on CUDA tensors"):
        MXFP8Quantizer(kernel=KernelPreference.CUPY).quantize(x)
    with pytest.raises(RuntimeError, match=r"'cupy' was requested \(use_backend / TEDEBUG_BACKEND\)"):
        with dispatch.use_backend("cupy"):
            MXFP8Quantizer().quantize(x)


QUANTIZERS = {
    "Float8Quantizer": lambda kernel: Float8Quantizer(torch.ones(1), torch.zeros(4), "E4M3", kernel=kernel),
    "Float8CurrentScalingQuantizer": lambda kernel: Float8CurrentScalingQuantizer(kernel=kernel),
    "MXFP8Quantizer": lambda kernel: MXFP8Quantizer(kernel=kernel),
    "Float8BlockQuantizer": lambda kernel: Float8BlockQuantizer(kernel=kernel),
    "NVFP4Quantizer": lambda kernel: NVFP4Quantizer(kernel=kernel),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_every_quantizer_passes_its_kernel_to_dispatch(name):
    make = QUANTIZERS[name]
    x = torch.randn(32, 64)
    assert make(None).kernel is None
    torch_quantizer = make("TORCH")
    assert torch_quantizer.kernel is KernelPreference.TORCH and torch_quantizer.copy().kernel is KernelPreference.TORCH
    with dispatch.use_backend("cupy"):
        torch_quantizer.quantize(x)  # no error: the quantizer's own choice wins
    with pytest.raises(RuntimeError, match=r"\(kernel=\).*only run on CUDA tensors"):
        make(KernelPreference.CUPY).quantize(x)
    with pytest.raises(ValueError, match=rf"{name}\(kernel=\.\.\.\): unknown backend 'gpu'"):
        make("gpu")


def test_delayed_scaling_update_follows_the_quantizer_kernel():
    q = Float8Quantizer(torch.ones(1), torch.zeros(4), "E4M3", kernel="cupy")
    with pytest.raises(RuntimeError, match=r"\(kernel=\).*only run on CUDA tensors"):
        q.update_scale()
    with dispatch.use_backend("cupy"):
        Float8Quantizer(torch.ones(1), torch.zeros(4), "E4M3", kernel="torch").update_scale()  # the torch path


def test_philox_bytes_follow_the_kernel_argument(monkeypatch):
    from tedebug.backends import cupy_philox

    monkeypatch.setattr(dispatch, "_cupy_importable", lambda: True)
    monkeypatch.setattr(cupy_philox, "philox_bytes", lambda seed, offset, n, device: ("kernel", seed, offset, n))
    cuda = torch.device("cuda", 0)
    assert dispatch.philox_bytes(3, 5, 16, cuda) == ("kernel", 3, 5, 16)
    assert dispatch.philox_bytes(3, 5, 16, cuda, kernel="torch") is None
    with dispatch.use_backend("torch"):
        assert dispatch.philox_bytes(3, 5, 16, cuda) is None
        assert dispatch.philox_bytes(3, 5, 16, cuda, KernelPreference.AUTO) == ("kernel", 3, 5, 16)


def test_launcher_modules_are_imported_once(monkeypatch):
    """`_kernel_module` gives the launcher module itself, and after its first import a dict look-up: no import
    machinery at every quantization, GEMM or statistics launch."""
    import importlib

    from tedebug.backends import cupy_stats

    dispatch._KERNEL_MODULES.pop("cupy_stats", None)
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name) or real(name))
    assert dispatch._kernel_module("cupy_stats") is cupy_stats
    assert dispatch._kernel_module("cupy_stats") is cupy_stats
    assert imported == ["tedebug.backends.cupy_stats"]
