"""Layer selection: does a section's `layers:` selector pick a given layer name?

Order of the rules (TransformerEngine's, except where noted):
1. `exact_layer_names`: the listed names are selected, every other name is not (TransformerEngine raises for other
   names; we simply do not select them). The other keys are ignored when this key is present.
2. `layer_name_regex_pattern`: selected iff `re.search(pattern, name)` finds a match anywhere (unanchored).
   `layer_types` and `layer_numbers` are ignored.
3. `layer_types` and `layer_numbers`, AND-ed when both are given:
   - types: any listed string is a case-sensitive substring of the name (`"fc1"` matches `"fc12"`), or the list
     contains `"all"`;
   - numbers: the layer number is the one digit run not directly preceded by the letters `fc` (found with
     `re.findall(r"(?<!fc)\\d+", name)`, so in `"fc12"` the run `"2"` counts). `"all"` selects every layer,
     whatever its name. Otherwise a name with no such run, or with more than one, is not selected (TransformerEngine
     raises IndexError / ValueError there). Ranges `"a-b"` are inclusive.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Union

_NUMBER_RUN = re.compile(r"(?<!fc)\d+")
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def _is_all(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "all"


def parse_layer_numbers(spec: Union[int, str, Iterable]) -> Optional[frozenset]:
    """The set of selected layer numbers, or None meaning "all". Accepts an int, "all", "a-b", or a list of those."""
    items = [spec] if isinstance(spec, (int, str)) else list(spec)
    numbers = set()
    for item in items:
        if _is_all(item):
            return None
        if isinstance(item, int) and not isinstance(item, bool):
            numbers.add(item)
            continue
        if isinstance(item, str) and item.strip().isdigit():
            numbers.add(int(item))
            continue
        match = _RANGE.match(item) if isinstance(item, str) else None
        if match is None:
            raise ValueError(f"invalid layer_numbers entry {item!r}; expected an int, a range 'a-b' or 'all'")
        low, high = int(match.group(1)), int(match.group(2))
        if low > high:
            raise ValueError(f"invalid layer_numbers range {item!r}: start {low} > end {high}")
        numbers.update(range(low, high + 1))
    return frozenset(numbers)


def layer_number(name: str) -> Optional[int]:
    """The layer number in `name` (the single digit run not preceded by 'fc'), or None when there is not exactly one."""
    runs = _NUMBER_RUN.findall(name)
    return int(runs[0]) if len(runs) == 1 else None


class LayerSelector:
    """A compiled `layers:` selector. Build it once per section; `matches(name)` is then cheap."""

    def __init__(self, *, layer_name_regex_pattern=None, layer_types=None, layer_numbers=None, exact_layer_names=None):
        if all(v is None for v in (layer_name_regex_pattern, layer_types, layer_numbers, exact_layer_names)):
            raise ValueError(
                "at least one of 'layer_numbers', 'layer_types', 'exact_layer_names' or "
                "'layer_name_regex_pattern' must be provided"
            )
        self.exact_names = None if exact_layer_names is None else frozenset(exact_layer_names)
        self.regex = None if layer_name_regex_pattern is None else re.compile(layer_name_regex_pattern)
        if isinstance(layer_types, str):
            layer_types = [layer_types]
        self.types = None if layer_types is None else tuple(layer_types)
        self.all_types = self.types is not None and "all" in self.types
        self.uses_numbers = layer_numbers is not None
        self.numbers = parse_layer_numbers(layer_numbers) if self.uses_numbers else None

    @classmethod
    def from_spec(cls, spec: dict) -> "LayerSelector":
        """Build from a `layers:` mapping (already validated by the schema)."""
        return cls(**spec)

    def _type_matches(self, name: str) -> bool:
        return self.all_types or any(t in name for t in self.types or ())

    def _number_matches(self, name: str) -> bool:
        if self.numbers is None:  # "all"
            return True
        number = layer_number(name)
        return number is not None and number in self.numbers

    def matches(self, name: str) -> bool:
        if self.exact_names is not None:
            return name in self.exact_names
        if self.regex is not None:
            return self.regex.search(name) is not None
        if self.types is not None and not self._type_matches(name):
            return False
        if self.uses_numbers and not self._number_matches(name):
            return False
        return True

    def describe(self) -> str:
        """A one-line human description, used by `CompiledConfig.summary()`."""
        if self.exact_names is not None:
            return f"exact_layer_names={sorted(self.exact_names)}"
        if self.regex is not None:
            return f"layer_name_regex_pattern={self.regex.pattern!r}"
        parts = []
        if self.types is not None:
            parts.append(f"layer_types={list(self.types)}")
        if self.uses_numbers:
            parts.append("layer_numbers=all" if self.numbers is None else f"layer_numbers={sorted(self.numbers)}")
        return " AND ".join(parts)
