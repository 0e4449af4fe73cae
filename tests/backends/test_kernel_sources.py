"""The kernel sources as `cupy_runtime.get_module` hands them to CuPy: each source is stamped with a digest of the
kernel headers (CuPy's disk cache keys a compiled module on its source text and options, not on the headers the
source includes), and the stamp changes when a header changes and only then.  On the CPU, with a stand-in CuPy that
records what it is asked to compile."""

from types import SimpleNamespace

import pytest

from tedebug.backends import cupy_runtime


def compiled_source(monkeypatch, directory, source="a.cu"):
    """The source text `get_module` gives CuPy for `source` in the kernel folder `directory` (a fresh process's
    view: no module and no stamp cached)."""
    asked = []

    class RawModule:
        def __init__(self, code, options):
            asked.append(code)

        def compile(self):
            pass

    compiler = SimpleNamespace(CompileException=RuntimeError)
    monkeypatch.setattr(
        cupy_runtime, "_cupy", lambda: SimpleNamespace(RawModule=RawModule, cuda=SimpleNamespace(compiler=compiler))
    )
    monkeypatch.setattr(cupy_runtime, "kernel_dir", lambda: directory)
    monkeypatch.setattr(cupy_runtime, "_MODULES", {})
    cupy_runtime.headers_stamp.cache_clear()
    cupy_runtime.get_module(source, ("-DTED_DTYPE=1",))
    (code,) = asked
    return code


def test_the_source_is_stamped_with_its_headers(tmp_path, monkeypatch):
    source = '#include "h.cuh"\nextern "C" __global__ void k() {}\n'
    (tmp_path / "a.cu").write_text(source)
    (tmp_path / "h.cuh").write_text("#pragma once\n// version 1\n")
    first = compiled_source(monkeypatch, tmp_path)
    stamp = first[len(source) :]
    assert first.startswith(source) and stamp.startswith("\n// ") and stamp.count("\n") == 2  # one comment line
    assert compiled_source(monkeypatch, tmp_path) == first  # nothing changed: the same text (the cache is reused)
    (tmp_path / "notes.txt").write_text("not a header")
    assert compiled_source(monkeypatch, tmp_path) == first
    (tmp_path / "h.cuh").write_text("#pragma once\n// version 2\n")  # only the header changes
    second = compiled_source(monkeypatch, tmp_path)
    assert second.startswith(source) and second != first
    (tmp_path / "g.cuh").write_text("#pragma once\n")  # a new header
    assert compiled_source(monkeypatch, tmp_path) not in (first, second)


def test_every_kernel_source_is_packaged():
    """A wheel carries the kernel folder's files by the package-data patterns of pyproject.toml: every source the
    backends build (CUDA, C and C++) must match one, or an installed tedebug could not build it."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11 and newer; the project allows 3.10)

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = [p.name for p in (root / "kernels").iterdir() if p.is_file() and p.suffix != ".py"]
    assert sources and "inspected_linear.cpp" in sources
    missing = [name for name in sources if not any(fnmatch.fnmatch(name, pat) for pat in patterns["tedebug.kernels"])]
    assert missing == []
