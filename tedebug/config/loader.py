"""Config loading: read a YAML file (remembering the line of every key), a dict, or nothing; validate; compile.

`load_config(source, *, feature_names, feature_validators=None) -> CompiledConfig`
- `source` is a path (`str` or `pathlib.Path`) to a YAML file, a `dict` with the same structure, or `""`.
  `""` or a path that does not exist means "no config": a `UserWarning` is issued and every layer is unselected
  (as in the reference). Any other type raises `TypeError`.
- An empty YAML file, a top-level value that is not a mapping, invalid YAML, a duplicated key in one mapping, and
  every schema problem raise `ConfigError` with the file name, key path and line.

The YAML reader is a `yaml.SafeLoader` (same types as `yaml.safe_load`) whose node tree is walked once to record
`key path -> line` for mapping keys and sequence items, before being constructed into plain dicts and lists.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Mapping, Optional

import yaml

from .compile import CompiledConfig
from .errors import ConfigError
from .schema import validate_sections

_MERGE_TAG = "tag:yaml.org,2002:merge"


class LineRecordingLoader(yaml.SafeLoader):
    """A SafeLoader that can also report the line (1-based) of each mapping key and sequence item."""

    def read_with_lines(self):
        """`(data, lines)` for the single document of the stream; data is None for an empty document."""
        node = self.get_single_node()
        if node is None:
            return None, {}
        lines: dict = {}
        self._record(node, (), lines, set())
        return self.construct_document(node), lines

    def _record(self, node, path: tuple, lines: dict, active: set) -> None:
        if id(node) in active:  # a recursive alias: its lines are already recorded
            return
        active.add(id(node))
        if isinstance(node, yaml.MappingNode):
            self._record_mapping(node, path, lines, active)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines.setdefault(path + (index,), item.start_mark.line + 1)
                self._record(item, path + (index,), lines, active)
        active.discard(id(node))

    def _record_mapping(self, node, path: tuple, lines: dict, active: set) -> None:
        first_line: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(f"duplicate key {key!r} (first given at line {first_line[key]})",
                                  key_path=path + (key,), line=line)
            first_line[key] = line
            lines[path + (key,)] = line
            self._record(value_node, path + (key,), lines, active)


def read_yaml(text: str, label: str):
    """Parse YAML text; return `(data, lines)`. Syntax errors become `ConfigError` with the line."""
    loader = LineRecordingLoader(text)
    try:
        return loader.read_with_lines()
    except ConfigError as err:
        raise err.located(label, lambda path: None) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"invalid YAML: {problem}", file=label, line=line) from err
    finally:
        loader.dispose()


def line_finder(lines: Mapping):
    """`line_of(key_path)`: the line of the longest prefix of `key_path` that has a recorded line, or None."""

    def line_of(key_path) -> Optional[int]:
        path = tuple(key_path)
        while path:
            if path in lines:
                return lines[path]
            path = path[:-1]
        return None

    return line_of


def _read_source(source):
    """`(raw config or None for "no config", label, lines)`."""
    if isinstance(source, dict):
        return source, "<dict>", {}
    if not isinstance(source, (str, pathlib.Path)):
        raise TypeError(
            "Config input must be either a filepath (str or Path) or a dictionary, got "
            f"{type(source).__name__}")
    label = os.fspath(source)
    path = pathlib.Path(source)
    if label == "" or not path.exists():
        warnings.warn(f"Could not find config file at {label!r}. Running without config.", UserWarning,
                      stacklevel=3)
        return None, label or "<no config>", {}
    if path.is_dir():
        raise ConfigError("the config path is a directory", file=label, expected="a YAML file")
    data, lines = read_yaml(path.read_text(encoding="utf-8"), label)
    if data is None:
        raise ConfigError("the config file is empty", file=label,
                          expected="a mapping of section name -> section")
    return data, label, lines


def load_config(
    source,
    *,
    feature_names: Mapping[str, set],
    feature_validators: Optional[Mapping] = None,
) -> CompiledConfig:
    """Load, validate and compile a debug config (see the module docstring)."""
    raw, label, lines = _read_source(source)
    if raw is None:
        return CompiledConfig.empty(label)
    line_of = line_finder(lines)
    try:
        specs = validate_sections(raw, feature_names=feature_names, feature_validators=feature_validators)
    except ConfigError as err:
        raise err.located(label, line_of) from None
    return CompiledConfig.from_specs(specs, label, line_of)
