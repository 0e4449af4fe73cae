"""The compiled CPU helpers of kernels/host_fp8.c (`tedebug.backends.host_kernels`).

- the cast gives torch's fp32 -> float8 cast bit for bit (saturated first, NaN as 0x7F) for every bf16 bit pattern
  widened to fp32 and for every FP8 code value, its fp32 neighbours and the midpoints between codes (the ties), in
  both formats, with and without the saturation the caller may skip, and with a scale that makes real products;
- the transposed codes are the transpose of the rowwise ones (which are always written), and can be left out;
- the amax ignores NaN (0 when all are NaN), keeps infinities and says whether a NaN was present;
- the library is built once per source, compiler and flags and then loaded from the cache (or, where the cache
  cannot be written, from a private temporary folder, never from one others can write to); builders at once
  compile once (a lock file), and without the lock two at once leave one whole library; a compiler that fails
  (with one warning) or is missing leaves the numpy path in place, unless ``$TEDEBUG_HOST_KERNELS=c`` asks for
  the helpers (an error).

Once over all 2^32 fp32 bit patterns (2026-12-04, not run here: minutes), the cast matched torch's in both formats.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
import warnings

import numpy as np
import pytest
import torch

from tedebug.backends import host_kernels
from tedebug.quantization.formats import FP8_MAX, TORCH_FP8_DTYPE, fp8_decode_table

from support.concurrency import run_in_two_threads

pytestmark = pytest.mark.skipif(host_kernels.compiler() is None, reason="no C compiler: nothing to build")

#: the magnitude from which each format's cast no longer rounds to its maximum (the caller saturates from there)
ROUNDS_TO_MAX = {"E4M3": 464.0, "E5M2": 61440.0}


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    path = host_kernels.build(tmp_path_factory.mktemp("host_kernels"))
    return host_kernels.HostFp8(ctypes.CDLL(str(path)), path)


def torch_codes(x: torch.Tensor, fmt: str, clip: bool) -> torch.Tensor:
    """torch's codes of fp32 `x`: clamped to ±fp8_max first when `clip`, NaN stored as 0x7F."""
    fmax = FP8_MAX[fmt]
    y = x.clamp(-fmax, fmax) if clip else x
    codes = y.to(TORCH_FP8_DTYPE[fmt]).view(torch.uint8).clone()
    codes[torch.isnan(x)] = 0x7F
    return codes


def compiled_codes(helpers, x: torch.Tensor, fmt: str, clip: bool, scale: float = 1.0) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    helpers.cast(x.data_ptr(), 1, x.numel(), scale, fmt, clip, FP8_MAX[fmt], out.data_ptr(), 0)
    return out


def dense_values(fmt: str) -> torch.Tensor:
    """Every bf16 bit pattern as fp32, every finite code value of `fmt` with its fp32 neighbours, and the midpoints
    between adjacent code values (ties) with theirs, of both signs."""
    widened = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    table = np.unique(fp8_decode_table(fmt)[np.isfinite(fp8_decode_table(fmt))].astype(np.float64))
    table = table[table >= 0]
    mids = (table[1:] + table[:-1]) / 2  # exact in fp32: adjacent codes differ in their last mantissa bits only
    points = np.concatenate([table, mids]).astype(np.float32)
    up, down = np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(-np.inf))
    near = np.concatenate([points, up, down])
    near = np.concatenate([near, -near])
    return torch.cat([widened, torch.from_numpy(near)])


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_cast_equals_torchs_cast(helpers, fmt):
    x = dense_values(fmt)
    assert torch.equal(compiled_codes(helpers, x, fmt, clip=True), torch_codes(x, fmt, clip=True))
    # without the saturation, wherever the caller may skip it (every magnitude below the rounding limit)
    kept = x[~(x.abs() >= ROUNDS_TO_MAX[fmt])]  # (NaN kept)
    assert torch.equal(compiled_codes(helpers, kept, fmt, clip=False), torch_codes(kept, fmt, clip=False))


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("scale", [3.7, 2.0**-20, 1e30, 0.0, float("inf")])
def test_cast_of_products_equals_torchs(helpers, fmt, scale):
    """The products are IEEE fp32 products: 0 · Inf and Inf · 0 make NaN (code 0x7F), as torch's product does."""
    g = torch.Generator().manual_seed(11)
    x = torch.cat(
        [torch.randn(4000, generator=g) * 10.0 ** torch.randint(-8, 8, (4000,), generator=g), dense_values(fmt)]
    )
    products = x * torch.tensor(scale, dtype=torch.float32)
    got = compiled_codes(helpers, x, fmt, clip=True, scale=scale)
    assert torch.equal(got, torch_codes(products, fmt, clip=True))


@pytest.mark.parametrize("cols", [True, False])
def test_transposed_codes(helpers, cols):
    x = torch.randn(7, 13, generator=torch.Generator().manual_seed(3)) * 100
    row = torch.full((7, 13), 0xAA, dtype=torch.uint8)
    col = torch.full((13, 7), 0xAA, dtype=torch.uint8)
    helpers.cast(x.data_ptr(), 7, 13, 1.0, "E4M3", True, 448.0, row.data_ptr(), col.data_ptr() if cols else 0)
    expected = torch_codes(x, "E4M3", clip=True)
    assert torch.equal(row, expected)
    assert torch.equal(col, expected.t() if cols else torch.full_like(col, 0xAA))


@pytest.mark.parametrize(
    "values, amax, nan",
    [
        ([float("nan"), -3.0, 2.0], 3.0, True),
        ([float("nan")] * 3, 0.0, True),
        ([float("-inf"), 1.0], float("inf"), False),
        ([-0.0], 0.0, False),
        ([-1e-45, 1e-45, float("nan")], 1e-45, True),
    ],
)
def test_amax_ignores_nan(helpers, values, amax, nan):
    x = torch.tensor(values, dtype=torch.float32)
    got, has_nan = helpers.amax_and_nan(x.data_ptr(), x.numel())
    assert (got, has_nan) == (float(np.float32(amax)), nan) and np.copysign(1.0, got) == 1.0


def test_amax_equals_numpys(helpers):
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(5)) * 1e3
    got, nan = helpers.amax_and_nan(x.data_ptr(), x.numel())
    assert not nan and got == float(np.abs(x.numpy()).max())


# ------------------------------------------------------------------------------------------------ building, choosing
def test_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    first = host_kernels.build(tmp_path)
    runs = []
    monkeypatch.setattr(host_kernels, "_compile", lambda command, timeout: runs.append(command))
    assert host_kernels.build(tmp_path) == first and runs == []
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # (no temporary file left)


def test_a_failing_compiler_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(host_kernels.HostKernelError, match="false .*failed"):
        host_kernels.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_without_a_compiler_the_numpy_path_runs_unless_c_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(host_kernels, "compiler", lambda: None)
    monkeypatch.setattr(host_kernels._BUILD, "outcome", None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(host_kernels.ENV_VAR, raising=False)
    assert host_kernels.host_fp8() is None
    assert "no C compiler" in host_kernels.unavailable_reason()
    monkeypatch.setenv(host_kernels.ENV_VAR, "c")
    with pytest.raises(
        host_kernels.HostKernelError, match=r"\"c\" was asked for .*TEDEBUG_HOST_KERNELS.*no C compiler"
    ):
        host_kernels.host_fp8()
    # the quantization still gives the torch path's bytes
    from tedebug.quantization.float8 import Float8CurrentScalingQuantizer, _cast_per_tensor
    from tedebug.quantization.formats import tensor_amax

    monkeypatch.delenv(host_kernels.ENV_VAR)
    quantizer = Float8CurrentScalingQuantizer()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    ref = _cast_per_tensor(quantizer, x, quantizer.compute_scale(tensor_amax(x)), "E4M3")
    assert torch.equal(quantizer.quantize(x).rowwise_data, ref.rowwise_data)


def test_the_variable_chooses(monkeypatch):
    monkeypatch.setenv(host_kernels.ENV_VAR, "numpy")
    assert host_kernels.host_fp8() is None
    monkeypatch.setenv(host_kernels.ENV_VAR, " C ")
    assert isinstance(host_kernels.host_fp8(), host_kernels.HostFp8)
    monkeypatch.setenv(host_kernels.ENV_VAR, "auto")
    assert isinstance(host_kernels.host_fp8(), host_kernels.HostFp8)
    monkeypatch.setenv(host_kernels.ENV_VAR, "fortran")
    with pytest.raises(ValueError, match="environment variable TEDEBUG_HOST_KERNELS='fortran': expected one of"):
        host_kernels.host_fp8()


def test_use_host_kernels_overrides_the_variable_and_restores_the_choice(monkeypatch):
    monkeypatch.setenv(host_kernels.ENV_VAR, "c")
    with host_kernels.use_host_kernels("numpy"):
        assert host_kernels.requested_mode() == "numpy" and host_kernels.host_fp8() is None
        with host_kernels.use_host_kernels("auto"):
            assert isinstance(host_kernels.host_fp8(), host_kernels.HostFp8)
        assert host_kernels.requested_mode() == "numpy"
    assert host_kernels.requested_mode() == "c"
    with pytest.raises(ValueError, match="use_host_kernels='cuda': expected one of"):
        host_kernels.use_host_kernels("cuda")
    assert host_kernels.requested_mode() == "c"


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(tmp_path / "a"))
    assert host_kernels.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TEDEBUG_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert host_kernels.cache_dir() == tmp_path / "x" / "tedebug"


def _fresh(monkeypatch, tmp_path, cache):
    """A process's first look: no build yet, the cache at `cache`, the fallback folder in `tmp_path`, no choice."""
    monkeypatch.setattr(host_kernels._BUILD, "outcome", None)
    monkeypatch.setenv("TEDEBUG_CACHE_DIR", str(cache))
    monkeypatch.setattr(host_kernels, "fallback_dir", lambda: tmp_path / "private")
    monkeypatch.delenv(host_kernels.ENV_VAR, raising=False)


def test_an_unwritable_cache_falls_back_to_a_private_temporary_folder(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    _fresh(monkeypatch, tmp_path, tmp_path / "file" / "cache")
    helpers = host_kernels.host_fp8()
    assert helpers is not None and helpers.path.parent == tmp_path / "private"
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o700


def test_a_folder_others_can_write_to_is_not_loaded_from(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    _fresh(monkeypatch, tmp_path, tmp_path / "file" / "cache")
    (tmp_path / "private").mkdir(mode=0o777)
    (tmp_path / "private").chmod(0o777)
    with pytest.warns(RuntimeWarning, match="not a private folder"):
        assert host_kernels.host_fp8() is None
    assert list((tmp_path / "private").iterdir()) == []


def test_a_failing_compiler_warns_once_and_leaves_the_numpy_path(tmp_path, monkeypatch):
    _fresh(monkeypatch, tmp_path, tmp_path / "cache")
    monkeypatch.setenv("CC", "false")
    with pytest.warns(
        RuntimeWarning,
        match=r"(?s)could not be built \(.*false .*failed \(exit status 1\)\).*TEDEBUG_HOST_KERNELS=numpy",
    ):
        assert host_kernels.host_fp8() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_kernels.host_fp8() is None  # (once per process)


def test_builders_at_once_compile_once(tmp_path, monkeypatch):
    """The ranks of one machine building at once: one compiles (holding the lock file), the others wait and take
    its library; the folder keeps the library only."""
    import threading

    compilations = []
    real_compile = host_kernels._compile

    def slow_compile(command, timeout):
        compilations.append(command)
        time.sleep(0.5)  # (the others are waiting by then)
        return real_compile(command, timeout)

    monkeypatch.setattr(host_kernels, "_compile", slow_compile)
    start = threading.Barrier(4, timeout=60)
    paths = []

    def builder():
        start.wait()
        paths.append(host_kernels.build(tmp_path))

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compilations) == 1 and len(paths) == 4 and len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    assert ctypes.CDLL(str(paths[0])).ted_host_fp8_cast is not None


def test_a_builder_that_waits_longer_than_its_timeout_compiles_itself(tmp_path, monkeypatch):
    """A lock held past the build's timeout (a hung builder elsewhere) does not hold this one up for longer."""
    fcntl = pytest.importorskip("fcntl")
    real_compile = host_kernels._compile
    monkeypatch.setattr(host_kernels, "_compile", lambda command, timeout: real_compile(command, 120))
    library = host_kernels.build(tmp_path)  # (its name, and so its lock's)
    library.unlink()
    lock = os.open(tmp_path / f".{library.stem}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.monotonic()
        assert host_kernels.build(tmp_path, timeout=0.5) == library and library.exists()
        assert 0.5 <= time.monotonic() - started < 60
    finally:
        os.close(lock)


def test_without_the_lock_two_builders_at_once_leave_one_whole_library(tmp_path, monkeypatch):
    """Where locks are unavailable the ranks of one machine may compile at once: each compiles into its own
    temporary file and renames it into place, so the library is whole whoever wins.  The two compilations are held
    until both have finished, so both builders really are between their compilation and their rename at the same
    time (a builder that found the library already there would leave the other waiting: the barrier breaks and the
    test fails)."""
    import threading

    monkeypatch.setattr(host_kernels, "fcntl", None)
    compiled = threading.Barrier(2, timeout=120)
    real_compile = host_kernels._compile

    def compile_then_wait(command, timeout):
        done = real_compile(command, timeout)
        compiled.wait()
        return done

    monkeypatch.setattr(host_kernels, "_compile", compile_then_wait)
    results = run_in_two_threads(lambda i: [host_kernels.build(tmp_path)], 1)
    assert [len(r) for r in results] == [1, 1]  # (a thread that raised returned nothing)
    paths = {result[0] for result in results[0] + results[1]}
    assert len(paths) == 1 and [p.name for p in tmp_path.iterdir()] == [next(iter(paths)).name]  # no temporary left
    library = ctypes.CDLL(str(next(iter(paths))))
    assert library.ted_host_fp8_cast is not None


def test_a_compiler_past_its_timeout_raises_and_one_that_ends_gives_its_status_and_complaint():
    with pytest.raises(subprocess.TimeoutExpired):
        host_kernels._compile(["sleep", "30"], 0.2)
    assert host_kernels._compile(["sh", "-c", "echo complaint >&2; exit 3"], 30) == (3, "complaint")
