"""Config loading: read a YAML file (remembering the line of every key), a dict, or nothing; validate; compile.

`load_config(source, *, feature_names, feature_validators=None) -> CompiledConfig`
- `source` is a path (`str` or `pathlib.Path`) to a YAML file, a `dict` with the same structure, or `""`.
  `""` or a path that does not exist means "no config": a `UserWarning` is issued and every layer is unselected
  (as in TransformerEngine). Any other type raises `TypeError`.
- An empty YAML file, a top-level value that is not a mapping, invalid YAML, a duplicated key in one mapping, and
  every schema problem raise `ConfigError` with the file name, key path and line.

Bounded loading (a config is read before training starts, so a hostile or broken file must fail fast and clearly):
the path must be a regular file (a FIFO, device or directory is refused without opening it for reading), at most
`MAX_CONFIG_BYTES` (1 MiB) long and valid UTF-8; the YAML may nest at most `MAX_NESTING` (64) levels, and after
alias expansion hold at most `MAX_NODES` (100,000) nodes, so "billion laughs" alias bombs are refused before
anything walks the expanded tree.  Every such failure, and every decoding or parsing failure, is a `ConfigError`
naming the file (and the line where known).

The YAML reader is a `yaml.SafeLoader` (same types as `yaml.safe_load`) whose node tree is walked once to record
`key path -> line` for mapping keys and sequence items, before being constructed into plain dicts and lists.
"""

from __future__ import annotations

import os
import pathlib
import stat
import warnings
from typing import Mapping, Optional

import yaml

from .compile import CompiledConfig
from .errors import ConfigError
from .schema import validate_sections

_MERGE_TAG = "tag:yaml.org,2002:merge"

#: the largest config file read (bytes); real configs are a few KiB
MAX_CONFIG_BYTES = 1 << 20
#: the deepest nesting of mappings / sequences accepted (real configs nest fewer than 10 levels)
MAX_NESTING = 64
#: the most nodes a config may hold once its aliases are expanded
MAX_NODES = 100_000

_COLLECTION_START = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_COLLECTION_END = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


#: libyaml's parser when PyYAML was built with it (about 20 times faster than the pure-Python one)
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class LineRecordingLoader(_BASE_LOADER):  # type: ignore[valid-type,misc]  # base chosen at import: C or Python
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
                raise ConfigError(
                    f"duplicate key {key!r} (first given at line {first_line[key]})", key_path=path + (key,), line=line
                )
            first_line[key] = line
            lines[path + (key,)] = line
            self._record(value_node, path + (key,), lines, active)


def _line_of(event: yaml.Event) -> Optional[int]:
    """The 1-based line where a parser event starts (the parser always records it)."""
    return None if event.start_mark is None else event.start_mark.line + 1


def _check_shape(text: str) -> None:
    """`ConfigError` (with the line) when mappings / sequences nest deeper than `MAX_NESTING` or the document,
    aliases expanded, holds more than `MAX_NODES` nodes.  Runs on the event stream (the parser is not recursive),
    before the recursive composer could exhaust the Python stack or anything walks an alias bomb."""
    depth, total = 0, 0
    anchored: dict = {}  # anchor -> expanded node count of its node
    open_counts: list = []  # per open collection: (anchor, expanded count when it started)
    for event in yaml.parse(text, Loader=_BASE_LOADER):
        if isinstance(event, yaml.AliasEvent):
            total += anchored.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor is not None:
                anchored[event.anchor] = 1
        elif isinstance(event, _COLLECTION_START):
            total += 1
            depth += 1
            open_counts.append((event.anchor, total))
            if depth > MAX_NESTING:
                raise ConfigError(
                    f"the YAML nests deeper than {MAX_NESTING} levels",
                    line=_line_of(event),
                    expected=f"at most {MAX_NESTING} nested levels",
                )
        elif isinstance(event, _COLLECTION_END):
            depth -= 1
            anchor, started = open_counts.pop()
            if anchor is not None:
                anchored[anchor] = total - started + 1
        if total > MAX_NODES:
            raise ConfigError(
                f"the config holds more than {MAX_NODES} YAML nodes once its aliases are expanded",
                line=_line_of(event),
                expected=f"at most {MAX_NODES} nodes after alias expansion",
            )


def _yaml_error_line(err: yaml.YAMLError, text: str) -> Optional[int]:
    mark = getattr(err, "problem_mark", None)
    if mark is not None:
        return mark.line + 1
    position = getattr(err, "position", None)  # yaml.reader.ReaderError: a character offset
    if isinstance(position, int):
        return text.count("\n", 0, position) + 1
    return None


def read_yaml(text: str, label: str):
    """Parse YAML text; return `(data, lines)`. Syntax errors become `ConfigError` with the line; so do nesting
    beyond `MAX_NESTING` and alias expansion beyond `MAX_NODES`."""
    loader = None
    try:
        _check_shape(text)
        loader = LineRecordingLoader(text)
        return loader.read_with_lines()
    except ConfigError as err:
        raise err.located(label, lambda path: None) from None
    except yaml.reader.ReaderError as err:
        raise ConfigError(
            f"invalid YAML: the file contains the unprintable character {err.character!r}",
            file=label,
            line=_yaml_error_line(err, text),
            expected="printable UTF-8 text",
        ) from None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"invalid YAML: {problem}", file=label, line=_yaml_error_line(err, text)) from None
    except (ValueError, OverflowError) as err:  # a scalar Python cannot build (e.g. an int of 5000 digits)
        raise ConfigError(f"invalid YAML value: {err}", file=label) from None
    except RecursionError:  # a safety net: `_check_shape` refuses deep nesting first
        raise ConfigError(
            "the YAML nests too deeply", file=label, expected=f"at most {MAX_NESTING} nested levels"
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_config_text(path: pathlib.Path, label: str) -> str:
    """The text of a config file, refusing (with `ConfigError`) what is not a regular file, a file over
    `MAX_CONFIG_BYTES` and bytes that are not UTF-8.  A FIFO or device is never opened (it could block forever)."""
    try:
        info = path.stat()
    except OSError as err:
        raise ConfigError(f"cannot read the config file: {err.strerror or err}", file=label) from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError("the config path is a directory", file=label, expected="a YAML file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            "the config path is not a regular file (a FIFO, socket or device?)",
            file=label,
            expected="a regular YAML file",
        )
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"the config file is {info.st_size} bytes long", file=label, expected=f"at most {MAX_CONFIG_BYTES} bytes"
        )
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):  # replaced between stat and open
                raise ConfigError("the config path is not a regular file", file=label, expected="a regular YAML file")
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"cannot read the config file: {err.strerror or err}", file=label) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("the config file is too long", file=label, expected=f"at most {MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"the config file is not valid UTF-8 (byte {data[err.start]:#04x} at offset {err.start})",
            file=label,
            line=line,
            expected="a UTF-8 text file",
        ) from None


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
    if not isinstance(source, (str, os.PathLike)) or not isinstance(os.fspath(source), str):
        raise TypeError(
            "Config input must be either a filepath (str or Path) or a dictionary, got "
            f"{type(source).__name__}: {source!r}"
        )
    label = os.fspath(source)
    path = pathlib.Path(source)
    if "\0" in label:
        raise ConfigError("the config path contains a NUL character", file=repr(label))
    if label == "" or not os.path.lexists(path):
        warnings.warn(f"Could not find config file at {label!r}. Running without config.", UserWarning, stacklevel=3)
        return None, label or "<no config>", {}
    data, lines = read_yaml(read_config_text(path, label), label)
    if data is None:
        raise ConfigError("the config file is empty", file=label, expected="a mapping of section name -> section")
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
