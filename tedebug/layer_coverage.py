"""Model-aware validation: the real layer names of a run or a model, and which config sections select them.

`tedebug validate` / `tedebug plan` use this to answer "what does my config select in *this* model?" before (or
after) training:

- `layers_from_run(run_dir)`: the layer names a run logged, read from its JSONL record
  (``<run>/tedebug_statistics/*.jsonl``, field ``layer``) or, when there is none, from its statistics text logs
  (``<run>/nvdlfw_inspect_statistics_logs/*.log``, metric names ``<layer>_<tensor>_<stat>``).  A path to one such
  file is accepted too.  Only layers that logged at least one statistic appear.
- `layers_from_model("module:factory")`: imports ``module`` (a dotted module name importable from the current
  directory, or a path to a ``.py`` file), calls ``factory()`` (a dotted attribute path; a module instance is used
  as is), converts the model with `tedebug.convert_model` (unless it already contains tedebug layers: then the
  factory chose which layers to convert) and returns the names of its tedebug layers.  While the model is imported
  and built, the current directory (or the ``.py`` file's directory) is first on ``sys.path``; it is taken off
  afterwards, so the call leaves ``sys.path`` as it found it.
- `coverage(config, layers)`: per enabled section, the layers it selects; the sections that select nothing; the
  layers no section selects; the layers two or more sections select (an error once training calls a hook).

Errors in the user's input (a run dir without logs, a module that does not import, a factory that fails) raise
`LayerSourceError` with a message naming the path or the ``module:factory`` spec.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Tuple

from tedebug.config.parsing import TENSOR_NAMES

JSONL_GLOB = os.path.join("tedebug_statistics", "*.jsonl")
STATS_LOG_GLOB = os.path.join("nvdlfw_inspect_statistics_logs", "*.log")

# A statistics text line: "<asctime> - <LEVEL> - <name> \t\t\t\t iteration=000020 \t\t\t\t value=1.4388".
_STATS_LINE = re.compile(r" - [A-Z]+ - (?P<name>.+?) \t+ iteration=\d+ \t+ value=")
# The tensor part of a metric name; the last match splits "<layer>_<tensor>_<stat>" (no statistic name contains
# one of these words between underscores, so the rightmost match is the tensor).
_TENSOR_PART = re.compile(r"_(?:" + "|".join(TENSOR_NAMES) + r")_")


class LayerSourceError(ValueError):
    """A run directory or a ``module:factory`` spec that yields no layer names."""


# ------------------------------------------------------------------------------------------------- sources
def layer_of_metric(name: str):
    """The layer part of a ``<layer>_<tensor>_<stat>`` metric name, or None when it has no tensor part."""
    last = None
    for last in _TENSOR_PART.finditer(name):
        pass
    if last is None or last.start() == 0:
        return None
    return name[: last.start()]


def _layers_from_jsonl(paths: Iterable[str]) -> List[str]:
    seen: Dict[str, None] = {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if '"layer"' not in line:
                    continue
                try:
                    layer = json.loads(line).get("layer")
                except json.JSONDecodeError as err:
                    if not line.endswith("\n"):  # a run still writing: its last line may be incomplete
                        continue
                    raise LayerSourceError(f"{path}:{number}: not a JSON record ({err.msg})") from None
                if isinstance(layer, str):
                    seen.setdefault(layer, None)
    return list(seen)


def _layers_from_stats_logs(paths: Iterable[str]) -> List[str]:
    seen: Dict[str, None] = {}
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                match = _STATS_LINE.search(line)
                if match is None:
                    continue
                layer = layer_of_metric(match.group("name"))
                if layer is not None:
                    seen.setdefault(layer, None)
    return list(seen)


def layers_from_run(run_dir: str) -> Tuple[List[str], str]:
    """``(layer names in first-logged order, description of the source)``; see the module docstring."""
    if os.path.isfile(run_dir):
        reader = _layers_from_jsonl if run_dir.endswith(".jsonl") else _layers_from_stats_logs
        files = [run_dir]
    elif os.path.isdir(run_dir):
        files = sorted(glob.glob(os.path.join(run_dir, JSONL_GLOB)))
        reader = _layers_from_jsonl
        if not files:
            files = sorted(glob.glob(os.path.join(run_dir, STATS_LOG_GLOB)))
            reader = _layers_from_stats_logs
        if not files:
            raise LayerSourceError(
                f"{run_dir}: no statistics found (expected {JSONL_GLOB} or {STATS_LOG_GLOB} "
                f"under it: the log_dir given to debug_api.initialize)"
            )
    else:
        raise LayerSourceError(f"{run_dir}: no such run directory")
    layers = reader(files)
    if not layers:
        raise LayerSourceError(f"{run_dir}: the run logged no per-layer statistic (read {', '.join(files)})")
    kind = "JSONL record" if reader is _layers_from_jsonl else "statistics text log"
    return layers, f"{len(layers)} layer(s) logged in {run_dir} ({kind})"


def _is_file(module_part: str) -> bool:
    return module_part.endswith(".py") or os.sep in module_part


@contextlib.contextmanager
def _first_on_path(directory: str):
    """`directory` first on sys.path while the user's model is imported and built (a model file's sibling modules,
    or the packages of the current directory, import from there), and off it again afterwards."""
    if directory in sys.path:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        sys.path.remove(directory)


def _import_module(module_part: str):
    if not _is_file(module_part):
        return importlib.import_module(module_part)
    path = os.path.abspath(module_part)
    if not os.path.isfile(path):
        raise LayerSourceError(f"--model {module_part}: no such file")
    name = "tedebug_model_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def layers_from_model(spec: str) -> Tuple[List[str], str]:
    """``(names of the tedebug layers of the converted model, description)``; see the module docstring."""
    from tedebug.nn.base import BaseLayer
    from tedebug.nn.convert import convert_model

    module_part, sep, attribute = spec.rpartition(":")
    if not sep or not module_part or not attribute:
        raise LayerSourceError(
            f"--model {spec!r}: expected MODULE:FACTORY, e.g. examples.gpt:build_model or path/to/model.py:make_model"
        )
    directory = os.path.dirname(os.path.abspath(module_part)) if _is_file(module_part) else os.getcwd()
    with _first_on_path(directory):
        model = _built_model(spec, module_part, attribute)
    converted = not any(isinstance(m, BaseLayer) for m in model.modules())
    if converted:  # a factory that returns tedebug layers already chose which layers to convert
        convert_model(model)
    layers = list(dict.fromkeys(m.name for m in model.modules() if isinstance(m, BaseLayer)))
    if not layers:
        raise LayerSourceError(f"--model {spec}: the model has no torch.nn.Linear (or tedebug) layer to debug")
    how = "after tedebug.convert_model" if converted else "(the factory's own conversion)"
    return layers, f"{len(layers)} tedebug layer(s) of {spec} {how}"


def _built_model(spec: str, module_part: str, attribute: str):
    """The torch.nn.Module `spec` names: the module's attribute itself, or what the factory it names returns."""
    import torch

    try:
        target = _import_module(module_part)
    except LayerSourceError:
        raise
    except Exception as err:
        raise LayerSourceError(
            f"--model {spec}: importing {module_part!r} failed: {type(err).__name__}: {err}"
        ) from err
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise LayerSourceError(f"--model {spec}: {module_part!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if isinstance(target, torch.nn.Module):
        model = target
    elif callable(target):
        try:
            model = target()
        except Exception as err:
            raise LayerSourceError(
                f"--model {spec}: calling {attribute}() failed: {type(err).__name__}: {err}"
            ) from err
    else:
        raise LayerSourceError(
            f"--model {spec}: {attribute} is a {type(target).__name__}, expected a function "
            f"returning a torch.nn.Module (or a module)"
        )
    if not isinstance(model, torch.nn.Module):
        raise LayerSourceError(
            f"--model {spec}: {attribute}() returned a {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


# ------------------------------------------------------------------------------------------------- coverage
@dataclass
class Coverage:
    """Which section selects which layer (see `coverage`)."""

    layers: List[str]
    by_section: Dict[str, List[str]] = field(default_factory=dict)
    unselected: List[str] = field(default_factory=list)
    overlaps: Dict[str, List[str]] = field(default_factory=dict)  # layer -> the 2+ sections selecting it

    @property
    def empty_sections(self) -> List[str]:
        return [name for name, layers in self.by_section.items() if not layers]

    def selected(self) -> List[str]:
        """The layers some section selects, in the order of `layers`."""
        unselected = set(self.unselected)
        return [layer for layer in self.layers if layer not in unselected]


def coverage(config, layers: Iterable[str]) -> Coverage:
    """Match every layer against every enabled section of a `CompiledConfig`."""
    result = Coverage(list(layers), {name: [] for name in config.sections})
    for layer in result.layers:
        matching = [name for name, section in config.sections.items() if section.matches(layer)]
        for name in matching:
            result.by_section[name].append(layer)
        if not matching:
            result.unselected.append(layer)
        elif len(matching) > 1:
            result.overlaps[layer] = matching
    return result


def format_coverage(config, result: Coverage, source: str) -> List[str]:
    """The report lines of `tedebug validate --layers-from/--model`."""
    lines = [f"layers: {source}"]
    total = len(result.layers)
    for name, layers in result.by_section.items():
        section = config.sections[name]
        where = f" (line {section.line})" if section.line is not None else ""
        if not layers:
            lines.append(f"warning: section '{name}'{where} selects no layer ({section.selector.describe()})")
            continue
        lines.append(f"section '{name}'{where} selects {len(layers)} of {total} layer(s):")
        lines.extend(f"  {layer}" for layer in layers)
    if result.unselected:
        lines.append(f"{len(result.unselected)} layer(s) no section selects (they train without debug features):")
        lines.extend(f"  {layer}" for layer in result.unselected)
    else:
        lines.append("every layer is selected by a section")
    for layer, sections in result.overlaps.items():
        lines.append(
            f"error: layer '{layer}' is selected by {len(sections)} sections ("
            + ", ".join(f"'{s}'" for s in sections)
            + "); training raises at its first hook call"
        )
    return lines
