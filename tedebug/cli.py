"""The ``tedebug`` command line: ``validate``, ``plan``, ``schema``, ``bench``, ``report`` and ``compare``.

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

- ``report RUN_DIR`` and ``compare RUN_A RUN_B`` (after the run) delegate to `tedebug.analysis.report` and
  `tedebug.analysis.compare`.

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


# ------------------------------------------------------------------------------------------------- report / compare
def _analysis_missing(err: ImportError) -> int:
    return _error(f"{err}; the after-the-run tools need the 'report' extra: pip install 'tedebug[report]'")


def run_report(args: argparse.Namespace) -> int:  # body in tedebug/analysis/report.py
    try:
        from tedebug.analysis.report import build_report, write_report
    except ImportError as err:
        return _analysis_missing(err)
    try:
        report = build_report(args.run_dir, compare_to=args.compare, threshold=args.threshold, stats=args.stat,
                              config_path=args.config)
        output = args.output or (os.path.join(args.run_dir, "report.html") if args.format == "html"
                                 else os.path.join(args.run_dir, "figures"))
        written = write_report(report, output, args.format)
    except (FileNotFoundError, ValueError) as err:
        return _error(str(err))
    what = output if args.format == "html" else f"{len(written) - 1} figure(s) and report.txt in {output}"
    print(f"wrote {what} ({len(report.figures)} figures, {report.seconds:.1f} s to build)")
    return 0


def _add_report(subparsers) -> None:
    from tedebug.analysis.compare import DEFAULT_THRESHOLD

    parser = subparsers.add_parser("report", help="an HTML report (or figures) of a finished run")
    parser.add_argument("run_dir", help="the log_dir of the run (holds tedebug_statistics/)")
    parser.add_argument("-o", "--output", default=None,
                        help="output file (html, default RUN_DIR/report.html) or folder (png/svg/pdf, default "
                             "RUN_DIR/figures)")
    parser.add_argument("--format", choices=["html", "png", "svg", "pdf"], default="html",
                        help="html: one self-contained page; png/svg/pdf: a folder of figures plus report.txt")
    parser.add_argument("--compare", default=None, metavar="OTHER_RUN",
                        help="add the comparison with another run (as `tedebug compare RUN_DIR OTHER_RUN`)")
    parser.add_argument("--stat", nargs="+", default=None, metavar="STAT", help="only these statistics")
    parser.add_argument("--threshold", type=float, default=None,
                        help=f"relative threshold of --compare (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--config", default=None,
                        help="the config file to show (default: the one named in the run's main log)")
    parser.set_defaults(handler=run_report)


def run_compare(args: argparse.Namespace) -> int:  # body in tedebug/analysis/compare.py
    try:
        from tedebug.analysis.compare import compare_runs, format_comparison
        import pandas  # noqa: F401  (compare_runs needs it)
    except ImportError as err:
        return _analysis_missing(err)

    try:
        comparison = compare_runs(args.run_a, args.run_b, threshold=args.threshold, stats=args.stat)
    except (FileNotFoundError, ValueError) as err:
        return _error(str(err))
    print(format_comparison(comparison))
    return 1 if args.fail_on_departure and comparison.departed else 0


def _add_compare(subparsers) -> None:
    from tedebug.analysis.compare import DEFAULT_THRESHOLD

    parser = subparsers.add_parser("compare", help="where the statistics of two runs part (e.g. bf16 vs FP8)")
    parser.add_argument("run_a", help="the reference run's log_dir (e.g. the high-precision run)")
    parser.add_argument("run_b", help="the other run's log_dir")
    parser.add_argument("--stat", nargs="+", default=None, metavar="STAT",
                        help="statistics to compare (default: every statistic both runs logged)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"a point departs when |b - a| / max(|a|, |b|) exceeds this (default "
                             f"{DEFAULT_THRESHOLD})")
    parser.add_argument("--fail-on-departure", action="store_true",
                        help="exit with status 1 when any statistic departs (for CI)")
    parser.set_defaults(handler=run_compare)


# ------------------------------------------------------------------------------------------------- registry
# Subcommands, in help order. A new subcommand (e.g. `bench`) adds its `_add_<name>` function here.
SUBCOMMANDS: List[Callable] = [_add_validate, _add_plan, _add_schema, _add_bench, _add_report, _add_compare]


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
