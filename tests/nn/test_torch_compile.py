"""A converted model under torch.compile on CPU: Dynamo traces tedebug's layers, and the CPU paths that use numpy
outside tracing (`tedebug.host_numpy`) take the torch path inside it - the same values as eager, bit for bit.
(backend="eager": Dynamo's tracing without Inductor's code generation, which this does not test and CI could not
afford.)"""

import pytest
import torch

import tedebug
from tedebug.recipe import Float8CurrentScaling, NVFP4BlockScaling

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
