"""Config errors: `ConfigError` (a ValueError) and the location-aware issues it carries.

Every problem found in a config is one `ConfigIssue`: the key path inside the config (a tuple whose first element is
the section name), a message, the line in the YAML file when known, what was expected, and the closest valid name.
A `ConfigError` holds one or more issues (all problems found in one load are reported together) and renders one
line per issue, e.g.

    config.yaml:7: section 'log_stats' -> layers -> layer_type: unknown key; did you mean 'layer_types'?
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence

KeyPath = tuple


def closest(name: object, candidates: Iterable[str]) -> Optional[str]:
    """The candidate closest to `name` (difflib ratio >= 0.6), or None when nothing is close."""
    if not isinstance(name, str):
        return None
    pool = sorted(set(candidates))
    found = difflib.get_close_matches(name, pool, n=1)
    if found:
        return found[0]
    # Case-only differences (e.g. 'disablefp8gemm') are below difflib's cut-off for short names.
    by_lower = {c.lower(): c for c in pool}
    return by_lower.get(name.lower())


def format_key_path(key_path: Sequence) -> str:
    """`('s', 'transformer_engine', 'LogTensorStats', 'stats', 2)` -> `section 's' -> ... -> stats[2]`."""
    if not key_path:
        return "config"
    parts = [f"section '{key_path[0]}'"]
    for key in key_path[1:]:
        if isinstance(key, int) and not isinstance(key, bool):
            parts[-1] += f"[{key}]"
        else:
            parts.append(str(key))
    return " -> ".join(parts)


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config, located by its key path (and line, once the loader knows it)."""

    message: str
    key_path: KeyPath = ()
    line: Optional[int] = None
    expected: Optional[str] = None
    suggestion: Optional[str] = None

    def render(self, file: Optional[str]) -> str:
        where = file or "<config>"
        if self.line is not None:
            where += f":{self.line}"
        text = f"{where}: {self.message}"
        if self.key_path:
            text = f"{where}: {format_key_path(self.key_path)}: {self.message}"
        if self.suggestion is not None:
            text += f"; did you mean '{self.suggestion}'?"
        if self.expected is not None:
            text += f" (expected {self.expected})"
        return text


class ConfigError(ValueError):
    """An invalid debug config. `file`, `key_path`, `line` and `expected` describe the first issue; `issues` all."""

    def __init__(
        self,
        message: str = "",
        *,
        file: Optional[str] = None,
        key_path: Sequence = (),
        line: Optional[int] = None,
        expected: Optional[str] = None,
        suggestion: Optional[str] = None,
        issues: Optional[Sequence[ConfigIssue]] = None,
    ):
        if issues is None:
            issues = [ConfigIssue(message, tuple(key_path), line, expected, suggestion)]
        if not issues:
            raise ValueError("ConfigError needs at least one issue")
        self.issues = list(issues)
        self.file = file
        super().__init__(self._render())

    def _render(self) -> str:
        return "\n".join(issue.render(self.file) for issue in self.issues)

    @property
    def key_path(self) -> KeyPath:
        return self.issues[0].key_path

    @property
    def line(self) -> Optional[int]:
        return self.issues[0].line

    @property
    def expected(self) -> Optional[str]:
        return self.issues[0].expected

    @property
    def suggestion(self) -> Optional[str]:
        return self.issues[0].suggestion

    def located(self, file: Optional[str], line_of) -> "ConfigError":
        """A copy with `file` set and every issue without a line given `line_of(key_path)`."""
        issues = [i if i.line is not None else replace(i, line=line_of(i.key_path)) for i in self.issues]
        return ConfigError(file=file, issues=issues)
