"""Fixtures shared by the test modules (helpers that are not fixtures live in tests/support/, imported as
`support.<module>`; pytest puts this folder on sys.path).

- `no_debug_session`: no tedebug session before or after the test;
- `start`: for the debug-path tests, opens a session with the test features of tests/feature_dirs_debug and returns
  their loaded module (its CALLS list records every call);
- `host_kernels`: runs a test of the CPU FP8 host path twice, with the compiled helpers of kernels/host_fp8.c and
  with the numpy path (``$TEDEBUG_HOST_KERNELS``), which must give the same bits;
- `inspected_linear`: runs a test twice, with the compiled linear of inspect-only GEMM calls
  (kernels/inspected_linear.cpp) and with the Python path (``$TEDEBUG_INSPECTED_LINEAR``).

The compiled linear is built (or found in the cache) before the first test (`pytest_sessionstart`), so every test
takes the path a user's run takes once its background build is over (the default mode, "auto").

And the ``gpu`` marker's promise (pyproject.toml): a test marked ``gpu`` is skipped, with the reason, where CUDA or
CuPy is missing (`pytest_collection_modifyitems`), so a GPU test module only declares the mark."""

import os
import sys
import warnings
from pathlib import Path

import pytest

from support.sys_path import without_repository_root
from tedebug import debug_api
from tedebug.registry import user_module_name


# the repository's root off sys.path where tedebug is installed (why, and when it stays: tests/support/sys_path.py)
sys.path[:] = without_repository_root(sys.path, Path(__file__).resolve().parent.parent)

DEBUG_FEATURE_DIR = Path(__file__).parent / "feature_dirs_debug"
DEBUG_FEATURE_FILE = DEBUG_FEATURE_DIR / "debug_test_features.py"


def _gpu_missing():
    """Why the tests marked gpu cannot run here, or None when CUDA and CuPy are both present."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "needs CuPy"
    return None


def pytest_sessionstart(session):
    from tedebug.nn import compiled_linear

    compiled_linear.wait_for_build()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = _gpu_missing() if gpu_items else None
    if reason is not None:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)


def make_debug_config(features, regex=".*"):
    """The config dict; no features: no config at all ("" - a section without features is a config error)."""
    if not features:
        return ""
    return {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": regex}, "transformer_engine": features}}


@pytest.fixture
def start(tmp_path):
    """start(features, regex=".*", **initialize_kwargs) -> the loaded test-feature module; the session ends with
    the test (pass ``plan_cache=False`` for a spy that must see every hook question)."""

    def _start(features, regex=".*", **initialize_kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "running without config" when there are no features
            debug_api.initialize(
                config_file=make_debug_config(features, regex),
                feature_dirs=[str(DEBUG_FEATURE_DIR)],
                log_dir=str(tmp_path),
                **initialize_kwargs,
            )
        return sys.modules[user_module_name(os.path.realpath(DEBUG_FEATURE_FILE))]

    yield _start
    debug_api.end_debug()


@pytest.fixture
def no_debug_session():
    """No tedebug session before the test and none left after it, and no sink queued for the next initialize."""
    debug_api.end_debug()
    debug_api._queued_sinks.clear()
    yield
    debug_api.end_debug()
    debug_api._queued_sinks.clear()


@pytest.fixture(params=["c", "numpy"])
def host_kernels(request, monkeypatch):
    """The test once with the compiled CPU helpers (``$TEDEBUG_HOST_KERNELS=c``: an error if they cannot be built)
    and once with the numpy path; the compiled run is skipped, with the reason, where there is no C compiler."""
    from tedebug.backends import host_kernels as helpers

    if request.param == "c" and helpers.compiler() is None:
        pytest.skip("no C compiler ($CC, cc, gcc or clang): the compiled CPU helpers cannot be built here")
    monkeypatch.setenv(helpers.ENV_VAR, request.param)
    return request.param


@pytest.fixture(params=["compiled", "python"])
def inspected_linear(request, monkeypatch):
    """The test once with the compiled linear of inspect-only GEMM calls (``$TEDEBUG_INSPECTED_LINEAR=compiled``)
    and once with the Python path; the compiled run is skipped, with the reason, where it cannot be built."""
    from tedebug.nn import compiled_linear

    if request.param == "compiled" and compiled_linear.wait_for_build() is None:
        pytest.skip(f"the compiled linear cannot be built here: {compiled_linear.unavailable_reason()}")
    monkeypatch.setenv(compiled_linear.ENV_VAR, request.param)
    return request.param
