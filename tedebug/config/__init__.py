"""tedebug.config: load, validate and compile debug configs (YAML or dict), select layers, schedule and parse
feature configs. See docs/internals.md section 3 for the contract."""

from .compile import CompiledConfig, CompiledSection
from .errors import ConfigError, ConfigIssue
from .loader import load_config
from .parsing import GEMM_NAMES, TENSOR_NAMES, parse_feature_config
from .schedule import Schedule
from .schema import config_json_schema
from .selection import LayerSelector

__all__ = [
    "CompiledConfig",
    "CompiledSection",
    "ConfigError",
    "ConfigIssue",
    "GEMM_NAMES",
    "LayerSelector",
    "Schedule",
    "TENSOR_NAMES",
    "config_json_schema",
    "load_config",
    "parse_feature_config",
]
