"""The inspect-only GEMM call's linear in compiled code: ``kernels/inspected_linear.cpp`` built against torch.

Why: a GEMM call whose debug quantizers only inspect runs torch's own linear (`tedebug.nn.base._inspected_linear`).
In Python its reshapes, its `F.linear` and above all the hook on the linear's autograd node (torch builds a
`RemovableHandle` and a dict in Python for each registration) cost a GEMM call's forward about twice what
`F.linear` alone costs; on a step bound by the host that is paid 48 times a step in a 12-block model.  The
extension's `linear` does the same through torch's C++ API, with a C++ post hook that calls the backward
inspection with the three tensors it reads (the source's header says what it answers and when it hands a call
back to the Python path, which gives the same tensors).

How: built with the system C++ compiler against the running torch's headers and libraries and the interpreter's
headers, in the cache folder of the CPU FP8 cast (`tedebug.backends.host_kernels`: digest-named files, a private
fallback folder), and loaded as the module ``tedebug_inspected_linear``.  The build took 14-16 s on the hosts
measured (torch's headers; docs/performance.md, section 31), once per machine and torch install.

The choice is ``$TEDEBUG_INSPECTED_LINEAR`` (read at every inspect-only GEMM call, decoded once per change):
- ``auto`` (the default): the first call starts the build in a background thread and takes the Python path; the
  calls after the build finished take the compiled one.  A process that ends before the build did waits for it at
  exit, so that the next run finds it in the cache.  A machine without a C++ compiler or without the headers
  keeps the Python path without a word; a build that fails says why once (RuntimeWarning);
- ``compiled``: the first call builds (and waits for it); `InspectedLinearBuildError` when it cannot be built;
- ``python``: the Python path only.
Compiled autograd (torch._dynamo.compiled_autograd) calls the Python path's hook (`node_hook`, through
`traced_hook`) in the C++ hook's place, so every mode serves runs that use it; on either path the hook runs
untraced there.
`wait_for_build()` starts the build when needed and waits for it (the tests); `prepare()` does so unless the mode is
"python" (a benchmark's set-up: `tedebug.bench.training_setup`).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Tuple

import torch

from tedebug.backends import host_kernels
from tedebug.backends.build_once import BuildOnce
from tedebug.backends.environ import environ_value
from tedebug.host_numpy import compiling
from tedebug.untraced import untraced

ENV_VAR = "TEDEBUG_INSPECTED_LINEAR"
MODES = ("auto", "compiled", "python")
SOURCE_NAME = "inspected_linear.cpp"
MODULE_NAME = "tedebug_inspected_linear"
#: no -march: the cache folder may be shared by machines of different CPUs; C++20: torch's newer headers ask for it
FLAGS = ("-O2", "-std=c++20", "-fPIC", "-shared")
#: a slow host compiling torch's headers, with other work beside it (the other ranks of the machine wait for this
#: build: `host_kernels.build`'s lock file)
BUILD_TIMEOUT_S = 600.0


class InspectedLinearBuildError(RuntimeError):
    """``$TEDEBUG_INSPECTED_LINEAR=compiled`` and the extension could not be built or loaded."""


_env = environ_value(ENV_VAR)
_START_LOCK = threading.Lock()
#: the background build of the "auto" mode, once started
_builder: Optional[threading.Thread] = None
#: (the raw value of the variable, the `linear` that `linear_function` answers for it): the answer of a raw value
#: is kept only once the build is over (an "auto" answer changes when it ends)
_answer_of: Tuple[Any, Optional[Callable[..., Any]]] = (object(), None)


def linear_function() -> Optional[Callable[..., Any]]:
    """The compiled ``linear(x, weight, bias, backward, context)`` an inspect-only GEMM call takes now, or None
    for the Python path (see the module docstring).  Asked at every such call: one read of the variable."""
    global _answer_of
    raw = _env.raw()
    if raw is _answer_of[0]:
        return _answer_of[1]
    mode = _mode(_env.text(raw))
    if mode == "python":
        answer = None
    elif mode == "compiled":
        module, why = _BUILD.get()
        if module is None:
            raise InspectedLinearBuildError(
                f"{ENV_VAR}=compiled, but {SOURCE_NAME} could not be built: {why}. "
                f"{ENV_VAR}=python (or unset) takes the Python path, which gives the same results"
            )
        answer = module.linear
    else:
        built = _BUILD.outcome
        if built is None:
            if _builder is None:
                _start_background_build()
            return None  # (not kept: asked again at the next call until the build is over)
        answer = built[0].linear if built[0] is not None else None
    _answer_of = (raw, answer)
    return answer


def wait_for_build() -> Optional[ModuleType]:
    """Build the extension now (or wait for the background build) and return it, or None where it cannot be built
    (`unavailable_reason` says why)."""
    builder = _builder
    if builder is not None:
        builder.join()
    return _BUILD.get()[0]


def prepare() -> None:
    """Make (or load from the cache) now the build the current mode would use, rather than at the first
    inspect-only GEMM call: for a benchmark's or a run's set-up, so that every timed step takes one path.  Nothing
    in the "python" mode."""
    if _mode(_env.text(_env.raw())) != "python":
        wait_for_build()


def unavailable_reason() -> str:
    """Why the extension is not there ("" when it is, or before the build ended)."""
    return _BUILD.reason()


def _mode(text: str) -> str:
    mode = text.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"environment variable {ENV_VAR}={text!r}: expected one of {', '.join(MODES)}")
    return mode


def _start_background_build() -> None:
    global _builder
    with _START_LOCK:  # (not the build's lock, which a running build holds)
        if _builder is None and _BUILD.outcome is None:
            # not a daemon: a process that ends during the build waits for it (once per machine), where a daemon
            # would leave the compiler running on, its file unfinished, and the next short run would start over
            _builder = threading.Thread(target=_BUILD.get, name="tedebug-inspected-linear-build", daemon=False)
            _builder.start()


def node_hook(backward, context, dx_at: int, dwt_at: int, grad_inputs, grad_outputs) -> None:
    """The backward inspection's hook in Python, bound by ``functools.partial`` to its first four arguments: a post
    hook of `node.register_hook` on a linear's node, which calls ``backward(context, dy, dx, dWt)`` with the node's
    gradient output and its gradient inputs for x and for Wᵀ (at `dx_at` and `dwt_at`), when either of those two
    was computed.  The Python path registers it; compiled autograd calls it in the compiled hook's place
    (`traced_hook`), so both make the same call.  Compiled autograd traces the hooks the Python path registered:
    this one then runs untraced, as `traced_hook` does (a graph break)."""
    if compiling():
        return untraced(node_hook)(backward, context, dx_at, dwt_at, grad_inputs, grad_outputs)
    dx = grad_inputs[dx_at]
    dwt = grad_inputs[dwt_at]
    if dx is None and dwt is None:
        return
    backward(context, grad_outputs[0], dx, dwt)


def traced_hook(backward, context, dx_at: int, dwt_at: int) -> Callable[..., None]:
    """What compiled autograd calls in the place of a compiled hook with these arguments (asked by its
    ``compiled_args``: kernels/inspected_linear.cpp): `node_hook` bound to them, which torch._dynamo does not
    trace (`tedebug.untraced`: it runs as it is, at its place in the backward; compiled autograd runs, so
    torch._dynamo is loaded).  Traced, it would take
    tedebug's statistics engine into the graph: on the CPU VM four times the first step's compile time and twice
    the time of a later step (docs/performance.md, section 32)."""
    return functools.partial(untraced(node_hook), backward, context, dx_at, dwt_at)


def _load(path: Path) -> ModuleType:
    """The built module, told what compiled autograd calls in its hooks' place (`traced_hook`)."""
    module = host_kernels.load_extension_module(MODULE_NAME, path)
    module.set_traced_hook(traced_hook)
    return module


def _failure_warning(why: str) -> Optional[str]:
    """Said once when the build fails where it could run (nothing where a compiler or the headers are missing)."""
    if not _can_build():
        return None
    return (
        f"tedebug: the compiled linear of inspect-only GEMM calls ({SOURCE_NAME}) could not be built ({why}); those "
        f"calls take the Python path (the same results, more host time). {ENV_VAR}=python chooses that and silences "
        "this warning."
    )


def _can_build() -> bool:
    """A C++ compiler, the interpreter's headers and torch's are there (else nothing is said of a missing build)."""
    if host_kernels.cxx_compiler() is None or host_kernels.python_include() is None:
        return False
    return _torch_include().is_dir()


def _torch_include() -> Path:
    return Path(torch.__file__).parent / "include"


def _build_and_load() -> Tuple[Optional[ModuleType], str]:
    include = host_kernels.python_include()
    if include is None:
        return None, "the interpreter's headers (Python.h) are not installed"
    torch_include = _torch_include()
    if not (torch_include / "torch" / "csrc" / "autograd" / "function.h").is_file():
        return None, f"torch's C++ headers are not installed ({torch_include})"
    library_dir = Path(torch.__file__).parent / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = FLAGS + (f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_include}", f"-I{include}")
    libraries: Tuple[str, ...] = (f"-L{library_dir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python")
    if sys.platform == "darwin":
        libraries += ("-undefined", "dynamic_lookup")
    else:
        libraries += (f"-Wl,-rpath,{library_dir}",)
    # built for one interpreter and one torch: their versions are part of the file's digest (their folders are
    # in the flags)
    build_of = f"{host_kernels.interpreter_tag()} torch {torch.__version__} {getattr(torch.version, 'git_version', '')}"
    return host_kernels.build_and_load(
        _load,
        source_name=SOURCE_NAME,
        flags=flags,
        libraries=libraries,
        digest_extra=build_of,
        cxx=True,
        timeout=BUILD_TIMEOUT_S,
    )


#: the one build of the process (the background thread's, or the first call's in the "compiled" mode)
_BUILD: BuildOnce[ModuleType] = BuildOnce(_build_and_load, _failure_warning, stacklevel=2)


def _after_fork_in_child() -> None:
    """A process forked during the background build has neither the build's thread nor a usable lock (the parent's
    thread may have held them): a new start lock (`BuildOnce` renews its own), and a build of its own when it
    needs one."""
    global _START_LOCK, _builder
    _START_LOCK = threading.Lock()
    if _BUILD.outcome is None:
        _builder = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _reset_for_tests() -> None:
    """Forget the build and the answer (tests that point the cache or the compiler elsewhere)."""
    global _builder, _answer_of
    if _builder is not None:
        _builder.join()
    _BUILD.forget()
    _builder, _answer_of = None, (object(), None)


__all__ = [
    "ENV_VAR",
    "MODES",
    "InspectedLinearBuildError",
    "linear_function",
    "node_hook",
    "prepare",
    "traced_hook",
    "unavailable_reason",
    "wait_for_build",
]
