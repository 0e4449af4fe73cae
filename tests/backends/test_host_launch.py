"""The compiled statistics group launch (kernels/host_launch.c, `tedebug.backends.host_launch`) on the CPU.

A ctypes callback stands in for ``cuLaunchKernel`` and records what it is given.  The oracle is the Python path:
`cupy_stats`' launch of the same items, its arguments packed by `launch`'s parameter block (a `struct` per
signature).  The GPU test (test_gpu_host_launch.py) launches the kernel both ways and compares the rows.

- the blocks are `cupy_stats.group_grids`' for any numels, and a group whose arithmetic would not fit in 64 bits is
  handed back rather than wrapped;
- the launch has the Python path's grid, block, stream, function and parameter bytes, for two and three tensors of
  each kernel dtype, with lone grids and with shares of a wave;
- every call it does not take launches nothing and answers -1 with no exception left pending; the driver's error
  code comes back as it is;
- `cupy_stats.basic_stats_group_scratch_into` takes the Python path for a device and dtype first (which leaves the
  compiled launch's constants), then the compiled one, with the same bytes; an answer other than 0 sends it to the
  Python path;
- ``TEDEBUG_LAUNCH=ctypes`` (or ``cupy``) turns the compiled launches off; a machine without ``Python.h`` has none
  and no warning; a compiler that fails warns once.
"""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch

from tedebug.backends import cupy_stats, host_kernels, host_launch, launch
from tedebug.backends.cupy_runtime import THREADS

COMPILED = host_launch.load()
needs_compiled = pytest.mark.skipif(
    COMPILED is None, reason=f"the compiled launch cannot be built here: {host_launch.unavailable_reason()}"
)

SMS = 7
MAX_GRID = cupy_stats.STATS_BLOCKS_PER_SM * SMS  # 21
STREAM = 4242
FUNCTION = 0xF00D
#: the CPU tensors' device index (`get_device`)
CPU = -1

_LAUNCH_KERNEL = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_uint] * 7,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)
SLOTS = len(cupy_stats._GROUP_SCRATCH_SIGNATURE)


class LaunchRecorder:
    """A stand-in ``cuLaunchKernel``: records (function, grid, block, shared memory, stream, parameter bytes, extra)
    of each call and answers `code`."""

    def __init__(self, code: int = 0) -> None:
        self.calls: list = []
        self.code = code
        self._callback = _LAUNCH_KERNEL(self._launch)
        self.address = ctypes.cast(self._callback, ctypes.c_void_p).value

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        parameter_bytes = b"".join(ctypes.string_at(params[i], 8) for i in range(SLOTS))
        self.calls.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, parameter_bytes, extra))
        return self.code


def constants(recorder, vec, current=CPU, stream_of=lambda index: STREAM):
    return (recorder.address, FUNCTION, THREADS, vec, MAX_GRID, lambda: current, stream_of)


@pytest.fixture
def python_path(monkeypatch):
    """The Python path's launches on the CPU: (grid, block, stream, parameter bytes) of each; stand-in kernels, one
    SM count, the compiled launches off."""
    calls = []
    monkeypatch.setattr(cupy_stats, "get_kernel", lambda source, name, options: name)
    monkeypatch.setattr(cupy_stats, "sm_count", lambda index: SMS)
    monkeypatch.setattr(cupy_stats, "raw_stream", lambda index: STREAM)
    monkeypatch.setattr(cupy_stats, "_STATS_LAUNCH", {})
    monkeypatch.setattr(cupy_stats, "_GROUP_LAUNCH", {})
    monkeypatch.setattr(cupy_stats, "_COMPILED_GROUPS", {})
    monkeypatch.setattr(cupy_stats, "compiled_launches", lambda: None)

    def signed(kernel, index, stream, grid, block, signature, values):
        block_params = launch._packed_block(signature, values, kernel)
        calls.append((grid, block, stream, bytes(block_params.slots)))

    monkeypatch.setattr(cupy_stats, "launch_signed", signed)
    return calls


def expected_launch(python_path, items):
    python_path.clear()
    cupy_stats._group_launch_of(items, True)
    ((grid, block, stream, parameter_bytes),) = python_path
    return (FUNCTION, (grid, 1, 1), (block, 1, 1), 0, stream, parameter_bytes, None)


# ------------------------------------------------------------------------------------------------ the blocks
@needs_compiled
def test_the_blocks_are_group_grids():
    cases = [
        ([10 * 8 * 256, 10 * 8 * 256 - 5], 8, MAX_GRID),
        ([1, 3], 8, MAX_GRID),
        ([19 * 2048 + 8, 2048], 8, MAX_GRID),  # lone grids 20 + 1: exactly a wave, kept (shares would give 19)
        ([1000 * 2048, 500 * 2048, 4000 * 2048], 8, MAX_GRID),
        ([16, 10**7, 10**7], 8, MAX_GRID),
        ([2**40, 3, 2**39 + 1], 4, 396),
        ([7], 4, 396),
    ]
    generator = torch.Generator().manual_seed(3)
    for _ in range(3000):
        count = int(torch.randint(2, 4, (1,), generator=generator))
        scale = int(torch.randint(1, 45, (1,), generator=generator))
        numels = [int(torch.randint(1, 2**scale + 1, (1,), generator=generator)) for _ in range(count)]
        cases.append((numels, (4, 8)[scale % 2], (21, 396, 1056)[scale % 3]))
    for numels, vec, max_grid in cases:
        assert COMPILED.grids_of(numels, vec, THREADS, max_grid) == cupy_stats.group_grids(numels, vec, max_grid)


@needs_compiled
def test_arithmetic_past_64_bits_is_handed_back():
    assert COMPILED.grids_of([2**62, 2**62, 2**62], 8, THREADS, MAX_GRID) is None  # the total
    assert COMPILED.grids_of([2**60, 2**60], 8, THREADS, MAX_GRID) is None  # max_grid * n
    assert COMPILED.grids_of([2**58, 2**58], 8, THREADS, MAX_GRID) == cupy_stats.group_grids([2**58] * 2, 8, MAX_GRID)


# ------------------------------------------------------------------------------------------------ the launch
@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_launch_is_the_python_paths(python_path, dtype):
    vec = 16 // torch.empty(0, dtype=dtype).element_size()
    shapes = [
        [(64, 32), (16, 32), (64, 16)],  # lone grids that fit in one wave
        [(8 * 2048,), (5 * 2048,)],  # two tensors: the third slot zero
        [(8 * 4096,), (12 * 4096,), (3,)],  # more than a wave: shares, a tiny tensor keeps one block
    ]
    for group in shapes:
        tensors = [torch.randn(shape).to(dtype) for shape in group]
        items = [(t, 0x10000 + 4096 * i) for i, t in enumerate(tensors)]
        recorder = LaunchRecorder()
        table = {(CPU, dtype): constants(recorder, vec)}
        assert COMPILED.stats_group_scratch(table, items) == 0
        assert recorder.calls == [expected_launch(python_path, items)]
        assert COMPILED.stats_group_scratch(table, tuple(items)) == 0  # (a tuple of items is taken alike)
        assert recorder.calls[1] == recorder.calls[0]


def _calls_not_taken(items, table):
    """Assert the compiled launch hands `items` back: -1, nothing launched, no exception pending."""
    assert COMPILED.stats_group_scratch(table, items) == -1
    assert not ctypes.pythonapi.PyErr_Occurred()  # (NULL)


@needs_compiled
def test_calls_it_does_not_take_launch_nothing():
    recorder = LaunchRecorder()
    table = {(CPU, torch.float32): constants(recorder, 4)}
    x, w, y = torch.zeros(64, 32), torch.zeros(16, 32), torch.zeros(64, 16)
    misaligned = torch.zeros(65)[1:]  # 4 bytes past a 16-byte boundary
    not_taken = [
        [(x, 1)],  # one tensor: the lone launch's kernel
        [(x, 1), (w, 2), (y, 3), (x, 4)],  # more than three
        [(x, 1), (w.to(torch.bfloat16), 2)],  # two dtypes
        [(x, 1), (w.t(), 2)],  # strided
        [(x, 1), (misaligned, 2)],  # misaligned
        [(x, 1), (torch.zeros(0), 2)],  # empty
        [(x, 1), (w, 2.5)],  # an address that is not an int
        [(x, 1), [w, 2]],  # an entry that is not a pair
        [(x, 1), ("w", 2)],  # not a tensor
    ]
    for items in not_taken:
        _calls_not_taken(items, table)
    _calls_not_taken([(x.double(), 1), (w.double(), 2)], table)  # no constants for this dtype yet
    _calls_not_taken([(x, 1), (w, 2)], {(CPU, torch.float32): constants(recorder, 4, current=0)})  # another device

    def no_stream(index):
        raise RuntimeError("no stream")

    _calls_not_taken([(x, 1), (w, 2)], {(CPU, torch.float32): constants(recorder, 4, stream_of=no_stream)})
    assert recorder.calls == []
    with pytest.raises(TypeError, match="table: dict"):
        COMPILED.stats_group_scratch([], [(x, 1), (w, 2)])


@needs_compiled
def test_the_drivers_error_comes_back():
    recorder = LaunchRecorder(code=201)  # CUDA_ERROR_INVALID_CONTEXT
    table = {(CPU, torch.float32): constants(recorder, 4)}
    assert COMPILED.stats_group_scratch(table, [(torch.zeros(8), 1), (torch.zeros(8), 2)]) == 201
    assert len(recorder.calls) == 1


# ------------------------------------------------------------------------------------------------ the wiring
@needs_compiled
def test_the_first_launch_takes_the_python_path_then_the_compiled_one(python_path, monkeypatch):
    recorder = LaunchRecorder()
    monkeypatch.setattr(cupy_stats, "compiled_launches", lambda: COMPILED)
    monkeypatch.setattr(
        cupy_stats,
        "compiled_target",
        lambda kernel, index: (recorder.address, FUNCTION, lambda: CPU, lambda i: STREAM),
    )
    items = [(torch.randn(64, 32), 4096), (torch.randn(16, 32), 8192), (torch.randn(64, 16), 12288)]
    cupy_stats.basic_stats_group_scratch_into(items)
    assert len(python_path) == 1 and recorder.calls == []
    assert cupy_stats._COMPILED_GROUPS[(CPU, torch.float32)][2:5] == (THREADS, 4, MAX_GRID)
    cupy_stats.basic_stats_group_scratch_into(items)
    assert len(python_path) == 1
    python_grid, python_block, python_stream, python_bytes = python_path[0]
    assert recorder.calls == [
        (FUNCTION, (python_grid, 1, 1), (python_block, 1, 1), 0, python_stream, python_bytes, None)
    ]


def test_an_answer_other_than_0_takes_the_python_path(python_path, monkeypatch):
    answers = []

    class Compiled:
        @staticmethod
        def stats_group_scratch(table, items):
            answers.append(len(items))
            return answer

    monkeypatch.setattr(cupy_stats, "compiled_launches", lambda: Compiled)
    monkeypatch.setattr(cupy_stats, "compiled_target", lambda kernel, index: None)  # (no driver to aim at here)
    items = [(torch.randn(8), 16), (torch.randn(8), 32)]
    for answer, python_launches in ((0, 0), (-1, 1), (700, 1)):
        python_path.clear()
        cupy_stats.basic_stats_group_scratch_into(items)
        assert len(python_path) == python_launches
    assert answers == [2, 2, 2]


def test_the_environment_turns_the_compiled_launches_off(monkeypatch):
    monkeypatch.setattr(launch, "_driver", lambda: (object(), object()))  # as if libcuda loaded
    monkeypatch.setattr(host_launch, "load", lambda: "the compiled launches")
    for value, expected in ((None, "the compiled launches"), ("driver", "the compiled launches"), ("ctypes", None)):
        if value is None:
            monkeypatch.delenv(launch.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(launch.ENV_VAR, value)
        assert launch.compiled_launches() == expected
        assert launch.launch_mode() == "driver"
    monkeypatch.setenv(launch.ENV_VAR, "cupy")
    assert launch.compiled_launches() is None and launch.launch_mode() == "cupy"


def test_no_target_without_torchs_private_calls(monkeypatch):
    monkeypatch.setattr(launch, "_driver", lambda: (object(), object()))
    monkeypatch.setattr(launch, "_RAW_STREAM", None)
    assert launch.compiled_target(object(), 0) is None


# ------------------------------------------------------------------------------------------------ building
def test_without_python_h_there_is_no_compiled_launch_and_no_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(host_launch, "_BUILT", None)
    monkeypatch.setattr(host_launch, "python_include", lambda: None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_launch.load() is None
    assert "Python.h" in host_launch.unavailable_reason()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(host_kernels.compiler() is None or host_launch.python_include() is None, reason="nothing to build")
def test_a_failing_compiler_warns_once(monkeypatch, tmp_path):
    monkeypatch.setattr(host_launch, "_BUILT", None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.warns(RuntimeWarning, match="compiled statistics launch .* could not be built .*TEDEBUG_LAUNCH=ctypes"):
        assert host_launch.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_launch.load() is None  # (said once)
    assert "false" in host_launch.unavailable_reason()


@needs_compiled
def test_built_once_per_interpreter_then_loaded_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(host_launch, "_BUILT", None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path))
    module = host_launch.load()
    assert module is not None and module.__name__ == host_launch.MODULE_NAME
    (built,) = tmp_path.iterdir()
    assert built.name.startswith("host_launch-") and built.suffix == ".so"
    assert module.grids_of([10, 20], 4, THREADS, MAX_GRID) == (1, 1)
