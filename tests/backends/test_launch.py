"""`tedebug.backends.launch`: argument typing and mode selection on any machine; on a GPU, the driver launch and
CuPy's own launch give identical results, and statistics reach the engine's slab through the driver launch (read back
at the step or, deferred, at the next one)."""

import numpy as np
import pytest
import torch

from tedebug.backends import launch


def test_arguments_are_packed_one_slot_each_where_the_params_point():
    import ctypes
    import struct

    args = (
        0x7F0012345670,
        np.int64(-5),
        np.int32(-3),
        np.uint32(4000000000),
        np.float32(0.1),
        np.float64(2.5),
        np.uint64(2**64 - 1),
    )
    block = launch._arg_block(args, "k")
    base = ctypes.addressof(block.slots)
    assert [block.params[i] for i in range(len(args))] == [base + 8 * i for i in range(len(args))]
    raw = bytes(block.slots)
    assert struct.unpack_from("<Q", raw, 0)[0] == 0x7F0012345670  # a device pointer: 64 bits
    assert struct.unpack_from("<q", raw, 8)[0] == -5
    assert struct.unpack_from("<i", raw, 16)[0] == -3  # 4-byte values in the low half of their slot
    assert struct.unpack_from("<I", raw, 24)[0] == 4000000000
    assert struct.unpack_from("<f", raw, 32)[0] == float(np.float32(0.1))
    assert struct.unpack_from("<d", raw, 40)[0] == 2.5
    assert struct.unpack_from("<Q", raw, 48)[0] == 2**64 - 1
    again = launch._arg_block(
        (1, np.int64(2), np.int32(3), np.uint32(4), np.float32(5), np.float64(6), np.uint64(7)), "k"
    )
    assert again is block  # one block per signature and thread, repacked
    assert struct.unpack_from("<Qqi4xI4xf4xdQ", bytes(block.slots)) == (1, 2, 3, 4, 5.0, 6.0, 7)


def test_a_signed_launch_packs_plain_numbers_as_its_signature_types(monkeypatch):
    """`launch_signed` packs plain ints into the bytes the typed arguments of `launch_on` pack into, and in the
    ``cupy`` mode hands CuPy those typed arguments."""
    signature = (int, np.int64, np.uint32, int)
    values = (0x7F0012345670, -5, 4000000000, 12)
    typed = (0x7F0012345670, np.int64(-5), np.uint32(4000000000), 12)
    launched = []

    def driver(kernel, index, grid, block, params, stream, shared_mem):  # the slots as the launch finds them
        packed = launch._THREAD_BLOCKS.blocks[signature]
        assert params is packed.params
        launched.append(("driver", bytes(packed.slots), grid, block, stream))

    def cupy(kernel, index, grid, block, args, stream, shared_mem):
        launched.append(("cupy", args, [type(a) for a in args]))

    monkeypatch.setattr(launch, "_launch_driver", driver)
    monkeypatch.setattr(launch, "_launch_cupy", cupy)

    class Kernel:
        name = "ted_k"

    monkeypatch.setenv(launch.ENV_VAR, "cupy")
    launch.launch_signed(Kernel(), 0, 5, 3, 256, signature, values)
    assert launched.pop() == ("cupy", typed, [type(a) for a in typed])
    monkeypatch.setattr(launch, "_driver", lambda: (None, None))
    monkeypatch.setenv(launch.ENV_VAR, "driver")
    launch.launch_signed(Kernel(), 0, 5, 3, 256, signature, values)
    reference = launch._ArgBlock(signature, "k")  # (its own slots: what `_arg_block(typed)` would pack)
    reference.pack_into(reference.slots, 0, *typed)
    assert launched == [("driver", bytes(reference.slots), 3, 256, 5)]


def test_arguments_need_a_fixed_c_type():
    with pytest.raises(TypeError, match=r"kernel 'ted_x', argument 1: float has no fixed C type"):
        launch._arg_block((7, 0.5), "ted_x")
    with pytest.raises(TypeError, match="argument 0: bool"):
        launch._arg_block((True,), "ted_x")
    with pytest.raises(ValueError, match="kernel 'ted_x': an argument does not fit its C type"):
        launch._arg_block((-1,), "ted_x")  # a pointer is never negative


def test_each_thread_packs_into_its_own_block():
    import threading

    blocks = []
    worker = threading.Thread(target=lambda: blocks.append(launch._arg_block((1, 2), "k")))
    worker.start()
    worker.join()
    assert launch._arg_block((1, 2), "k") is not blocks[0]


def test_launch_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv(launch.ENV_VAR, "cupy")
    assert launch.launch_mode() == "cupy"
    monkeypatch.setenv(launch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"TEDEBUG_LAUNCH='fast': expected one of \('driver', 'cupy', 'ctypes'\)"):
        launch.launch_mode()
    monkeypatch.setattr(launch, "_driver", lambda: None)
    for driver_mode in ("driver", "ctypes"):
        monkeypatch.setenv(launch.ENV_VAR, driver_mode)
        with pytest.raises(RuntimeError, match=f"{driver_mode} was requested but libcuda could not be loaded"):
            launch.launch_mode()
    monkeypatch.delenv(launch.ENV_VAR)
    assert launch.launch_mode() == "cupy"


class _FakeLibcuda:
    """Stand-ins for the libcuda entry points the launchers take (ctypes functions with settable argtypes), on a
    device with `per_sm` resident blocks per SM, cooperative launches `supported` or not, and a driver answer
    `code` for the occupancy query."""

    def __init__(self, per_sm, supported=1, code=0):
        self.asked = []

        def occupancy(out, function, block, shared):
            self.asked.append((function, block, shared))
            out._obj.value = per_sm
            return code

        def attribute(out, attribute, device):
            assert attribute == 95  # CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
            out._obj.value = supported
            return 0

        for name, fn in (
            ("cuLaunchKernel", lambda *a: 0),
            ("cuGetErrorName", lambda *a: 0),
            ("cuLaunchCooperativeKernel", lambda *a: 0),
            ("cuOccupancyMaxActiveBlocksPerMultiprocessor", occupancy),
            ("cuDeviceGetAttribute", attribute),
        ):
            setattr(self, name, _Settable(fn))


class _Settable:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("per_sm, supported, code, expected", [(4, 1, 0, 4), (3, 1, 0, 3), (4, 0, 0, 0), (4, 1, 2, 0)])
def test_cooperative_blocks_per_sm_is_the_occupancy(monkeypatch, per_sm, supported, code, expected):
    """`cooperative_blocks_per_sm`: the resident blocks per SM the driver reports; 0 where the device has no
    cooperative launches or the query fails; and 0 in the cupy launch mode, without asking."""
    fake = _FakeLibcuda(per_sm, supported, code)
    monkeypatch.setattr(launch, "_libcuda", lambda: fake)
    for cached in (launch._driver, launch._cooperative_driver):
        monkeypatch.setattr(launch, cached.__name__, cached.__wrapped__)  # (no lru_cache: the fake each time)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)

    class Kernel:
        name = "k"

        def handle(self, index):
            return 1234

    monkeypatch.setenv(launch.ENV_VAR, "driver")
    assert launch.cooperative_blocks_per_sm(Kernel(), 0, 256) == expected
    assert fake.asked == ([(1234, 256, 0)] if supported else [])
    monkeypatch.setenv(launch.ENV_VAR, "cupy")
    fake.asked.clear()
    assert launch.cooperative_blocks_per_sm(Kernel(), 0, 256) == 0 and fake.asked == []


@pytest.mark.parametrize("first, bind, expected", [(201, 0, 0), (201, 2, 201), (700, 0, 700), (0, 0, 0)])
def test_a_launch_without_a_context_binds_the_primary_context_and_goes_again(monkeypatch, first, bind, expected):
    """CUDA_ERROR_INVALID_CONTEXT (201: the thread's first CUDA work is this launch) binds device 0's primary context
    to the thread (cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent) and launches once more; any other error,
    or a binding the driver refuses, is raised as it was, and a launch that succeeds binds nothing."""
    codes, calls = [first, 0], []

    def launch_fn(*args):
        calls.append(("launch", args[0]))
        return codes.pop(0) if first != 201 or bind == 0 else 201

    def device_get(out, ordinal):
        calls.append(("device", ordinal))
        out._obj.value = 9
        return 0

    def retain(out, device):
        calls.append(("retain", device))
        out._obj.value = 77
        return bind

    def set_current(context):
        calls.append(("current", context.value))
        return 0

    monkeypatch.setattr(launch, "_driver", lambda: (launch_fn, lambda code, name: 1))
    monkeypatch.setattr(launch, "_context_driver", lambda: (device_get, retain, set_current))
    monkeypatch.setattr(launch, "_current_device", lambda: 0)

    class Kernel:
        name = "ted_k"

        def handle(self, index):
            return 1234

    params = launch._arg_block((np.int32(1),), "ted_k").params
    if expected:
        with pytest.raises(launch.KernelLaunchError, match=f"ted_k.*CUresult {expected}"):
            launch._launch_driver(Kernel(), 0, 1, 32, params, 5, 0)
    else:
        launch._launch_driver(Kernel(), 0, 1, 32, params, 5, 0)
    bound = [("device", 0), ("retain", 9)] + ([("current", 77)] if bind == 0 else [])
    if first == 201:
        assert calls == [("launch", 1234)] + bound + ([("launch", 1234)] if bind == 0 else [])
    else:
        assert calls == [("launch", 1234)]


def test_stream_handle_speaks_the_cuda_stream_protocol():
    assert launch._StreamHandle(1234).__cuda_stream__() == (0, 1234)


@pytest.mark.gpu
def test_driver_and_cupy_launches_agree(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("cupy")
    from tedebug.backends import cupy_stats

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4099, 33, generator=g) * 7 + 3).to("cuda", torch.bfloat16)
    rows, groups = {}, {}
    parts = (x[:1000], x[1000:1001], x[1001:])  # (contiguous pieces of three sizes: one group launch)
    for mode in ("driver", "cupy"):
        monkeypatch.setenv(launch.ENV_VAR, mode)
        assert launch.launch_mode() == mode
        out = torch.full((13,), -1.0, dtype=torch.float64, device="cuda")
        cupy_stats.basic_stats_into(x, out.data_ptr())
        rows[mode] = out.cpu()
        grouped = torch.full((3, 13), -1.0, dtype=torch.float64, device="cuda")
        cupy_stats.basic_stats_group_into([(p, grouped[i].data_ptr()) for i, p in enumerate(parts)])
        groups[mode] = grouped.cpu()
    assert torch.equal(rows["driver"], rows["cupy"])
    assert torch.equal(groups["driver"], groups["cupy"])
    assert groups["driver"][:, 0].tolist() == [p.numel() for p in parts]
    assert groups["driver"][:, 2].tolist() == [p.float().max().item() for p in parts]
    assert rows["driver"][0].item() == x.numel()
    assert rows["driver"][1].item() == x.float().min().item() and rows["driver"][2].item() == x.float().max().item()


@pytest.mark.gpu
def test_engine_slab_rows_on_the_gpu_equal_the_torch_path():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("cupy")
    from tedebug.backends import dispatch
    from tedebug.stats.engine import StatsEngine
    from support.features import RecordingSink

    stats = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range", "nan_count")
    g = torch.Generator().manual_seed(2)
    xs = [
        (torch.randn(300, 257, generator=g) * s).to("cuda", dt)
        for s, dt in ((1.0, torch.bfloat16), (1e-3, torch.float16), (50.0, torch.float32))
    ]
    blockwise = ({"max_blockwise_dynamic_range": {"block_size": 4, "dims": 1}},)  # a row tensor, not a slab row
    emitted = {}
    for name, backend, defer in (("torch", "torch", False), ("cupy", "cupy", False), ("deferred", "cupy", True)):
        sink = RecordingSink()
        engine = StatsEngine(sink, defer_read_back=defer)
        with dispatch.use_backend(backend):
            for step in range(3):
                for i, x in enumerate(xs):
                    engine.feed(f"l{i}", "activation", stats, x * (step + 1), iteration=step)
                    engine.feed(f"l{i}", "activation", stats, x[:7], iteration=step)  # a second microbatch
                    engine.feed(f"l{i}", "weight", blockwise, x.float() - step, iteration=step)
                engine.step(step)
            engine.finish_pending()
        emitted[name] = [r for r in sink.rows if "blockwise" not in r[0]]
        emitted[name + " blockwise"] = [r for r in sink.rows if "blockwise" in r[0]]
    assert repr(emitted["deferred"]) == repr(emitted["cupy"])  # the deferred read-back changes nothing
    assert emitted["deferred blockwise"] == emitted["cupy blockwise"] == emitted["torch blockwise"]
    assert len(emitted["cupy blockwise"]) == 3 * 3
    assert len(emitted["torch"]) == len(emitted["cupy"]) == 3 * 3 * len(stats)
    for (name, ref, it), (name2, got, it2) in zip(emitted["torch"], emitted["cupy"]):
        assert (name, it) == (name2, it2)
        if name.endswith(("_min", "_max", "_cur_amax", "_nan_count", "_dynamic_range")):
            assert ref == got, name
        else:  # sums: fp32 chunks then fp64 (kernels/stats.cu) vs the torch reference
            assert got == pytest.approx(ref, rel=1e-5), name
