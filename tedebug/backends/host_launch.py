"""Kernel launches from compiled code: ``kernels/host_launch.c`` built into a CPython extension module.

Why: on a step bound by the host, every launch pays the Python of its arguments (a `struct` packing, the ctypes
call's conversions), every logged GPU tensor that of its statistics launch too (five torch method calls, the
blocks), and inside a training step that Python costs several times what it costs in a loop.  The extension's
`launch` makes any launch of `tedebug.backends.launch` with the parameter block the ctypes path packs, and its
`stats_group_scratch` the usual statistics launch, `cupy_stats`' ``ted_stats_group_scratch`` of a GEMM call's two
or three tensors, from the tensors themselves (the source's header says how, and when each hands a call back to
the Python path).

How: built the first time a process launches a kernel in the driver mode, as the CPU FP8 cast is
(`tedebug.backends.host_kernels`: the system C compiler, the same cache folders and digest-named files, a private
fallback folder), against the running interpreter's headers, and loaded as the module ``tedebug_host_launch``.
`load` returns it, or None where it cannot be built; then every launch takes the ctypes path, which gives the same
launch.  ``TEDEBUG_LAUNCH=ctypes`` chooses that path on purpose (`tedebug.backends.launch.compiled_launches`).
A machine without a compiler or without the interpreter's headers (``Python.h``) is not warned about; a compiler
that fails is, once.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType
from typing import Optional, Tuple

from tedebug.backends import host_kernels
from tedebug.backends.build_once import BuildOnce

SOURCE_NAME = "host_launch.c"
MODULE_NAME = "tedebug_host_launch"
#: no -march: the cache folder may be shared by machines of different CPUs
FLAGS = ("-O2", "-std=c99", "-fPIC", "-shared")

python_include = host_kernels.python_include


def load() -> Optional[ModuleType]:
    """The compiled launches (built at the first call of the process), or None where they cannot be built."""
    built = _BUILD.outcome
    return (built if built is not None else _BUILD.get())[0]


def unavailable_reason() -> str:
    """Why `load` gives None ("" when it gives the module, or was not called yet)."""
    return _BUILD.reason()


def _failure_warning(why: str) -> Optional[str]:
    """Said once when a present compiler fails (nothing where there is no compiler or no ``Python.h``)."""
    if host_kernels.compiler() is None or python_include() is None:
        return None
    return (
        f"tedebug: the compiled kernel launches ({SOURCE_NAME}) could not be built ({why}); kernels launch through "
        "ctypes instead (the same launches, more host time). TEDEBUG_LAUNCH=ctypes chooses that and silences this "
        "warning."
    )


def _build_and_load() -> Tuple[Optional[ModuleType], str]:
    include = python_include()
    if include is None:
        return None, "the interpreter's headers (Python.h) are not installed"
    flags = FLAGS + (f"-I{include}",)
    if sys.platform == "darwin":
        flags += ("-undefined", "dynamic_lookup")
    return host_kernels.build_and_load(
        functools.partial(host_kernels.load_extension_module, MODULE_NAME),
        source_name=SOURCE_NAME,
        flags=flags,
        libraries=(),
        digest_extra=host_kernels.interpreter_tag(),  # (built for one interpreter)
    )


#: the one build of the process (`load` asks for it; the warning names the caller of `load`'s caller)
_BUILD: BuildOnce[ModuleType] = BuildOnce(_build_and_load, _failure_warning, stacklevel=4)


def _reset_for_tests() -> None:
    """Forget the build (tests that point the cache or the compiler elsewhere)."""
    _BUILD.forget()


__all__ = ["MODULE_NAME", "SOURCE_NAME", "load", "python_include", "unavailable_reason"]
