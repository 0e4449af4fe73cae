"""The compiled linear of inspect-only GEMM calls (kernels/inspected_linear.cpp, `tedebug.nn.compiled_linear`): its
answers against torch's own ops, its hook against autograd's gradients, the calls it hands back, and the choice of
path.  That a training step logs the same through it as through the generic path: tests/nn/test_inspect_only_path.py."""

from __future__ import annotations

import gc
import os
import pathlib
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tedebug.backends import host_kernels
from tedebug.nn import compiled_linear

try:
    import fcntl
except ImportError:  # (not on Windows)
    fcntl = None


@pytest.fixture(scope="module")
def built():
    """The module this session built (skips where it cannot be built)."""
    module = compiled_linear.wait_for_build()
    if module is None:
        pytest.skip(f"the compiled linear cannot be built here: {compiled_linear.unavailable_reason()}")
    return module


@pytest.fixture(scope="module")
def linear(built):
    return built.linear


class Context:
    """A stand-in for the GEMM call's quantizers: what the hook passes back, and whether it is freed."""


def _operands(shape, bias=True, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(True)
    w = torch.randn(24, shape[-1], generator=g).to(device, dtype).requires_grad_(True)
    b = torch.randn(24, generator=g).to(device, dtype).requires_grad_(True) if bias else None
    return x, w, b


def _check_against_torch(linear, shape, bias, device="cpu", dtype=torch.float32):
    x, w, b = _operands(shape, bias, device, dtype)
    seen = []
    context = Context()
    x2, y2, y = linear(x, w, b, lambda *a: seen.append(a), context)
    # the forward: torch's ops on the same operands, bit for bit, and the views the Python path makes
    expected_x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    assert torch.equal(x2, expected_x2) and x2.data_ptr() == x.data_ptr()
    assert torch.equal(y2, F.linear(expected_x2, w, b))
    assert torch.equal(y, F.linear(x, w, b)) and y.shape == F.linear(x, w, b).shape
    assert type(y2.grad_fn).__name__ == ("AddmmBackward0" if bias else "MmBackward0")
    # the backward: the hook sees (context, dy, dx, dWt) as autograd computes them
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    y.backward(dy)
    assert len(seen) == 1
    got_context, got_dy, got_dx, got_dwt = seen[0]
    assert got_context is context
    assert torch.equal(got_dy, dy.reshape(y2.shape))
    assert torch.equal(got_dx, x.grad.reshape(x2.shape))
    assert torch.equal(got_dwt.t(), w.grad)


@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 16), (16,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_the_answers_are_torchs_ops_and_the_hook_gets_autograds_gradients(linear, shape, bias):
    _check_against_torch(linear, shape, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_on_cuda_the_hook_runs_on_autograds_device_thread(linear, bias):
    """On CUDA autograd runs the node on its device thread, which holds no GIL: the hook takes it to call Python."""
    _check_against_torch(linear, (2, 8, 64), bias, device="cuda", dtype=torch.bfloat16)


def test_no_hook_call_when_neither_x_nor_w_takes_a_gradient(linear):
    x, w, b = _operands((4, 16))
    x.requires_grad_(False)
    w.requires_grad_(False)
    seen = []
    _, _, y = linear(x, w, b, lambda *a: seen.append(a), None)
    y.sum().backward()  # only the bias takes a gradient
    assert seen == [] and b.grad is not None


def test_without_a_backward_callable_no_hook_is_registered(linear):
    """(A hook would hold the context until the graph goes.)"""
    x, w, b = _operands((4, 16))
    context = Context()
    freed = weakref.ref(context)
    _, y2, _ = linear(x, w, b, None, context)
    del context
    gc.collect()
    assert freed() is None and y2.grad_fn is not None


class _Marked(torch.Tensor):
    """A tensor subclass: only F.linear's Python call honours a __torch_function__."""


@pytest.mark.parametrize(
    "case", ["subclass_x", "subclass_w", "subclass_bias", "strided_w", "strided_x", "mode", "scalar_x"]
)
def test_calls_it_hands_back_to_the_python_path(linear, case):
    x, w, b = _operands((2, 3, 16))
    if case == "subclass_x":
        x = x.detach().as_subclass(_Marked)
    elif case == "subclass_w":
        w = w.detach().as_subclass(_Marked)
    elif case == "subclass_bias":
        b = b.detach().as_subclass(_Marked)
    elif case == "strided_w":
        w = torch.randn(16, 24).t()
    elif case == "strided_x":
        x = torch.randn(16, 6).t()  # [6, 16], column-major (a 3-D x is reshaped: a copy where not a view)
    elif case == "scalar_x":
        x = torch.tensor(1.0)
    if case == "mode":
        with TorchFunctionMode():
            assert linear(x, w, b, None, None) is None
    else:
        assert linear(x, w, b, None, None) is None


def test_torchs_errors_and_the_hooks_exceptions_propagate(linear):
    x, w, b = _operands((4, 16))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        linear(torch.randn(4, 5), w, b, None, None)

    class Boom(Exception):
        pass

    def backward(*_):
        raise Boom("from the hook")

    _, _, y = linear(x, w, b, backward, None)
    with pytest.raises(Boom, match="from the hook"):
        y.sum().backward()


def test_the_hook_lets_its_objects_go_with_the_graph(linear):
    x, w, b = _operands((4, 16))
    context = Context()
    freed = weakref.ref(context)
    y = linear(x, w, b, lambda *a: None, context)[2]
    del context
    gc.collect()
    assert freed() is not None  # held by the node's hook
    del y
    gc.collect()
    assert freed() is None


def test_set_traced_hook_takes_only_a_callable(built):
    """What compiled autograd calls in the compiled hook's place is `compiled_linear.traced_hook`'s answer, which the
    loader gives the module (that a backward under compiled autograd then logs: tests/nn/test_inspect_only_path.py,
    which fails with "set_traced_hook was not called" without it).  A value that cannot be called is refused."""
    with pytest.raises(TypeError, match="hook must be callable"):
        built.set_traced_hook(5)
    built.set_traced_hook(compiled_linear.traced_hook)  # (put back what the loader gave it)


# ------------------------------------------------------------------------------------------------ the choice
@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module's build forgotten before and after the test; the cache in `tmp_path` unless a test says."""
    compiled_linear._reset_for_tests()
    yield monkeypatch
    compiled_linear._reset_for_tests()


def test_python_mode_answers_none(fresh, linear):
    fresh.setenv(compiled_linear.ENV_VAR, "python")
    assert compiled_linear.linear_function() is None


def test_auto_mode_takes_the_python_path_until_the_background_build_is_over(fresh, linear):
    fresh.delenv(compiled_linear.ENV_VAR, raising=False)
    assert compiled_linear.linear_function() is None  # the build has just started, in its thread
    assert compiled_linear._builder is not None and compiled_linear._builder.name.startswith("tedebug")
    assert compiled_linear.wait_for_build() is not None
    answer = compiled_linear.linear_function()
    assert answer is not None and answer.__name__ == "linear"
    fresh.setenv(compiled_linear.ENV_VAR, " Python ")  # read again when the variable changes
    assert compiled_linear.linear_function() is None


def test_prepare_builds_now_unless_the_mode_is_python(fresh, linear):
    fresh.setenv(compiled_linear.ENV_VAR, "python")
    compiled_linear.prepare()
    assert compiled_linear._BUILD.outcome is None and compiled_linear._builder is None
    fresh.setenv(compiled_linear.ENV_VAR, "auto")
    compiled_linear.prepare()
    assert compiled_linear._BUILD.outcome is not None and compiled_linear.linear_function() is not None


def test_a_value_that_is_no_mode_names_the_variable_and_the_modes(fresh):
    fresh.setenv(compiled_linear.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="TEDEBUG_INSPECTED_LINEAR='fast': expected one of auto, compiled, python"):
        compiled_linear.linear_function()


def test_a_build_that_fails(fresh, tmp_path):
    """Asked for ("compiled"): an error that says why and how to take the Python path.  In "auto": one warning,
    then the Python path."""
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'cannot compile' >&2\nexit 3\n")
    broken.chmod(0o755)
    fresh.setenv("CXX", str(broken))
    fresh.setenv("TEDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    fresh.setenv(compiled_linear.ENV_VAR, "compiled")
    with pytest.warns(RuntimeWarning, match="could not be built"):
        with pytest.raises(compiled_linear.InspectedLinearBuildError, match="cannot compile.*=python"):
            compiled_linear.linear_function()
    assert "exit status 3" in compiled_linear.unavailable_reason()
    fresh.setenv(compiled_linear.ENV_VAR, "auto")
    assert compiled_linear.linear_function() is None  # (the build's outcome is kept: no second warning)
    assert host_kernels.cxx_compiler() == str(broken)


SHORT_RUN = """
import torch, tedebug
from tedebug import debug_api
from tedebug.nn import compiled_linear
model = tedebug.convert_model(torch.nn.Sequential(torch.nn.Linear(8, 8)))
features = {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 1}}
config = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"}, "transformer_engine": features}}
debug_api.initialize(config_file=config, log_dir=LOG_DIR)
model(torch.randn(2, 8)).sum().backward()
debug_api.step()
debug_api.end_debug()
print("building at the end:", compiled_linear._builder.is_alive())
"""


def _slow_compiler(tmp_path, built):
    """A stand-in C++ compiler that takes a second and writes the module `built` (this session's build)."""
    slow = tmp_path / "slow-c++"
    script = '#!/bin/sh\nsleep 1\nwhile [ "$#" -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
    slow.write_text(script + f'cp "{built.__file__}" "$out"\n')
    slow.chmod(0o755)
    return slow


def test_a_run_that_ends_during_the_background_build_waits_for_it(built, tmp_path):
    """The next run then finds the build in the cache (a daemon thread would leave the compiler running on and the
    file unfinished)."""
    slow = _slow_compiler(tmp_path, built)
    cache = tmp_path / "cache"
    env = dict(os.environ, CXX=str(slow), TEDEBUG_CACHE_DIR=str(cache), TEDEBUG_INSPECTED_LINEAR="auto")
    script = f"LOG_DIR = {str(tmp_path / 'logs')!r}\n" + SHORT_RUN
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "building at the end: True" in done.stdout
    assert [p.name.startswith("inspected_linear-") for p in cache.iterdir()] == [True]  # whole, no temporary left


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def _wait_for_the_build_lock(cache: pathlib.Path) -> None:
    """Wait until a builder holds the lock file of a build in `cache` (an exclusive flock)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for lock in cache.glob(".inspected_linear-*.lock") if cache.is_dir() else ():
            try:
                probe = os.open(lock, os.O_RDONLY)
            except FileNotFoundError:  # the build is over
                continue
            try:
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # held
            finally:
                os.close(probe)  # (releases the probe's lock, if it got one)
        time.sleep(0.01)
    raise AssertionError(f"no build took its lock file in {cache}")


@pytest.mark.skipif(not hasattr(os, "fork") or fcntl is None, reason="needs os.fork and fcntl")
def test_a_process_forked_during_the_background_build_can_build(built, fresh, tmp_path):
    """The parent's build thread holds the build's locks while it runs: the in-process lock and the lock file's
    flock.  A child forked then gets new in-process locks, and does not keep the flock of the lock file the fork
    copied; it waits for the parent's build and loads it (without them it would wait forever, or until the lock's
    time-out of minutes: the alarm ends it).  Forked right after the lock is taken, the child often comes while the
    parent starts the compiler: a fork waits for that (`host_kernels._FORK_GUARD`), else the child keeps the
    compiler's pipes open and the parent's build waits for it (on the 2-core VM under load, 2 of 6 runs failed
    without the guard)."""
    slow = _slow_compiler(tmp_path, built)
    fresh.setenv("CXX", str(slow))
    fresh.setenv("TEDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    fresh.delenv(compiled_linear.ENV_VAR, raising=False)
    assert compiled_linear.linear_function() is None  # the background build starts
    _wait_for_the_build_lock(tmp_path / "cache")
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if it built the module
        status = 1
        try:
            signal.alarm(30)
            status = 0 if compiled_linear.wait_for_build() is not None else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert compiled_linear.wait_for_build() is not None
