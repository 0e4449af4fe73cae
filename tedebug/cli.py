"""The ``tedebug`` command line: ``tedebug validate CONFIG [--feature-dirs D ...]`` and ``tedebug schema``.

- ``validate`` loads the built-in features (plus ``--feature-dirs``), loads and validates the config exactly as
  `debug_api.initialize` would, and prints a summary (sections, selectors, features) or the errors.  Unlike
  `initialize`, a missing config file is an error here.
- ``schema`` prints the JSON Schema of the config (feature names of the built-in features included), for editor
  completion (e.g. ``tedebug schema > tedebug.schema.json`` and a ``# yaml-language-server: $schema=...`` line).

Each subcommand is registered by one ``_add_<name>(subparsers)`` function listed in `SUBCOMMANDS`; it sets
``handler`` (a function ``args -> int`` exit code).  Only `main` turns a non-zero code into SystemExit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, List, Optional, Sequence

from tedebug.config import ConfigError, config_json_schema, load_config
from tedebug.registry import FeatureLoadError, build_registry


def _error(message: str) -> int:
    print(f"tedebug: error: {message}", file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------------------- validate
def run_validate(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.config):
        return _error(f"config file not found: {args.config}")
    try:
        registry = build_registry(args.feature_dirs)
        config = load_config(args.config, feature_names=registry.feature_names(),
                             feature_validators=registry.feature_validators())
    except (ConfigError, FeatureLoadError) as err:
        return _error(f"invalid config {args.config}:\n{err}" if isinstance(err, ConfigError) else str(err))
    print(config.summary())
    print(f"OK: {len(config.sections)} enabled section(s); features available: "
          f"{', '.join(registry.qualified_names()) or '(none)'}")
    return 0


def _add_validate(subparsers) -> None:
    parser = subparsers.add_parser("validate", help="check a debug config and print what it selects")
    parser.add_argument("config", help="path of the YAML config")
    parser.add_argument("--feature-dirs", nargs="+", default=None, metavar="DIR",
                        help="extra directories with feature files (as initialize(feature_dirs=...))")
    parser.set_defaults(handler=run_validate)


# ------------------------------------------------------------------------------------------------- schema
def run_schema(args: argparse.Namespace) -> int:
    try:
        registry = build_registry(args.feature_dirs)
    except FeatureLoadError as err:
        return _error(str(err))
    print(json.dumps(config_json_schema(registry.feature_names()), indent=2, sort_keys=True))
    return 0


def _add_schema(subparsers) -> None:
    parser = subparsers.add_parser("schema", help="print the JSON Schema of debug configs")
    parser.add_argument("--feature-dirs", nargs="+", default=None, metavar="DIR",
                        help="extra directories whose feature names are listed in the schema")
    parser.set_defaults(handler=run_schema)


# ------------------------------------------------------------------------------------------------- bench
def _add_bench(subparsers) -> None:  # registered by the gpu helper; body in tedebug/bench.py
    from tedebug import bench

    parser = subparsers.add_parser("bench", help="time the GPU kernels against the torch path (needs CUDA + CuPy)")
    bench.add_arguments(parser)
    parser.set_defaults(handler=bench.run)


# ------------------------------------------------------------------------------------------------- registry
# Subcommands, in help order. A new subcommand (e.g. `bench`) adds its `_add_<name>` function here.
SUBCOMMANDS: List[Callable] = [_add_validate, _add_schema, _add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tedebug", description="tedebug: precision debugging for low-precision "
                                                                 "training (TransformerEngine-compatible configs)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``tedebug`` console script; raises SystemExit with the exit code on failure."""
    args = build_parser().parse_args(argv)
    code = args.handler(args)
    if code:
        raise SystemExit(code)
    return 0


if __name__ == "__main__":  # pragma: no cover - `python -m tedebug.cli`
    main()
