"""The backends sit below the quantizers: no module of `tedebug.backends` imports `tedebug.quantization`,
`tedebug.nn` or `tedebug.debug_api` (kernels return raw buffers, the quantizers build their tensors).

The check reads the sources (every ``import`` statement, also inside functions, relative ones resolved), so an
import that only runs on a GPU path is caught on a CPU machine too."""

import ast
from pathlib import Path

import tedebug.backends

FORBIDDEN = ("tedebug.quantization", "tedebug.nn", "tedebug.debug_api")
BACKENDS_DIR = Path(tedebug.backends.__file__).resolve().parent


def _imported_modules(tree: ast.AST, package: str):
    """(line, dotted module name) of every import in `tree`; `package` resolves relative imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from tedebug import nn` imports tedebug.nn
                yield node.lineno, f"{module}.{alias.name}"


def layering_violations(directory: Path, package: str):
    """'file:line imports module' for every forbidden import in the ``*.py`` files of `directory`."""
    found = []
    for path in sorted(directory.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imported_modules(tree, package):
            if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN):
                found.append(f"{path.name}:{line} imports {module}")
    return found


def test_backends_never_import_the_layers_above():
    violations = layering_violations(BACKENDS_DIR, "tedebug.backends")
    assert not violations, (
        "tedebug.backends must not import tedebug.quantization / tedebug.nn / tedebug.debug_api (return raw "
        "buffers; the quantizers build their tensors):\n" + "\n".join(violations)
    )


def test_the_scan_finds_every_form_of_import(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "from tedebug.quantization.formats import FP8_MAX\n"
        "def f():\n"
        "    import tedebug.nn.base\n"
        "    from ..quantization import tensor\n"
        "    from tedebug import debug_api\n"
        "    from tedebug.backends import dispatch\n"
    )
    (tmp_path / "good.py").write_text("from tedebug.format_constants import FP8_MAX\nfrom . import torch_ref\n")
    assert layering_violations(tmp_path, "tedebug.backends") == [
        "bad.py:2 imports tedebug.quantization.formats",
        "bad.py:2 imports tedebug.quantization.formats.FP8_MAX",
        "bad.py:4 imports tedebug.nn.base",
        "bad.py:5 imports tedebug.quantization",
        "bad.py:5 imports tedebug.quantization.tensor",
        "bad.py:6 imports tedebug.debug_api",
    ]
