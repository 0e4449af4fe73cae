"""The compiled CPU helpers of ``kernels/host_fp8.c``: per-tensor FP8 quantization of CPU tensors in two calls.

Why: on the CPU a small tensor's FP8 quantization is bound by its number of Python-level calls (the numpy path of
`tedebug.quantization.float8` makes about ten: |x|, the reduction, the product, torch's cast, the views, the
transposed copy), three quantizations per linear layer and step.  The two functions of the C source make the
amax one call and the product, the cast and the transposed copy another, with the same bits (the source's header
says why; tests/backends/test_host_kernels.py compares them with torch's cast).

How: the source is compiled with the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) into a shared
library the first time a process needs it, kept in a cache directory (``$TEDEBUG_CACHE_DIR``, else
``$XDG_CACHE_HOME/tedebug``, else ``~/.cache/tedebug``; where that cannot be written, a private ``tedebug-<uid>``
folder in the temporary directory) under a name that carries a digest of the source, the compiler and the flags,
and loaded through ctypes.  The ranks of one machine build it once: the first holds a lock file beside it while it
compiles, the others wait and then load its library.  Where locks are unavailable (or a wait outlasts the build's
timeout) several may compile at once: each writes its own temporary file and renames it into place, so a loaded
file is always whole.  No build step at install time, and nothing to carry for a user without a compiler.
`build` and `build_and_load` build the GPU path's compiled launches and the compiled linear the same way
(``kernels/host_launch.c``, `tedebug.backends.host_launch`; ``kernels/inspected_linear.cpp``,
`tedebug.nn.compiled_linear`).

The kernel choice is visible (as ``KernelPreference`` in torchao): `use_host_kernels(mode)`, else
``$TEDEBUG_HOST_KERNELS``, names it: ``c`` (the compiled helpers; an error when they cannot be built), ``numpy``
(the numpy path) or ``auto``, the default (the compiled helpers where they build, else the numpy path, which gives
the same bits; the reason is kept in `unavailable_reason`, and a compiler that fails is reported once with a
RuntimeWarning; a machine without a compiler is not).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, List, Optional, Tuple, TypeVar

try:
    import fcntl
except ImportError:  # (not on Windows: builds there go without the lock)
    fcntl = None  # type: ignore[assignment]

from tedebug.backends.build_once import BuildOnce
from tedebug.backends.cupy_runtime import kernel_dir
from tedebug.backends.environ import environ_value

ENV_VAR = "TEDEBUG_HOST_KERNELS"
_MODES = ("auto", "c", "numpy")
SOURCE_NAME = "host_fp8.c"
T = TypeVar("T")
#: no contraction into fused multiply-adds and no fast-math: every product is one IEEE fp32 multiplication;
#: -fno-trapping-math lets the loops vectorize (selects may evaluate both sides) without changing a value; no -march
#: (the cache directory may be shared by machines of different CPUs)
FLAGS = ("-O3", "-std=c99", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math")


class HostKernelError(RuntimeError):
    """The compiled helpers were asked for (mode "c") and could not be built or loaded."""


class HostFp8:
    """The loaded functions of ``host_fp8.c`` (addresses of CPU memory are plain ints: ``tensor.data_ptr()``)."""

    __slots__ = ("_amax", "_cast", "_local", "path")

    def __init__(self, library: Any, path: Path) -> None:
        self.path = path
        self._amax = library.ted_host_amax
        self._amax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._amax.restype = ctypes.c_int
        self._cast = library.ted_host_fp8_cast
        self._cast.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
        self._cast.argtypes += [ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
        self._cast.restype = None
        self._local = threading.local()

    def amax_and_nan(self, pointer: int, numel: int) -> Tuple[float, bool]:
        """(max|x| over the `numel` fp32 values at `pointer` with NaN ignored, 0 when all are NaN; whether any is
        NaN): `formats.host_amax_and_nan`'s answer, the amax as a Python float (the fp32 value exactly).  The
        quantizers read only the amax (the compiled cast writes the NaN codes itself); the same loop gives the flag
        with one OR per element, so that the two answers are compared whole (tests/backends/test_host_kernels.py)."""
        slot = getattr(self._local, "slot", None)
        if slot is None:
            slot = self._local.slot = ctypes.c_float(0.0)
            self._local.address = ctypes.addressof(slot)
        nan = self._amax(pointer, numel, self._local.address)
        return slot.value, bool(nan)

    def cast(
        self, pointer: int, m: int, k: int, scale: float, fmt: str, clip: bool, fp8_max: float, row: int, col: int
    ) -> None:
        """The FP8 codes (`fmt` "E4M3" or "E5M2") of the [m, k] fp32 values at `pointer` times `scale`, clamped to
        ±fp8_max first when `clip`, NaN as 0x7F: into `row` ([m, k], always) and `col` ([k, m], the transpose; 0
        for none).  Without `clip` no product may reach the format's overflow threshold (the caller checks the
        amax)."""
        self._cast(pointer, m, k, scale, 1 if fmt == "E5M2" else 0, 1 if clip else 0, fp8_max, row, col or None)


_env = environ_value(ENV_VAR)


class use_host_kernels:  # noqa: N801 - reads as a function at call sites
    """Choose the CPU FP8 cast for this process ("auto" | "c" | "numpy"), over ``$TEDEBUG_HOST_KERNELS``; as a
    context manager, restore the previous choice on exit (as `dispatch.use_backend` does for the GPU kernels)."""

    def __init__(self, mode: str) -> None:
        global _override
        self.mode = _check_mode(mode, "use_host_kernels")
        self._previous = _override
        _override = self.mode

    def __enter__(self) -> "use_host_kernels":
        return self

    def __exit__(self, *exc: object) -> None:
        global _override
        _override = self._previous


_override: Optional[str] = None
#: (raw value of $TEDEBUG_HOST_KERNELS, the mode it names): checked again only when the value changes
_env_parsed: Tuple[Any, str] = (None, "auto")  # (the raw value last seen, its checked mode)


def _check_mode(value: str, where: str) -> str:
    mode = value.strip().lower() if isinstance(value, str) else value
    if mode not in _MODES:
        raise ValueError(f"{where}={value!r}: expected one of {_MODES}")
    return mode


def requested_mode() -> str:
    """The CPU FP8 cast asked for: `use_host_kernels`' choice, else ``$TEDEBUG_HOST_KERNELS`` (read at every call),
    else ``"auto"``."""
    global _env_parsed
    if _override is not None:
        return _override
    raw = _env.raw()
    if raw is not _env_parsed[0]:  # (the same object while the variable is unchanged: `tedebug.backends.environ`)
        _env_parsed = (raw, "auto" if raw is None else _check_mode(_env.decode(raw), f"environment variable {ENV_VAR}"))
    return _env_parsed[1]


def host_fp8() -> Optional[HostFp8]:
    """The compiled helpers, or None where the numpy path runs (asked for, or "auto" and they could not be built);
    raises `HostKernelError` when "c" is asked for and they could not be built."""
    mode = requested_mode()
    if mode == "numpy":
        return None
    built = _BUILD.outcome
    helpers, reason = built if built is not None else _BUILD.get(warn=mode == "auto")
    if helpers is None and mode == "c":
        raise HostKernelError(
            f'the CPU FP8 cast "c" was asked for (use_host_kernels / ${ENV_VAR}), but the compiled helpers '
            f"({SOURCE_NAME}) are unavailable: {reason}"
        )
    return helpers


def unavailable_reason() -> str:
    """Why the compiled helpers are not used ("" when they are, or were not asked for yet)."""
    return _BUILD.reason()


def _build_and_load() -> Tuple[Optional[HostFp8], str]:
    """The loaded helpers and "", or None and why (`build_and_load`)."""
    return build_and_load(lambda path: HostFp8(ctypes.CDLL(str(path)), path))


def _failure_warning(why: str) -> Optional[str]:
    """A compiler that fails is not what this machine should do: said once (mode "auto"), then the numpy path
    runs.  A machine without a compiler is not warned about."""
    if compiler() is None:
        return None
    return (
        f"tedebug: the compiled CPU helpers ({SOURCE_NAME}) could not be built ({why}); per-tensor FP8 on the CPU "
        f"uses numpy instead (the same values, slower). {ENV_VAR}=numpy chooses that and silences this warning."
    )


#: the one build of the process (`host_fp8` asks for it; the warning names the caller of `host_fp8`'s caller)
_BUILD: BuildOnce[HostFp8] = BuildOnce(_build_and_load, _failure_warning, stacklevel=4)


def build_and_load(load: Callable[[Path], T], **build_options: Any) -> Tuple[Optional[T], str]:
    """``load(path)`` of the library `build` makes (with `build_options`) and "", or None and why: built in
    `cache_dir()`, else (that folder cannot be written or its library cannot be loaded) in a private folder under
    the temporary directory (`fallback_dir`)."""
    if _compiler_for(build_options.get("cxx", False)) is None:
        return None, _NO_COMPILER[build_options.get("cxx", False)]
    reasons = []
    for directory, private in ((cache_dir(), False), (fallback_dir(), True)):
        try:
            if private:
                _make_private(directory)
            return load(build(directory, **build_options)), ""
        except (HostKernelError, subprocess.SubprocessError) as exc:  # the compiler itself: another folder won't help
            return None, str(exc)
        except (OSError, AttributeError, ImportError) as exc:  # the folder, or loading the library from it
            reasons.append(f"{directory}: {type(exc).__name__}: {exc}")
    return None, "; ".join(reasons)


def cache_dir() -> Path:
    """Where the built library is kept: ``$TEDEBUG_CACHE_DIR``, else ``$XDG_CACHE_HOME/tedebug``, else
    ``~/.cache/tedebug``."""
    explicit = os.environ.get("TEDEBUG_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tedebug"


def fallback_dir() -> Path:
    """The folder of the library when `cache_dir()` cannot hold it: ``tedebug-<uid>`` in the temporary directory."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return Path(tempfile.gettempdir()) / f"tedebug-{uid}"


def _make_private(directory: Path) -> None:
    """Create `directory` readable and writable by this user only, or check that it already is and belongs to
    this user (a library loaded from a folder others can write to would run their code); OSError otherwise."""
    directory.mkdir(mode=0o700, exist_ok=True)
    status = directory.stat()
    owner_ok = not hasattr(os, "getuid") or status.st_uid == os.getuid()
    if not owner_ok or status.st_mode & 0o022:
        raise PermissionError(f"{directory} is not a private folder of this user; not loading code from it")


def compiler() -> Optional[str]:
    """The C compiler: ``$CC`` when set, else the first of cc, gcc and clang on PATH (None when there is none)."""
    return _find_compiler("CC", ("cc", "gcc", "clang"))


def cxx_compiler() -> Optional[str]:
    """The C++ compiler: ``$CXX`` when set, else the first of c++, g++ and clang++ on PATH (None when there is
    none)."""
    return _find_compiler("CXX", ("c++", "g++", "clang++"))


def _find_compiler(variable: str, names: Tuple[str, ...]) -> Optional[str]:
    named = os.environ.get(variable)
    if named:
        return shutil.which(named) or named
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def _compiler_for(cxx: bool) -> Optional[str]:
    return cxx_compiler() if cxx else compiler()


#: why nothing was built, by whether C++ was asked for
_NO_COMPILER = {
    False: "no C compiler ($CC, cc, gcc or clang) on PATH",
    True: "no C++ compiler ($CXX, c++, g++ or clang++) on PATH",
}


def build(
    directory: Path,
    source_name: str = SOURCE_NAME,
    flags: Tuple[str, ...] = FLAGS,
    libraries: Tuple[str, ...] = ("-lm",),
    digest_extra: str = "",
    cxx: bool = False,
    timeout: float = 120.0,
) -> Path:
    """The shared library of ``kernels/<source_name>`` (``host_fp8.c`` unless told) in `directory`, compiled with
    `flags` (by the C++ compiler when `cxx`, else the C compiler) and linked with `libraries` there unless a
    library of the same source, compiler, flags and `digest_extra` (what else the build depends on: the Python
    headers of an extension module) already is; raises `HostKernelError` naming the compiler's complaint, or
    that it ran longer than `timeout` seconds."""
    cc = _compiler_for(cxx)
    if cc is None:
        raise HostKernelError(_NO_COMPILER[cxx])
    path = kernel_dir() / source_name
    source = path.read_bytes()
    digest = hashlib.sha256()
    for part in (source, cc.encode(), " ".join(flags + libraries).encode(), platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    if digest_extra:
        digest.update(digest_extra.encode())
    stem = Path(source_name).stem
    target = directory / f"{stem}-{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory / f".{target.stem}.lock", timeout):
        if target.exists():  # built by another process while this one waited
            return target
        handle, temporary = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=directory)
        os.close(handle)
        try:
            command = [cc, *flags, "-o", temporary, str(path), *libraries]
            returncode, complaint = _compile(command, timeout)
            if returncode != 0:
                raise HostKernelError(
                    f"{' '.join(command)} failed (exit status {returncode})" + (f":\n{complaint}" if complaint else "")
                )
            os.replace(temporary, target)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return target


#: how often a builder waiting for another's build lock tries again (seconds)
_LOCK_POLL_S = 0.05
#: the descriptors `_build_lock` has open in this process.  A child forked while a build holds its lock gets a
#: copy of the descriptor, and a flock lasts until every copy is closed: the child closes its copies at once, or
#: the parent's lock would outlive the parent's build and hold up the child's own build until its time-out.
_LOCK_DESCRIPTORS: set = set()
#: held while a build opens its lock file or starts the compiler, and by a fork (`os.register_at_fork`), so that no
#: process is forked in the middle of either.  A build runs in a background thread while the program may fork
#: (DataLoader workers): a child forked between the compiler's pipes being made and the parent closing its ends of
#: them keeps those ends open, and the parent, which reads the compiler's output to its end, then waits for the
#: child instead of the compiler, until the build's time-out (minutes; the process waits for the build at exit)
_FORK_GUARD = threading.RLock()


def _before_fork() -> None:
    _FORK_GUARD.acquire()


def _after_fork_in_parent() -> None:
    _FORK_GUARD.release()


def _after_fork_in_child() -> None:
    global _FORK_GUARD
    _FORK_GUARD = threading.RLock()
    for descriptor in list(_LOCK_DESCRIPTORS):
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _LOCK_DESCRIPTORS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _compile(command: List[str], timeout: float) -> Tuple[int, str]:
    """Run the compiler `command`: (its exit status, its stderr), or `subprocess.TimeoutExpired` (the compiler
    killed) after `timeout` seconds.  Started under `_FORK_GUARD`."""
    with _FORK_GUARD:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return process.returncode, stderr.strip()


@contextlib.contextmanager
def _build_lock(path: Path, timeout: float) -> Iterator[bool]:
    """Hold the lock file `path` (an exclusive ``flock``) while a library is built, so that the ranks of one
    machine compile it once: the others wait, then find it built.  Yields whether it is held: not where locks
    are unavailable (no ``fcntl``, a file system that refuses them) nor after `timeout` seconds of waiting; the
    caller then builds without it, which stays safe (each build renames a whole file into place).  The holder
    removes the lock file when it is done, so the folder keeps only libraries; a waiter that then takes the lock
    of the removed file finds the library built (or, after a failed build, compiles beside a newcomer: safe, as
    above).  The lock is released when the holder closes the file, also when the holder dies; a process forked
    meanwhile closes its copy of the file at once (`_LOCK_DESCRIPTORS`), and a program it runs gets none."""
    descriptor = -1
    held = False
    if fcntl is not None:
        try:
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            with _FORK_GUARD:
                descriptor = os.open(path, flags, 0o600)
                _LOCK_DESCRIPTORS.add(descriptor)
        except OSError:
            descriptor = -1
    try:
        deadline = time.monotonic() + timeout
        while descriptor >= 0:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:  # another builder holds it
                if time.monotonic() >= deadline:
                    break
                time.sleep(_LOCK_POLL_S)
            except OSError:  # locks refused here
                break
        yield held
    finally:
        if held:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if descriptor >= 0:
            _LOCK_DESCRIPTORS.discard(descriptor)
            os.close(descriptor)  # (releases the lock)


def python_include() -> Optional[Path]:
    """The folder of the running interpreter's ``Python.h``, or None when it is not installed."""
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return None
    return Path(include)


def interpreter_tag() -> str:
    """What an extension module is built for: the running interpreter's version and ABI (part of its file's
    digest)."""
    return f"{sys.implementation.cache_tag} {sys.version} {sysconfig.get_config_var('SOABI')}"


def load_extension_module(name: str, path: Path) -> ModuleType:
    """The CPython extension module `name` in the shared library `path` (built by `build`), imported from there
    (not from ``sys.path``); ImportError when it cannot be."""
    loader = importlib.machinery.ExtensionFileLoader(name, os.fspath(path))
    spec = importlib.util.spec_from_file_location(name, os.fspath(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path} as {name}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _reset_for_tests() -> None:
    """Forget the build (tests that point the cache or the compiler elsewhere)."""
    _BUILD.forget()


__all__ = [
    "ENV_VAR",
    "HostFp8",
    "HostKernelError",
    "build",
    "build_and_load",
    "cache_dir",
    "compiler",
    "cxx_compiler",
    "fallback_dir",
    "interpreter_tag",
    "load_extension_module",
    "python_include",
    "host_fp8",
    "requested_mode",
    "unavailable_reason",
    "use_host_kernels",
]
