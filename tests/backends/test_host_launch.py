"""The compiled kernel launches (kernels/host_launch.c, `tedebug.backends.host_launch`) on the CPU.

Ctypes callbacks stand in for ``cuLaunchKernel`` and ``cuLaunchCooperativeKernel`` and record what they are given.
The oracle is the Python path: its parameter block (`launch._ArgBlock`, a `struct` per signature) and, for the
statistics group launch, `cupy_stats`' own launch of the same items.  The GPU test (test_gpu_host_launch.py)
launches the statistics kernel both ways and compares the rows; the whole GPU suite runs through these launches.

- the statistics group launch: its blocks are `cupy_stats.group_grids`' for any numels, a group whose arithmetic
  would not fit in 64 bits is handed back rather than wrapped; the launch has the Python path's grid, block,
  stream, function and parameter bytes, for two and three tensors of each kernel dtype, with lone grids and with
  shares of a wave; every call it does not take launches nothing and answers -1 with no exception pending; the
  driver's error code comes back as it is;
- `cupy_stats.basic_stats_group_scratch_into` takes the Python path for a device and dtype first (which leaves the
  compiled launch's constants), then the compiled one, with the same bytes; an answer other than 0 sends it to the
  Python path;
- any launch: every argument type's slot is the one `struct` packs (pointers, int64, uint64, int32, uint32, float32
  with infinities, signed zero and subnormals, float64), from typed arguments and from plain numbers with a
  signature; a cooperative launch calls the cooperative entry point (handed back where there is none); a type the
  Python path refuses, a value out of its type's range, too many arguments, another device or no blocks are
  handed back; `launch_on` and `launch_signed` launch from C and take the Python path after a driver error;
- ``TEDEBUG_LAUNCH=ctypes`` (or ``cupy``) turns the compiled launches off, and turning them on tells the module the
  driver's entry points; a machine without ``Python.h`` has none and no warning; a compiler that fails warns once.
"""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
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


@pytest.fixture(autouse=True)
def real_entry_points_afterwards():
    """A test may tell the compiled module stand-in entry points (`configure`); afterwards the next
    `compiled_launches` tells it the real ones again."""
    yield
    launch._compiled_of = (object(), None)


def constants(recorder, vec, current=CPU, stream_of=lambda index: STREAM):
    """The statistics group launch's table entry, with the module told `recorder` as ``cuLaunchKernel``, device
    `current` as torch's current one and `stream_of` as torch's raw-current-stream call."""
    COMPILED.configure(recorder.address, 0, lambda: current, stream_of, launch._KIND_TYPES)
    return (FUNCTION, THREADS, vec, MAX_GRID)


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
    _calls_not_taken([(x, 1), (w, 2)], {(CPU, torch.float32): constants(recorder, 4, stream_of=None)})  # no call
    table = {(CPU, torch.float32): constants(recorder, 4)}
    _calls_not_taken([(x, 1), (w, 2)], {key: entry + (None,) for key, entry in table.items()})  # an old entry
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
    COMPILED.configure(recorder.address, 0, lambda: CPU, lambda index: STREAM, launch._KIND_TYPES)
    monkeypatch.setattr(cupy_stats, "compiled_target", lambda kernel, index: FUNCTION)
    items = [(torch.randn(64, 32), 4096), (torch.randn(16, 32), 8192), (torch.randn(64, 16), 12288)]
    cupy_stats.basic_stats_group_scratch_into(items)
    assert len(python_path) == 1 and recorder.calls == []
    assert cupy_stats._COMPILED_GROUPS[(CPU, torch.float32)] == (FUNCTION, THREADS, 4, MAX_GRID)
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
    recorder = LaunchRecorder()
    monkeypatch.setattr(launch, "_driver", lambda: (recorder._callback, None))  # as if libcuda loaded
    monkeypatch.setattr(launch, "_cooperative_driver", lambda: None)
    configured = []

    class Compiled:
        @staticmethod
        def configure(*args):
            configured.append(args)

    monkeypatch.setattr(host_launch, "load", lambda: Compiled)
    for value, expected in ((None, Compiled), ("driver", Compiled), ("ctypes", None)):
        if value is None:
            monkeypatch.delenv(launch.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(launch.ENV_VAR, value)
        assert launch.compiled_launches() is expected
        assert launch.launch_mode() == "driver"
    # told the driver's entry point (no cooperative one here), torch's current-device and raw-stream calls and the
    # argument types
    assert configured[0] == (recorder.address, 0, launch._current_device, launch._RAW_STREAM, launch._KIND_TYPES)
    monkeypatch.setenv(launch.ENV_VAR, "cupy")
    assert launch.compiled_launches() is None and launch.launch_mode() == "cupy"


def test_no_target_without_torchs_private_call(monkeypatch):
    monkeypatch.setattr(launch, "_RAW_STREAM", None)
    assert launch.compiled_target(object(), 0) is None


@needs_compiled
def test_configure_checks_its_calls():
    for current, stream_of in ((5, None), (lambda: 0, 5)):
        with pytest.raises(TypeError, match="raw_stream or None"):
            COMPILED.configure(1, 0, current, stream_of, launch._KIND_TYPES)


# ------------------------------------------------------------------------------------------------ building
def test_without_python_h_there_is_no_compiled_launch_and_no_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(host_launch._BUILD, "outcome", None)
    monkeypatch.setattr(host_launch, "python_include", lambda: None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_launch.load() is None
    assert "Python.h" in host_launch.unavailable_reason()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(host_kernels.compiler() is None or host_launch.python_include() is None, reason="nothing to build")
def test_a_failing_compiler_warns_once(monkeypatch, tmp_path):
    monkeypatch.setattr(host_launch._BUILD, "outcome", None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.warns(RuntimeWarning, match="compiled kernel launches .* could not be built .*TEDEBUG_LAUNCH=ctypes"):
        assert host_launch.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_launch.load() is None  # (said once)
    assert "false" in host_launch.unavailable_reason()


@needs_compiled
def test_built_once_per_interpreter_then_loaded_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(host_launch._BUILD, "outcome", None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path))
    module = host_launch.load()
    assert module is not None and module.__name__ == host_launch.MODULE_NAME
    (built,) = tmp_path.iterdir()
    assert built.name.startswith("host_launch-") and built.suffix == ".so"
    assert module.grids_of([10, 20], 4, THREADS, MAX_GRID) == (1, 1)


# ------------------------------------------------------------------------------------------------ any launch
_COOPERATIVE_KERNEL = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
)


class AnyLaunchRecorder:
    """Stand-ins for ``cuLaunchKernel`` and ``cuLaunchCooperativeKernel`` reading `count` parameter slots: each call
    as (which, function, grid, block, shared memory, stream, parameter bytes)."""

    def __init__(self, count: int, code: int = 0) -> None:
        self.calls: list = []
        self.count, self.code = count, code

        def plain(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            return self._record("plain", function, (gx, gy, gz), (bx, by, bz), shared, stream, params)

        def cooperative(function, gx, gy, gz, bx, by, bz, shared, stream, params):
            return self._record("cooperative", function, (gx, gy, gz), (bx, by, bz), shared, stream, params)

        self._plain, self._cooperative = _LAUNCH_KERNEL(plain), _COOPERATIVE_KERNEL(cooperative)
        self.address = ctypes.cast(self._plain, ctypes.c_void_p).value
        self.cooperative_address = ctypes.cast(self._cooperative, ctypes.c_void_p).value

    def _record(self, which, function, grid, block, shared, stream, params):
        parameter_bytes = b"".join(ctypes.string_at(params[i], 8) for i in range(self.count))
        self.calls.append((which, function, grid, block, shared, stream, parameter_bytes))
        return self.code


@pytest.fixture
def configured(monkeypatch):
    """Tell the compiled module stand-in entry points (device 0 current)."""

    def configure(count, code=0, cooperative=True):
        recorder = AnyLaunchRecorder(count, code)
        address = recorder.cooperative_address if cooperative else 0
        COMPILED.configure(recorder.address, address, lambda: 0, None, launch._KIND_TYPES)
        return recorder

    return configure


TYPED_ARGS = (
    2**64 - 1,
    0,
    np.int64(-5),
    np.uint64(2**64 - 1),
    np.int32(-7),
    np.uint32(4_000_000_000),
    np.float32(0.1),
    np.float32(float("inf")),
    np.float32(-0.0),
    np.float32(1e-45),
    np.float64(-2.5),
    np.float64(float("inf")),
)


@needs_compiled
def test_any_launch_packs_the_python_paths_parameter_block(configured):
    recorder = configured(len(TYPED_ARGS))
    assert COMPILED.launch(FUNCTION, 0, 7, 128, 96, STREAM, TYPED_ARGS, None, False) == 0
    python_bytes = bytes(launch._arg_block(TYPED_ARGS, "k").slots)
    assert recorder.calls == [("plain", FUNCTION, (7, 1, 1), (128, 1, 1), 96, STREAM, python_bytes)]


@needs_compiled
def test_a_signed_launch_packs_plain_numbers_as_its_signature_says(configured):
    signature = (int, np.int64, np.uint32, np.int32, np.float32, np.float32, np.float64)
    values = (12345, -(2**40), 2**32 - 1, -(2**31), 0.1, 3.4028235e38, 1.0 / 3.0)
    recorder = configured(len(values))
    assert COMPILED.launch(FUNCTION, 0, 1, 256, 0, STREAM, values, signature, False) == 0
    python_bytes = bytes(launch._packed_block(signature, values, "k").slots)
    assert recorder.calls[0][6] == python_bytes


@needs_compiled
def test_a_cooperative_launch_calls_the_cooperative_entry_point(configured):
    args = (5, np.int64(9))
    recorder = configured(len(args))
    assert COMPILED.launch(FUNCTION, 0, 33, 256, 0, STREAM, args, None, True) == 0
    assert recorder.calls == [
        ("cooperative", FUNCTION, (33, 1, 1), (256, 1, 1), 0, STREAM, bytes(launch._arg_block(args, "k").slots))
    ]
    configured(len(args), cooperative=False)  # no cooperative entry point: handed back
    assert COMPILED.launch(FUNCTION, 0, 33, 256, 0, STREAM, args, None, True) == -1


@needs_compiled
def test_any_launch_hands_back_what_the_python_path_must_judge(configured):
    recorder = configured(1)
    handed_back = [
        ((np.int16(1),), None),  # a type with no C type here (the Python path raises its TypeError)
        ((1.5,), None),  # a Python float: no fixed C type either
        ((2**31,), (np.int32,)),  # out of int32
        ((-1,), (np.uint32,)),  # out of uint32
        ((-1,), (int,)),  # a negative pointer
        ((1e40,), (np.float32,)),  # past float32 (struct raises OverflowError)
        ((1, 2), (int,)),  # a signature of another length
        (tuple(range(65)), None),  # more arguments than the parameter block holds
    ]
    for args, signature in handed_back:
        assert COMPILED.launch(FUNCTION, 0, 1, 32, 0, STREAM, args, signature, False) == -1, (args, signature)
        assert not ctypes.pythonapi.PyErr_Occurred()
    assert COMPILED.launch(FUNCTION, 1, 1, 32, 0, STREAM, (1,), None, False) == -1  # device 1 is not current
    assert COMPILED.launch(FUNCTION, 0, 0, 32, 0, STREAM, (1,), None, False) == -1  # no blocks
    assert recorder.calls == []
    failing = configured(1, code=700)
    assert COMPILED.launch(FUNCTION, 0, 1, 32, 0, STREAM, (1,), None, False) == 700 and len(failing.calls) == 1


@needs_compiled
@pytest.mark.parametrize("answer", [0, 201])
def test_launch_on_goes_through_the_compiled_launch_first(configured, monkeypatch, answer):
    recorder = configured(2, code=answer)
    monkeypatch.setattr(launch, "compiled_launches", lambda: COMPILED)
    monkeypatch.setattr(launch, "launch_mode", lambda: "driver")
    python_path = []
    monkeypatch.setattr(launch, "_launch_driver", lambda kernel, index, grid, block, *rest: python_path.append(grid))

    class Kernel:
        name = "ted_k"

        def handle(self, index):
            return FUNCTION

    launch.launch_on(Kernel(), 0, STREAM, 3, 64, (7, np.int32(2)))
    launch.launch_signed(Kernel(), 0, STREAM, 4, 64, (int, np.int32), (7, 2))
    assert [call[2] for call in recorder.calls] == [(3, 1, 1), (4, 1, 1)]
    assert python_path == ([] if answer == 0 else [3, 4])  # a driver error: the Python path launches again
