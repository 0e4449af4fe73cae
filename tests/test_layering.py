"""The import layering of the package: lower modules never import upper ones.

- `tedebug.active` (the active session) is the ground floor: it imports nothing from tedebug at run time;
  `tedebug.memo` imports only `tedebug.active`.
- `tedebug.sinks` and `tedebug.stats` never import `debug_api`, the namespaces, the session or the features.
- Feature code (`tedebug.features`) reads the active session from `tedebug.active`, never from `debug_api`, and
  does not import the namespaces or the session.
- `tedebug.config` imports, from tedebug, only itself and leaf modules: modules that import nothing from tedebug but
  modules that import nothing from tedebug (the statistic definitions it names in its hints, which import only the
  compiled formulas' helpers, `tedebug.compiled_formulas`).

Checked twice: on the source (every import statement, also those inside functions; a ``TYPE_CHECKING`` block does
not count), and in a fresh interpreter (importing every lower module loads none of the upper ones).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Iterator, Set

import pytest

import tedebug
import tedebug.features

PACKAGE_DIR = os.path.dirname(tedebug.__file__)
FEATURES_DIR = tedebug.features.__path__[0]
UPPER = (
    "tedebug.debug_api",
    "tedebug.namespace",
    "tedebug.session",
    "tedebug.debug_quantization",
    "tedebug.nn",
    "tedebug.cli",
)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below `node`, skipping the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if _type_checking_block(child):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def imported_modules(source: str, package: str) -> Set[str]:
    """The absolute names of everything `source` (a module of `package`) imports; ``from a import b`` counts as
    both ``a`` and ``a.b`` (b may be a submodule)."""
    found: Set[str] = set()
    for node in _walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def source_modules(directory: str, prefix: str) -> Iterator[tuple]:
    """(module name, path) of every ``.py`` file under `directory` (module names under `prefix`)."""
    for root, _dirs, files in os.walk(directory):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, directory)[:-3].replace(os.sep, ".")
                yield (prefix if rel == "__init__" else f"{prefix}.{rel.removesuffix('.__init__')}"), path


def tedebug_imports(path: str, module: str) -> Set[str]:
    package = module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]
    with open(path, encoding="utf-8") as f:
        names = imported_modules(f.read(), package)
    return {name for name in names if name == "tedebug" or name.startswith("tedebug.")} - {"tedebug"}


def hits(imports: Set[str], forbidden) -> Set[str]:
    return {name for name in imports if any(name == f or name.startswith(f + ".") for f in forbidden)}


def test_the_scanner_sees_lazy_relative_and_from_imports_but_not_type_checking_ones():
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tedebug.session import DebugSession\n"
        "def f():\n    from tedebug import debug_api\n    from ..namespace import X\n"
        "    import tedebug.nn.gemm\n"
    )
    found = imported_modules(source, "tedebug.sinks")
    assert hits(found, UPPER) == {"tedebug.debug_api", "tedebug.namespace", "tedebug.namespace.X", "tedebug.nn.gemm"}
    assert imported_modules("from .errors import closest\n", "tedebug.config") == {
        "tedebug.config.errors",
        "tedebug.config.errors.closest",
    }
    assert imported_modules("from . import x\n", "tedebug.config") == {"tedebug.config", "tedebug.config.x"}


def test_active_is_the_ground_floor_and_memo_sits_on_it():
    assert tedebug_imports(os.path.join(PACKAGE_DIR, "active.py"), "tedebug.active") == set()
    assert tedebug_imports(os.path.join(PACKAGE_DIR, "memo.py"), "tedebug.memo") == {"tedebug.active"}


@pytest.mark.parametrize("package", ["sinks", "stats"])
def test_sinks_and_stats_import_no_upper_module(package):
    offenders = {}
    for module, path in source_modules(os.path.join(PACKAGE_DIR, package), f"tedebug.{package}"):
        bad = hits(tedebug_imports(path, module), UPPER + ("tedebug.features",))
        if bad:
            offenders[module] = sorted(bad)
    assert offenders == {}


def test_features_read_the_active_session_not_debug_api():
    modules = list(source_modules(FEATURES_DIR, "tedebug.features"))
    assert len(modules) >= 10  # every built-in feature file is scanned
    offenders = {}
    for module, path in modules:
        bad = hits(tedebug_imports(path, module), UPPER)
        if bad:
            offenders[module] = sorted(bad)
    assert offenders == {}


def module_file(name: str):
    """(module, path) of the tedebug module `name` names, or of the module holding it (``a.b.NAME`` -> ``a.b``)."""
    while name.startswith("tedebug."):
        base = os.path.join(PACKAGE_DIR, *name.split(".")[1:])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(path):
                return name, path
        name = name.rpartition(".")[0]
    raise AssertionError(f"no tedebug module behind {name!r}")


def test_config_imports_only_itself_and_leaf_modules():
    outside = {}
    for module, path in source_modules(os.path.join(PACKAGE_DIR, "config"), "tedebug.config"):
        for name in tedebug_imports(path, module):
            if not name.startswith("tedebug.config"):
                outside.setdefault(module_file(name), set()).add(module)
    not_leaves = {
        module: sorted(users)
        for (module, path), users in outside.items()
        if any(tedebug_imports(module_file(name)[1], module_file(name)[0]) for name in tedebug_imports(path, module))
    }
    assert not_leaves == {}


def test_importing_the_lower_modules_loads_no_upper_one():
    code = (
        "import importlib, pkgutil, sys\n"
        "import tedebug.active, tedebug.memo\n"
        "for pkg in ('tedebug.sinks', 'tedebug.stats', 'tedebug.config', 'tedebug.features'):\n"
        "    p = importlib.import_module(pkg)\n"
        "    for m in pkgutil.iter_modules(p.__path__):\n"
        "        importlib.import_module(pkg + '.' + m.name)\n"
        "assert 'tedebug.features.log_tensor_stats' in sys.modules and 'tedebug.sinks.text' in sys.modules\n"
        f"print(sorted(m for m in sys.modules if m.startswith({UPPER!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
