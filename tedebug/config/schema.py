"""Config schema: pydantic models of a section, its `layers:` selector and the generic feature block, the
section-level rules (namespaces, base features, feature names), and the JSON Schema of the whole config.

`validate_sections(raw, ...)` checks a parsed config (a dict of section name -> section) and returns one
`SectionSpec` per section. It reports every problem it finds at once as a `ConfigError` whose issues carry key
paths (the loader adds the file name and line numbers). Rules:
- a section is a mapping with a required `enabled`, a YAML boolean (`True`/`False`/`true`/`false`; the string
  `'False'`, a number or a list is an error, never "truthy") and, when enabled, a required `layers` selector
  (`layer_types` a list, not a string). Disabled sections are validated like enabled ones (only `layers` is optional
  there), so garbage in them is reported;
- other section keys are namespace blocks (`transformer_engine`, or any namespace in `feature_names`) mapping feature
  names to feature configs, or features of namespace `base` placed at section level. A section-level key that is a
  feature of another namespace (`LogTensorStats:` without the `transformer_engine:` block) is an error whose message
  shows the fix, except nvdlfw's generic `LogTensorStats` next to a `transformer_engine:` block (nvdlfw's base
  feature, as in TE's test configs: accepted, inert unless a base feature of that name is registered); an enabled
  section must configure at least one feature, and a namespace block is never empty;
- a feature config is a non-empty mapping with a required boolean `enabled`; `gemms`, `gemms_struct`, `tensors`,
  `tensors_struct` (never empty lists) and the schedule keys are checked wherever they appear; other keys belong to
  the feature and are checked by its validator (`feature_validators[(namespace, feature)](cfg)` raising ValueError,
  optionally with a `.key_path`), which runs for enabled features and for disabled ones that carry parameters.
  A validator stops at its first error; the block is validated again without the offending key or item until it
  passes, so every problem of a block is reported at once. A rejected `stats` entry gets the closest statistic the
  feature accepts, or the feature it belongs to (`stat_hints`);
- at least one section must be enabled.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Mapping, Optional, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from .errors import ConfigError, ConfigIssue, closest
from .parsing import GEMM_NAMES, TENSOR_NAMES
from .selection import parse_layer_numbers
from .stat_hints import stat_hint
from .validation_rounds import collect_validator_issues

KNOWN_NAMESPACES = ("transformer_engine",)
BASE_NAMESPACE = "base"
#: nvdlfw's generic section-level feature names: in a section that also has the namespace block of the feature of
#: the same name (TE's own test configs do this), such a block is nvdlfw's base feature, inert unless registered
NVDLFW_BASE_FEATURES = ("LogTensorStats",)
SECTION_KEYS = ("enabled", "layers")

FeatureValidator = Callable[[dict], None]


# ----------------------------------------------------------------------------------------------------------------
# Small validators. They raise PydanticCustomError("tedebug", ...) so the message, the expectation and the
# suggestion reach ConfigIssue unchanged.


def _fail(message: str, *, expected: Optional[str] = None, suggestion: Optional[str] = None):
    raise PydanticCustomError(
        "tedebug", "{message}", {"message": message, "expected": expected, "suggestion": suggestion}
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _name_check(kind: str, allowed: tuple):
    expected = "one of " + ", ".join(allowed)

    def check(value):
        if not isinstance(value, str):
            _fail(f"{kind} name must be a string, got {value!r}", expected=expected)
        if value not in allowed:
            _fail(f"invalid {kind} name {value!r}", expected=expected, suggestion=closest(value, allowed))
        return value

    return check


def _listify(value):
    return [value] if isinstance(value, str) else value


_BOOL_EXPECTED = "a YAML boolean: True, False, true or false (unquoted)"


def _check_bool(key: str):
    def check(value):
        if not isinstance(value, bool):
            kind = "the string" if isinstance(value, str) else type(value).__name__
            _fail(f"{key} must be a YAML boolean, got {kind} {value!r}", expected=_BOOL_EXPECTED)
        return value

    return check


def _check_layer_types(value):
    if isinstance(value, str):
        _fail(f"layer_types must be a list, got the string {value!r}", expected=f"a list such as [{value}]")
    return value


def _int_at_least(key: str, minimum: int):
    def check(value):
        if not _is_int(value) or value < minimum:
            _fail(f"{key} must be an integer >= {minimum}, got {value!r}")
        return value

    return check


def _check_end_step(value):
    if not _is_int(value):
        _fail(f"end_step must be an integer (negative = no end), got {value!r}")
    return value


def _check_pair(value):
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(_is_int(v) for v in value):
        _fail(f"start_end_list entry must be a pair of integers [start, end], got {value!r}")
    start, end = value
    if not 0 <= start <= end:
        _fail(
            f"start_end_list entry {list(value)} is invalid: need 0 <= start <= end",
            expected="[start, end] with 0 <= start <= end",
        )
    return list(value)


def _check_regex(value):
    if not isinstance(value, str):
        _fail(f"layer_name_regex_pattern must be a string, got {value!r}")
    try:
        re.compile(value)
    except re.error as err:
        _fail(f"invalid regular expression {value!r}: {err}")
    return value


def _check_string(what: str):
    def check(value):
        if not isinstance(value, str):
            _fail(f"{what} must be a string, got {value!r}")
        return value

    return check


def _check_layer_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        _fail(f"invalid layer_numbers entry {value!r}", expected="an int >= 0, a range 'a-b' or 'all'")
    if _is_int(value) and value < 0:
        _fail(f"layer number must be >= 0, got {value}")
    try:
        parse_layer_numbers([value])
    except ValueError as err:
        _fail(str(err))
    return value


def _check_layer_numbers_container(value):
    if _is_int(value) or isinstance(value, str):
        return [value]
    return value


def _not_allowed_in_gemm_entry(value):
    _fail("'enabled' is not allowed inside a gemms_struct entry (the feature's 'enabled' applies to all GEMMs)")


GemmName = Annotated[str, BeforeValidator(_name_check("gemm", GEMM_NAMES)), WithJsonSchema({"enum": list(GEMM_NAMES)})]
TensorName = Annotated[
    str, BeforeValidator(_name_check("tensor", TENSOR_NAMES)), WithJsonSchema({"enum": list(TENSOR_NAMES)})
]
TensorList = Annotated[
    list[TensorName],
    BeforeValidator(_listify),
    Field(min_length=1),
    WithJsonSchema({"anyOf": [{"enum": list(TENSOR_NAMES)}, {"type": "array", "items": {"enum": list(TENSOR_NAMES)}}]}),
]
LayerNumber = Annotated[Union[int, str], BeforeValidator(_check_layer_number)]
_LAYER_NUMBER_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^\d+-\d+$"}]}
StrictBool = Annotated[bool, BeforeValidator(_check_bool("enabled")), WithJsonSchema({"type": "boolean"})]
Str = Annotated[str, BeforeValidator(_check_string("entry"))]


# ----------------------------------------------------------------------------------------------------------------
# Models.


class LayersModel(BaseModel):
    """The `layers:` selector of a section. Unknown keys are errors. At least one selector key is required."""

    model_config = ConfigDict(extra="forbid", title="Layers")

    layer_name_regex_pattern: Optional[Annotated[str, BeforeValidator(_check_regex)]] = Field(
        None, description="Python regex searched (unanchored) in the layer name; takes priority over types/numbers"
    )
    layer_types: Optional[
        Annotated[
            list[Str],
            BeforeValidator(_check_layer_types),
            Field(min_length=1),
            WithJsonSchema({"type": "array", "items": {"type": "string"}, "minItems": 1}),
        ]
    ] = Field(None, description="substrings of the layer name (OR); 'all' selects every layer")
    layer_numbers: Optional[
        Annotated[
            list[LayerNumber],
            BeforeValidator(_check_layer_numbers_container),
            Field(min_length=1),
            WithJsonSchema(
                {
                    "anyOf": [
                        _LAYER_NUMBER_SCHEMA,
                        {"const": "all"},
                        {"type": "array", "items": {"anyOf": [_LAYER_NUMBER_SCHEMA, {"const": "all"}]}},
                    ]
                }
            ),
        ]
    ] = Field(None, description="layer numbers, inclusive ranges 'a-b', or 'all'; AND-ed with layer_types")
    exact_layer_names: Optional[Annotated[list[Str], Field(min_length=1)]] = Field(
        None, description="exactly these layer names (other keys are then ignored)"
    )

    @model_validator(mode="after")
    def _at_least_one_selector(self):
        if all(getattr(self, key) is None for key in type(self).model_fields):
            _fail(
                "Atleast one of 'layer_numbers', 'layer_types', 'exact_layer_names' or "
                "'layer_name_regex_pattern' must be provided",
                expected="at least one of " + ", ".join(type(self).model_fields),
            )
        return self


#: keys whose explicit null (``tensors:`` with its items commented out) is an error rather than "not given"
_NOT_NULL_KEYS = (
    "freq",
    "start_step",
    "start_end_list",
    "gemm",
    "tensor",
    "gemms",
    "gemms_struct",
    "tensors",
    "tensors_struct",
)


class ScheduleKeys(BaseModel):
    """`freq` / `start_step` / `end_step` / `start_end_list`, checked wherever they appear."""

    model_config = ConfigDict(extra="allow")

    freq: Optional[
        Annotated[int, BeforeValidator(_int_at_least("freq", 1)), WithJsonSchema({"type": "integer", "minimum": 1})]
    ] = Field(None, description="active on iterations that are multiples of freq (default 1)")
    start_step: Optional[
        Annotated[
            int, BeforeValidator(_int_at_least("start_step", 0)), WithJsonSchema({"type": "integer", "minimum": 0})
        ]
    ] = Field(None, description="first iteration (inclusive, default 0)")
    end_step: Optional[Annotated[int, BeforeValidator(_check_end_step)]] = Field(
        None, description="last iteration (inclusive); null or negative = no end"
    )
    start_end_list: Optional[
        list[
            Annotated[
                list[int],
                BeforeValidator(_check_pair),
                WithJsonSchema(
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 2}
                ),
            ]
        ]
    ] = Field(None, description="inclusive [start, end] intervals; overrides start_step/end_step")

    @model_validator(mode="after")
    def _start_before_end(self):
        start, end = self.start_step, self.end_step
        if start is not None and end is not None and end >= 0 and start > end:
            _fail(f"start_step {start} is after end_step {end}", expected="start_step <= end_step")
        return self


class TensorEntry(ScheduleKeys):
    """One `tensors_struct` entry: a tensor name plus per-tensor parameters."""

    model_config = ConfigDict(extra="allow", title="TensorEntry")
    tensor: TensorName


class GemmEntry(ScheduleKeys):
    """One `gemms_struct` entry: a GEMM name, its tensors, and per-GEMM parameters. No `enabled` here."""

    model_config = ConfigDict(extra="allow", title="GemmEntry")
    gemm: GemmName
    tensors: Optional[TensorList] = None
    tensors_struct: Optional[Annotated[list[TensorEntry], Field(min_length=1)]] = None
    enabled: SkipJsonSchema[Optional[Annotated[Any, BeforeValidator(_not_allowed_in_gemm_entry)]]] = None


class FeatureBlock(ScheduleKeys):
    """The generic shape of a feature config. Feature-specific keys are checked by the feature's validator."""

    model_config = ConfigDict(extra="allow", title="FeatureConfig")
    enabled: StrictBool = Field(description="required; True or False")
    gemms: Optional[Annotated[list[GemmName], Field(min_length=1)]] = None
    gemms_struct: Optional[Annotated[list[GemmEntry], Field(min_length=1)]] = None
    tensors: Optional[TensorList] = None
    tensors_struct: Optional[Annotated[list[TensorEntry], Field(min_length=1)]] = None


class SectionModel(BaseModel):
    """A section (used for the JSON Schema; sections are validated key by key by `validate_sections`)."""

    model_config = ConfigDict(extra="allow", title="Section")
    enabled: StrictBool = Field(description="required; True or False (disabled sections select nothing)")
    layers: Optional[LayersModel] = Field(None, description="required when enabled")
    transformer_engine: Optional[dict[str, FeatureBlock]] = Field(
        None, description="TransformerEngine features: feature class name -> feature config"
    )


class ConfigModel(RootModel[dict[str, SectionModel]]):
    """The whole config: section name -> section."""


def config_json_schema(feature_names: Optional[Mapping[str, set]] = None) -> dict:
    """JSON Schema of the config. With `feature_names`, the known feature names of each namespace are listed."""
    schema = ConfigModel.model_json_schema()
    schema["title"] = "tedebug config"
    feature_ref = {"$ref": "#/$defs/FeatureBlock"}
    section = schema["$defs"]["SectionModel"]
    section["additionalProperties"] = {
        "anyOf": [feature_ref, {"type": "object", "additionalProperties": feature_ref}],
        "description": "a feature of namespace 'base' (e.g. LogTensorStats) or another namespace block",
    }
    section["required"] = ["enabled"]
    if feature_names:
        te = sorted(feature_names.get("transformer_engine", ()))
        if te:
            section["properties"]["transformer_engine"] = {
                "type": "object",
                "properties": {name: feature_ref for name in te},
                "additionalProperties": False,
            }
    return schema


# ----------------------------------------------------------------------------------------------------------------
# Section validation.


@dataclass
class SectionSpec:
    """A validated section: its selector (a plain dict of the given selector keys) and features per namespace."""

    name: Any
    enabled: bool
    layers: Optional[dict] = None
    features: dict = field(default_factory=dict)  # namespace -> feature name -> deep-copied raw feature config


_PYDANTIC_MESSAGES = {
    "missing": "missing required key",
    "extra_forbidden": "unknown key",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "too_short": "must not be empty",
}


def _trim_loc(raw, loc: tuple, error_type: str) -> tuple:
    """Keep the part of a pydantic `loc` that exists in the raw data (drops union-member tags, keeps a missing key)."""
    kept, node = [], raw
    for position, key in enumerate(loc):
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        elif position == len(loc) - 1 and error_type in ("missing", "extra_forbidden"):
            pass
        else:
            break
        kept.append(key)
    return tuple(kept)


def _issues_from_validation(err: ValidationError, raw, base: tuple, known_keys=()) -> list:
    issues = []
    for item in err.errors():
        kind = item["type"]
        loc = _trim_loc(raw, tuple(item["loc"]), kind)
        ctx = item.get("ctx") or {}
        if kind == "tedebug":
            issues.append(
                ConfigIssue(ctx["message"], base + loc, expected=ctx.get("expected"), suggestion=ctx.get("suggestion"))
            )
            continue
        if kind == "value_error" and "error" in ctx:
            message = str(ctx["error"])
        else:
            message = _PYDANTIC_MESSAGES.get(kind, item["msg"])
        suggestion = closest(loc[-1], known_keys) if kind == "extra_forbidden" and loc else None
        issues.append(ConfigIssue(message, base + loc, suggestion=suggestion))
    return issues


def _validate_model(model: type[BaseModel], raw, base: tuple, issues: list, known_keys=()) -> Optional[BaseModel]:
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        issues.extend(_issues_from_validation(err, raw, base, known_keys))
        return None


def _namespaces(feature_names: Mapping[str, set]) -> set:
    """Section keys that open a namespace block: the known ones plus every registered namespace (incl. 'base')."""
    return set(KNOWN_NAMESPACES) | set(feature_names)


def _is_empty(value) -> bool:
    return value is None or (isinstance(value, dict) and not value)


class _SectionValidator:
    """Validates the sections of one config, collecting issues."""

    def __init__(self, feature_names: Mapping[str, set], feature_validators: Optional[Mapping] = None):
        self.feature_names = {ns: set(names) for ns, names in feature_names.items()}
        self.validators = dict(feature_validators or {})
        self.namespaces = _namespaces(self.feature_names)
        self.issues: list = []
        self._stat_answers: dict = {}  # stat_hints' cache for this load

    def section(self, name, raw) -> Optional[SectionSpec]:
        path = (name,)
        if not isinstance(raw, dict):
            self.issues.append(
                ConfigIssue(
                    f"a section must be a mapping, got {type(raw).__name__}",
                    path,
                    expected="a mapping with 'enabled', 'layers' and features",
                )
            )
            return None
        if "enabled" not in raw:
            self.issues.append(
                ConfigIssue(
                    "Missing required config field `enabled`", path + ("enabled",), expected="enabled: True or False"
                )
            )
            enabled = False
        elif not isinstance(raw["enabled"], bool):
            value = raw["enabled"]
            kind = "the string" if isinstance(value, str) else type(value).__name__
            self.issues.append(
                ConfigIssue(
                    f"enabled must be a YAML boolean, got {kind} {value!r}",
                    path + ("enabled",),
                    expected=_BOOL_EXPECTED,
                )
            )
            enabled = False
        else:
            enabled = raw["enabled"]
        spec = SectionSpec(name, enabled)
        before = len(self.issues)
        if "layers" in raw:
            model = _validate_model(
                LayersModel, raw["layers"], path + ("layers",), self.issues, LayersModel.model_fields
            )
            if model is not None:
                spec.layers = model.model_dump(exclude_none=True)
        elif enabled:
            self.issues.append(
                ConfigIssue(
                    "missing required key (an enabled section must select layers)",
                    path + ("layers",),
                    expected="a 'layers:' selector",
                )
            )
        for key, value in raw.items():
            if key not in SECTION_KEYS:
                self._section_key(spec, key, value, raw.keys())
        if enabled and not spec.features and len(self.issues) == before:
            self.issues.append(
                ConfigIssue(
                    "the section configures no feature, so it does nothing",
                    path,
                    expected="a namespace block such as 'transformer_engine:' with at least one feature",
                )
            )
        return spec

    def _section_key(self, spec: SectionSpec, key, value, spec_keys=()) -> None:
        path = (spec.name, key)
        if key in self.namespaces:
            self._namespace_block(spec, key, value)
        elif key in self.feature_names.get(BASE_NAMESPACE, ()):
            if key in NVDLFW_BASE_FEATURES and "transformer_engine" not in spec_keys:
                warnings.warn(
                    f"section '{spec.name}': '{key}' at section level is nvdlfw-inspect's generic feature (namespace "
                    f"'base'), which logs only through debug_api.log_tensor_stats(...) calls; to log the tensors of "
                    f"tedebug / TransformerEngine layers, put it under 'transformer_engine:'",
                    UserWarning,
                    stacklevel=2,
                )
            self._feature(spec, BASE_NAMESPACE, key, value, path)
        elif (home := self._namespace_of(key)) is not None:
            if key in NVDLFW_BASE_FEATURES and home in spec_keys:
                self._feature(spec, BASE_NAMESPACE, key, value, path, run_validator=False)
                return
            self.issues.append(
                ConfigIssue(
                    f"'{key}' is a feature of namespace '{home}' and must be placed inside its namespace block, not "
                    f"directly in the section (there it would be ignored); write\n"
                    f"    {spec.name}:\n      {home}:\n        {key}:\n          ...",
                    path,
                    expected=f"'{home}:' -> '{key}:'",
                )
            )
        else:
            candidates = set(SECTION_KEYS) | self.namespaces | self.feature_names.get(BASE_NAMESPACE, set())
            self.issues.append(
                ConfigIssue(
                    f"Could not find feature '{key}' in namespace '{BASE_NAMESPACE}'",
                    path,
                    expected="'enabled', 'layers', a namespace ("
                    + ", ".join(sorted(self.namespaces))
                    + ") or a feature of namespace 'base'",
                    suggestion=closest(key, candidates),
                )
            )

    def _namespace_of(self, feature) -> Optional[str]:
        """The (non-base) namespace that has a feature named `feature`, if any."""
        return next(
            (ns for ns in sorted(self.feature_names) if ns != BASE_NAMESPACE and feature in self.feature_names[ns]),
            None,
        )

    def _namespace_block(self, spec: SectionSpec, namespace: str, value) -> None:
        path = (spec.name, namespace)
        if _is_empty(value):
            self.issues.append(
                ConfigIssue(
                    f"the namespace block '{namespace}' is empty",
                    path,
                    expected="a mapping of feature name -> feature config",
                )
            )
            return
        if not isinstance(value, dict):
            self.issues.append(
                ConfigIssue(
                    f"a namespace block must be a mapping, got {type(value).__name__}",
                    path,
                    expected="a mapping of feature name -> feature config",
                )
            )
            return
        known = self.feature_names.get(namespace, set())
        for feature, cfg in value.items():
            if feature not in known:
                self.issues.append(
                    ConfigIssue(
                        f"Could not find feature '{feature}' in namespace '{namespace}'",
                        path + (feature,),
                        expected="one of " + (", ".join(sorted(known)) if known else "(no features registered)"),
                        suggestion=closest(feature, known),
                    )
                )
                continue
            self._feature(spec, namespace, feature, cfg, path + (feature,))

    def _feature(
        self, spec: SectionSpec, namespace: str, feature: str, cfg, path: tuple, *, run_validator: bool = True
    ) -> None:
        if _is_empty(cfg):
            self.issues.append(
                ConfigIssue(
                    f"the feature block '{feature}' is empty",
                    path,
                    expected="'enabled: True' and the feature's parameters, or remove the block",
                )
            )
            return
        if not isinstance(cfg, dict):
            self.issues.append(
                ConfigIssue(
                    f"a feature config must be a mapping, got {type(cfg).__name__}",
                    path,
                    expected="a mapping with 'enabled' and the feature's parameters",
                )
            )
            return
        block = spec.features.setdefault(namespace, {})
        if feature in block:
            self.issues.append(
                ConfigIssue(f"feature '{feature}' of namespace '{namespace}' is given twice in this section", path)
            )
            return
        before = len(self.issues)
        for null_path in _null_keys(cfg):
            self.issues.append(
                ConfigIssue(
                    f"{null_path[-1]} has no value (were its items commented out?)",
                    path + null_path,
                    expected=f"a value, or remove '{null_path[-1]}'",
                )
            )
        if len(self.issues) > before:
            block[feature] = copy.deepcopy(cfg)
            return
        if "enabled" not in cfg:
            self.issues.append(
                ConfigIssue(
                    "Missing required config field `enabled`", path + ("enabled",), expected="enabled: True or False"
                )
            )
        else:
            _validate_model(FeatureBlock, cfg, path, self.issues)
        has_params = any(key != "enabled" for key in cfg)
        if run_validator and len(self.issues) == before and (cfg["enabled"] or has_params):
            self._run_feature_validator(namespace, feature, cfg, path)
        block[feature] = copy.deepcopy(cfg)

    def _run_feature_validator(self, namespace: str, feature: str, cfg: dict, path: tuple) -> None:
        validator = self.validators.get((namespace, feature))
        if validator is None:
            return
        for message, sub_path in collect_validator_issues(validator, cfg):
            entry = _value_at(cfg, sub_path)
            suggestion = None
            if len(sub_path) >= 2 and sub_path[-2] == "stats" and isinstance(entry, str):
                suggestion, note = stat_hint(entry, namespace, feature, self.validators, self._stat_answers)
                if note is not None:
                    message = f"{message}; {note}"
            self.issues.append(ConfigIssue(message, path + sub_path, suggestion=suggestion))


def _null_keys(cfg: dict, path: tuple = ()):
    """Key paths (below a feature block) of the `_NOT_NULL_KEYS` given as null, in struct entries too."""
    for key in _NOT_NULL_KEYS:
        if key in cfg and cfg[key] is None:
            yield path + (key,)
    for struct in ("gemms_struct", "tensors_struct"):
        entries = cfg.get(struct)
        if isinstance(entries, list):
            for index, entry in enumerate(entries):
                if isinstance(entry, dict):
                    yield from _null_keys(entry, path + (struct, index))


def _value_at(data, key_path: tuple):
    """The value at `key_path` inside `data`, or None when the path does not lead anywhere."""
    for key in key_path:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def validate_sections(
    raw,
    *,
    feature_names: Mapping[str, set],
    feature_validators: Optional[Mapping] = None,
) -> list:
    """Validate a whole parsed config; return the `SectionSpec` of every section (disabled ones included).

    Raises `ConfigError` (without file / line; the loader adds them) listing every problem found.
    """
    if not isinstance(raw, dict):
        raise ConfigError(
            f"the config must be a mapping of section name -> section, got {type(raw).__name__}",
            expected="a mapping of section name -> section",
        )
    if not raw:
        raise ConfigError("the config has no sections", expected="at least one enabled section")
    checker = _SectionValidator(feature_names, feature_validators)
    specs = [spec for name, section in raw.items() if (spec := checker.section(name, section)) is not None]
    if not checker.issues and not any(spec.enabled for spec in specs):
        checker.issues.append(
            ConfigIssue(
                "Could not load config from input: every section is disabled",
                (),
                expected="at least one section with 'enabled: True'",
            )
        )
    if checker.issues:
        raise ConfigError(issues=checker.issues)
    return specs
