"""The compiled statistics group launch (kernels/host_launch.c) on the GPU: a group launched by it writes the rows the
ctypes path's launch writes (``TEDEBUG_LAUNCH=ctypes``: the oracle), bit for bit, for every kernel dtype, in groups
that fit in a wave and that share it; after a device and dtype's first launch the compiled one takes the calls (the
Python path's launches are counted); and a launch from another thread (autograd's backward launches from its own)
writes the same rows.  Every test needs CUDA and CuPy, and a C compiler with the interpreter's headers."""

import threading

import pytest
import torch

from tedebug.backends import cupy_stats, host_launch, launch

from support.kernel_inputs import bits, sprinkled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(host_launch.load() is None, reason="the compiled launch cannot be built here"),
]

DEV = torch.device("cuda")
ROW = len(cupy_stats.BASIC_ROW_KEYS)


@pytest.fixture
def python_launches(monkeypatch):
    """The statistics group launches the Python path made (it still makes them)."""
    calls = []
    python_launch = cupy_stats.launch_signed

    def counted(*args):
        calls.append(args[0].name)
        python_launch(*args)

    monkeypatch.setattr(cupy_stats, "launch_signed", counted)
    return calls


def _rows(xs):
    """The rows `basic_stats_group_scratch_into` and `finish_rows` write for `xs`."""
    scratch_bytes = cupy_stats.row_scratch_bytes(DEV)
    area = torch.zeros((len(xs), scratch_bytes), dtype=torch.uint8, device=DEV)
    rows = torch.full((len(xs), ROW), float("nan"), dtype=torch.float64, device=DEV)
    cupy_stats.basic_stats_group_scratch_into([(x, area[i].data_ptr()) for i, x in enumerate(xs)])
    cupy_stats.finish_rows(DEV, area.data_ptr(), scratch_bytes, rows.data_ptr(), ROW, len(xs))
    return rows


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_the_compiled_launch_writes_the_ctypes_paths_rows(dtype, python_launches, monkeypatch):
    groups = [(1000, 37, 5000), (3, 1 << 20), (1 << 22, 1 << 21, 1 << 23), (1 << 23, 17)]
    for numels in groups:
        xs = [sprinkled(n, dtype, i + sum(numels), DEV) for i, n in enumerate(numels)]
        monkeypatch.setenv(launch.ENV_VAR, "ctypes")
        expected = _rows(xs)
        monkeypatch.delenv(launch.ENV_VAR)
        first = _rows(xs)  # (the first launch of a device and dtype takes the Python path and leaves the constants)
        python_launches.clear()
        again = _rows(xs)
        assert python_launches == [], numels
        assert torch.equal(bits(first), bits(expected)) and torch.equal(bits(again), bits(expected)), numels
    assert (torch.cuda.current_device(), dtype) in cupy_stats._COMPILED_GROUPS


def test_a_launch_from_another_thread_writes_the_same_rows():
    xs = [sprinkled(n, torch.bfloat16, n, DEV) for n in (4097, 1 << 20, 333)]
    expected = _rows(xs)  # (on this thread: the compiled launch's constants are left)
    torch.cuda.synchronize()
    got = []
    thread = threading.Thread(target=lambda: got.append(_rows(xs)))
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert torch.equal(bits(got[0]), bits(expected))
