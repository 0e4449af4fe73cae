"""The ``tedebug`` command line: ``validate``, ``plan``, ``schema`` and ``bench``.

- ``validate`` loads the built-in features (plus ``--feature-dirs``), loads and validates the config exactly as
  `debug_api.initialize` would, and prints a summary (sections, selectors, features) or the errors.  Unlike
  `initialize`, a missing config file is an error here.
- ``plan CONFIG --layers NAME ... [--iteration N]`` shows, before training, what the config does to each tensor of
  the named layers at iteration N: the plan of each GEMM direction (``modify_tensor()``, ``Quantize`` or
  ``High Precision``, assuming the layer trains in a quantized recipe), whether inspection runs, and the next
  iteration at which anything can change.  It builds the same `DebugQuantizer`s a layer builds, so the answer is
  the one training will get.
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


# ------------------------------------------------------------------------------------------------- plan
def plan_rows(layers: Sequence[str], iteration: int) -> List[str]:
    """Table lines of the plans of every tensor of `layers` in the active debug session, at `iteration`."""
    from tedebug import debug_api
    from tedebug.debug_quantization import GEMMS_OF_TENSOR, DebugQuantizer
    from tedebug.quantization import Float8CurrentScalingQuantizer

    debug_api.initialize_training_step(iteration)
    header = f"{'layer':<28} {'tensor':<11} {'rowwise GEMM: plan':<32} {'columnwise GEMM: plan':<32} inspect  next"
    rows = [header, "-" * len(header)]
    for layer in layers:
        for tensor, (row_gemm, col_gemm) in GEMMS_OF_TENSOR.items():
            # The parent stands for "this layer trains quantized"; outputs have none (GEMM outputs stay high
            # precision).
            parent = Float8CurrentScalingQuantizer() if col_gemm is not None else None
            q = DebugQuantizer(layer, tensor, parent, None)
            col = f"{col_gemm}: {q.columnwise_tensor_plan}" if col_gemm is not None else "-"
            nxt = q.get_next_debug_iter()
            rows.append(f"{layer:<28} {tensor:<11} {row_gemm + ': ' + q.rowwise_tensor_plan:<32} {col:<32} "
                        f"{'yes' if q.inspect_tensor_enabled else 'no':<8} {'never' if nxt is None else nxt}")
    return rows


def run_plan(args: argparse.Namespace) -> int:
    import tempfile

    from tedebug import debug_api

    if not os.path.isfile(args.config):
        return _error(f"config file not found: {args.config}")
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            debug_api.initialize(args.config, feature_dirs=args.feature_dirs, log_dir=log_dir)
        except (ConfigError, FeatureLoadError) as err:
            return _error(f"invalid config {args.config}:\n{err}" if isinstance(err, ConfigError) else str(err))
        try:
            rows = plan_rows(args.layers, args.iteration)
        finally:
            debug_api.end_debug()
    print(f"plans at iteration {args.iteration} (Quantize = the layer's recipe; next = the next iteration at which "
          f"any hook of that tensor may answer differently)")
    print("\n".join(rows))
    return 0


def _add_plan(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="show what a config does to each tensor/GEMM of given layers")
    parser.add_argument("config", help="path of the YAML config")
    parser.add_argument("--layers", nargs="+", required=True, metavar="NAME",
                        help="layer names as the model assigns them (e.g. blocks.0.attn.qkv, or Layer_1)")
    parser.add_argument("--iteration", type=int, default=0, help="the training iteration to evaluate (default 0)")
    parser.add_argument("--feature-dirs", nargs="+", default=None, metavar="DIR",
                        help="extra directories with feature files (as initialize(feature_dirs=...))")
    parser.set_defaults(handler=run_plan)


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
SUBCOMMANDS: List[Callable] = [_add_validate, _add_plan, _add_schema, _add_bench]


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
