"""A converted model under torch.compile on CPU: Dynamo traces tedebug's layers, and the CPU paths that use numpy
outside tracing (`tedebug.host_numpy`) take the torch path inside it - the same values as eager, bit for bit.  In a
debug session each GEMM call runs untraced (a graph break), and logs what eager logs; so does a quantized GEMM
call's debug backward under compiled autograd.
(backend="eager": Dynamo's tracing without Inductor's code generation, which this does not test and CI could not
afford.)"""

import contextlib

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.nn import Linear
from tedebug.nn import base as nn_base
from tedebug.recipe import Float8CurrentScaling, NVFP4BlockScaling

from support.compile import compiled_backward
from support.features import RecordingSink, debug_session, section

pytestmark = pytest.mark.filterwarnings("ignore")


def _model():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    return tedebug.convert_model(plain)


def _step(model, x, recipe):
    with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), grads


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(), NVFP4BlockScaling()], ids=["hp", "fp8", "nvfp4"])
def test_compiled_converted_model_equals_eager(recipe):
    """Two identical models, one compiled; each step from the same global seed (NVFP4 draws its quantizers'
    stochastic-rounding keys from it, and their Philox offsets advance per quantization)."""
    torch._dynamo.reset()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    eager, compiled = _model(), torch.compile(_model(), backend="eager")
    torch.manual_seed(2)
    eager_y, eager_grads = _step(eager, x, recipe)
    torch.manual_seed(2)
    y, grads = _step(compiled, x, recipe)
    assert torch.equal(y, eager_y)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


def test_a_converted_model_compiles_into_one_graph_without_a_session():
    """High precision without a session: no graph break.  Before, each GEMM call after the first asked autograd
    whether it ran a checkpoint's recompute (`torch._C._current_graph_task_id`, which Dynamo cannot trace): a graph
    break per GEMM call, then a compiled frame of `linear_gemm` per weight shape up to the recompile limit (a tiny
    Llama: 28 breaks and 74 frames over three steps, now 0 and 2)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_model(), backend="eager")
    for step in range(3):
        compiled(torch.randn(8, 32, generator=torch.Generator().manual_seed(step))).sum().backward()
    assert sum(counters["graph_break"].values()) == 0 and counters["frames"]["ok"] > 0


def test_numpy_host_paths_step_aside_while_tracing():
    from tedebug import host_numpy

    seen = []

    def probe(x):
        seen.append((host_numpy.compiling(), host_numpy.numpy_on(x.device)))
        return x + 1

    assert host_numpy.numpy_on(torch.device("cpu")) and not host_numpy.compiling()
    torch._dynamo.reset()
    torch.compile(probe, backend="eager")(torch.zeros(2))
    assert seen == [(True, False)]


STATS = ["max", "std", "l1_norm"]
TENSORS = ["activation", "weight", "output", "gradient", "wgrad", "dgrad"]


def _logged_rows(tmp_path, compile_it: bool, recipe, steps: int = 3):
    """The rows a debug session logs over a few training steps of `_model`, compiled or eager."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = torch.compile(model, backend="eager") if compile_it else model
    config = section({"LogTensorStats": {"enabled": True, "stats": STATS, "tensors": TENSORS, "freq": 1}})
    sink = RecordingSink()
    g = torch.Generator().manual_seed(1)
    with debug_session(config, tmp_path / str(compile_it), sink=sink, default_logging_enabled=True):
        for _ in range(steps):
            with tedebug.autocast(enabled=recipe is not None, recipe=recipe):
                y = run(torch.randn(8, 32, generator=g))
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()
            debug_api.step()
    return sink.rows


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["hp", "fp8"])
def test_a_debug_session_under_compile_logs_what_eager_logs_without_being_traced(tmp_path, monkeypatch, recipe):
    """While torch.compile traces, a GEMM call of a debug session runs untraced (a graph break per call), so the
    tracer never follows the debug gate, the features or the statistics engine (before, it did, and compiled them
    again for each layer and iteration until its recompile limit).  The rows are eager's."""
    from tedebug.nn.debug_gate import LayerDebugState

    traced = []
    real = LayerDebugState.debug_quantizers

    def recording(self, *args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LayerDebugState, "debug_quantizers", recording)
    torch._dynamo.reset()
    try:
        compiled = _logged_rows(tmp_path, True, recipe)
    finally:
        torch._dynamo.reset()
    assert traced and not any(traced)
    eager = _logged_rows(tmp_path, False, recipe)
    assert compiled == eager and {"0_wgrad_max", "2_dgrad_l1_norm"} <= {name for name, _, _ in eager}


def test_compiled_autograd_runs_a_quantized_debug_backward_untraced(tmp_path, monkeypatch):
    """A GEMM call that quantizes (FP8 current scaling with LogFp8TensorStats: the generic path, `_LinearFunction`)
    has its debug backward run untraced under compiled autograd (a graph break), not followed by Dynamo through the
    quantizers and the statistics engine (before, it was, and compiled again per layer until its recompile limit);
    it logs what the backward logs without compiled autograd."""
    traced = []
    real = nn_base._LinearFunction._backward

    def recording(ctx, grad_out):
        traced.append(torch.compiler.is_compiling())
        return real(ctx, grad_out)

    monkeypatch.setattr(nn_base._LinearFunction, "_backward", staticmethod(recording))
    config = section(
        {"LogFp8TensorStats": {"enabled": True, "stats": ["underflows%", "mse"], "tensors": ["gradient"], "freq": 1}}
    )

    def rows(compiled_autograd: bool):
        torch.manual_seed(0)
        layer = Linear(32, 16, name="fc")
        sink = RecordingSink()
        with debug_session(config, tmp_path / str(compiled_autograd), sink=sink):
            for step in range(2):
                with tedebug.autocast(enabled=True, recipe=Float8CurrentScaling()):
                    loss = layer(torch.randn(4, 32, generator=torch.Generator().manual_seed(step))).sum()
                with compiled_backward() if compiled_autograd else contextlib.nullcontext():
                    loss.backward()
                debug_api.step()
        return sink.rows

    compiled = rows(True)
    assert traced and not any(traced)
    assert compiled == rows(False) and {"fc_gradient_mse"} <= {name for name, _, _ in compiled}
