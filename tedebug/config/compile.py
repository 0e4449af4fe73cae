"""The compiled config: enabled sections with their layer selectors, and the per-layer lookup.

`CompiledConfig.layer_config(name)` returns `{namespace: {feature name: raw feature config}}` for the one enabled
section that selects the layer, `{}` when none does. Results are cached per layer name; when two enabled sections
select the same layer a `ConfigError` naming both is raised on every lookup (errors are not cached). The returned
dicts are shared with the cache: treat them as read-only (`parsing.parse_feature_config` deep-copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .errors import ConfigError
from .selection import LayerSelector

_MAX_SUMMARY_VALUE = 60


@dataclass(frozen=True)
class CompiledSection:
    """One enabled section: its name, selector, features per namespace, and line in the YAML file (if known)."""

    name: str
    selector: LayerSelector
    features: dict
    line: Optional[int] = None

    def matches(self, layer_name: str) -> bool:
        return self.selector.matches(layer_name)


class CompiledConfig:
    """All enabled sections of a config, plus the cached per-layer lookup."""

    def __init__(self, sections: dict, source_label: str, *, disabled_sections: tuple = ()):
        self.sections = dict(sections)
        self.source_label = source_label
        self.disabled_sections = tuple(disabled_sections)
        self._cache: dict = {}

    @classmethod
    def empty(cls, source_label: str = "<no config>") -> "CompiledConfig":
        return cls({}, source_label)

    @classmethod
    def from_specs(cls, specs, source_label: str, line_of: Optional[Callable] = None) -> "CompiledConfig":
        """Compile validated `schema.SectionSpec`s: build one selector per enabled section."""
        line_of = line_of or (lambda path: None)
        sections, disabled = {}, []
        for spec in specs:
            if not spec.enabled:
                disabled.append(spec.name)
                continue
            selector = LayerSelector.from_spec(spec.layers)
            sections[spec.name] = CompiledSection(spec.name, selector, spec.features, line_of((spec.name,)))
        return cls(sections, source_label, disabled_sections=tuple(disabled))

    @property
    def is_empty(self) -> bool:
        return not self.sections

    def layer_config(self, layer_name: str) -> dict:
        cached = self._cache.get(layer_name)
        if cached is not None:
            return cached
        matching = [section for section in self.sections.values() if section.matches(layer_name)]
        if len(matching) > 1:
            names = ", ".join(f"'{s.name}'" for s in matching)
            raise ConfigError(
                f"Found multiple debug configs targeting the same layer(s): layer '{layer_name}' is selected by "
                f"sections {names}",
                file=self.source_label,
                key_path=(matching[1].name,),
                line=matching[1].line,
                expected="at most one enabled section per layer",
            )
        result = matching[0].features if matching else {}
        self._cache[layer_name] = result
        return result

    def selected_section(self, layer_name: str) -> Optional[str]:
        """The name of the section selecting the layer, or None (raises like `layer_config` on overlaps)."""
        self.layer_config(layer_name)
        return next((s.name for s in self.sections.values() if s.matches(layer_name)), None)

    def summary(self) -> str:
        """A human-readable description of the sections, selectors and features (used by `tedebug validate`)."""
        lines = [f"config: {self.source_label}"]
        if self.is_empty:
            lines.append("  no enabled section: every layer is unselected")
        for section in self.sections.values():
            where = f" (line {section.line})" if section.line is not None else ""
            lines.append(f"section '{section.name}'{where}")
            lines.append(f"  layers: {section.selector.describe()}")
            if not section.features:
                lines.append("  no features")
            for namespace, features in section.features.items():
                lines.append(f"  {namespace}:")
                for feature, cfg in features.items():
                    lines.append(f"    {feature}: {_describe_feature(cfg)}")
        if self.disabled_sections:
            lines.append("disabled sections: " + ", ".join(str(n) for n in self.disabled_sections))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CompiledConfig({self.source_label!r}, sections={list(self.sections)})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SUMMARY_VALUE else text[: _MAX_SUMMARY_VALUE - 3] + "..."


def _describe_feature(cfg: dict) -> str:
    state = "enabled" if cfg.get("enabled") else "disabled"
    params = ", ".join(f"{key}={_short(value)}" for key, value in cfg.items() if key != "enabled")
    return f"{state}; {params}" if params else state
