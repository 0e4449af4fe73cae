"""The ``tedebug`` command line: ``validate``, ``plan``, ``schema``, ``bench``, ``report`` and ``compare``.

- ``validate`` loads the built-in features (plus ``--feature-dirs``), loads and validates the config exactly as
  `debug_api.initialize` would, and prints a summary (sections, selectors, features) or the errors.  Unlike
  `initialize`, a missing config file is an error here.
- ``plan CONFIG --layers NAME ... [--iteration N]`` shows, before training, what the config does to each tensor of
  the named layers at iteration N: the plan of each GEMM direction (``modify_tensor()``, ``Quantize`` or
  ``High Precision``, assuming the layer trains in a quantized recipe), whether inspection runs, and the next
  iteration at which anything can change.  It builds the same `DebugQuantizer`s a layer builds, so the answer is
  the one training will get.  Columns are as wide as their longest cell.
- ``validate`` and ``plan`` take the real layer names of a model: ``--layers-from RUN_DIR`` (the layers a run
  logged) or ``--model MODULE:FACTORY`` (the model built and converted); `validate` then reports, per section, the
  layers it selects, the sections that select nothing and the layers no section selects
  (`tedebug.layer_coverage`); `plan` shows every selected layer.
- ``schema`` prints the JSON Schema of the config (feature names of the built-in features included, and under
  ``x-tedebug-statistics`` the statistic names of each statistics feature), for editor completion (e.g.
  ``tedebug schema > tedebug.schema.json`` and a ``# yaml-language-server: $schema=...`` line); ``--stats`` prints
  only the statistic names.  Output to a closed pipe (``tedebug schema | head -1``) ends quietly.

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
from typing import Callable, Dict, List, Optional, Sequence

from tedebug.config import ConfigError, config_json_schema, load_config
from tedebug.registry import FeatureLoadError, build_registry


def _error(message: str) -> int:
    print(f"tedebug: error: {message}", file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------------------- output
def _emit(text: str) -> bool:
    """Print `text` to stdout; False when the reader went away (``tedebug schema | head -1``).

    On a closed pipe the rest of the output is dropped: stdout is pointed at /dev/null so that the interpreter's
    final flush does not raise again."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # stdout has no file descriptor (captured): nothing left to flush
            pass
        return False


# ------------------------------------------------------------------------------------------------- layer sources
def _add_layer_source_arguments(parser, *, explicit_layers: bool) -> None:
    """``--layers-from RUN_DIR`` / ``--model MODULE:FACTORY`` (and, for `plan`, ``--layers NAME ...``)."""
    group = parser.add_mutually_exclusive_group(required=explicit_layers)
    if explicit_layers:
        group.add_argument(
            "--layers",
            nargs="+",
            metavar="NAME",
            help="layer names as the model assigns them (e.g. blocks.0.attn.qkv, or Layer_1)",
        )
    group.add_argument(
        "--layers-from",
        metavar="RUN_DIR",
        help="the layer names a run logged (its log_dir: JSONL record or statistics text log)",
    )
    group.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="import MODULE (dotted name or path to a .py file), call FACTORY() for the model, "
        "convert it with tedebug.convert_model and use its layer names",
    )


def _layer_source(args: argparse.Namespace):
    """``(layer names, description)`` from --layers-from / --model, or None when neither is given."""
    from tedebug.layer_coverage import layers_from_model, layers_from_run

    if getattr(args, "layers_from", None):
        return layers_from_run(args.layers_from)
    if getattr(args, "model", None):
        return layers_from_model(args.model)
    return None


# ------------------------------------------------------------------------------------------------- validate
def run_validate(args: argparse.Namespace) -> int:
    from tedebug.layer_coverage import LayerSourceError, coverage, format_coverage

    if not os.path.isfile(args.config):
        return _error(f"config file not found: {args.config}")
    try:
        registry = build_registry(args.feature_dirs)
        config = load_config(
            args.config, feature_names=registry.feature_names(), feature_validators=registry.feature_validators()
        )
    except (ConfigError, FeatureLoadError) as err:
        return _error(f"invalid config {args.config}:\n{err}" if isinstance(err, ConfigError) else str(err))
    try:
        source = _layer_source(args)
    except LayerSourceError as err:
        return _error(str(err))
    lines = [config.summary()]
    code = 0
    if source is not None:
        result = coverage(config, source[0])
        lines += format_coverage(config, result, source[1])
        if result.overlaps or (args.strict and result.empty_sections):
            code = 1
    if code == 0:
        lines.append(
            f"OK: {len(config.sections)} enabled section(s); features available: "
            f"{', '.join(registry.qualified_names()) or '(none)'}"
        )
    _emit("\n".join(lines))
    return code


def _add_validate(subparsers) -> None:
    parser = subparsers.add_parser("validate", help="check a debug config and print what it selects")
    parser.add_argument("config", help="path of the YAML config")
    parser.add_argument(
        "--feature-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="extra directories with feature files (as initialize(feature_dirs=...))",
    )
    _add_layer_source_arguments(parser, explicit_layers=False)
    parser.add_argument(
        "--strict",
        action="store_true",
        help="with --layers-from/--model: also fail (exit 1) when a section selects no layer",
    )
    parser.set_defaults(handler=run_validate)


# ------------------------------------------------------------------------------------------------- plan
PLAN_HEADER = ("layer", "tensor", "rowwise GEMM: plan", "columnwise GEMM: plan", "inspect", "next")


def plan_table(layers: Sequence[str], iteration: int) -> List[tuple]:
    """One row (the cells of `PLAN_HEADER`) per tensor of `layers` in the active debug session, at `iteration`."""
    from tedebug import debug_api
    from tedebug.debug_quantization import GEMMS_OF_TENSOR, DebugQuantizer
    from tedebug.quantization import Float8CurrentScalingQuantizer

    debug_api.initialize_training_step(iteration)
    rows = []
    for layer in layers:
        for tensor, (row_gemm, col_gemm) in GEMMS_OF_TENSOR.items():
            # The parent stands for "this layer trains quantized"; outputs have none (GEMM outputs stay high
            # precision).
            parent = Float8CurrentScalingQuantizer() if col_gemm is not None else None
            q = DebugQuantizer(layer, tensor, parent, None)
            col = f"{col_gemm}: {q.columnwise_tensor_plan}" if col_gemm is not None else "-"
            nxt = q.get_next_debug_iter()
            rows.append(
                (
                    layer,
                    tensor,
                    f"{row_gemm}: {q.rowwise_tensor_plan}",
                    col,
                    "yes" if q.inspect_tensor_enabled else "no",
                    "never" if nxt is None else str(nxt),
                )
            )
    return rows


def align(rows: Sequence[Sequence[str]], header: Sequence[str]) -> List[str]:
    """Left-aligned columns as wide as their longest cell (the last column unpadded), a rule under the header."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells[:-1], widths[:-1])) + "  " + str(cells[-1])

    head = line(header)
    return [head, "-" * len(head)] + [line(row) for row in rows]


def plan_rows(layers: Sequence[str], iteration: int) -> List[str]:
    """Table lines of the plans of every tensor of `layers` in the active debug session, at `iteration`."""
    return align(plan_table(layers, iteration), PLAN_HEADER)


def run_plan(args: argparse.Namespace) -> int:
    import tempfile

    from tedebug import debug_api
    from tedebug.layer_coverage import LayerSourceError, coverage

    if not os.path.isfile(args.config):
        return _error(f"config file not found: {args.config}")
    try:
        source = _layer_source(args)
    except LayerSourceError as err:
        return _error(str(err))
    notes = []
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            debug_api.initialize(args.config, feature_dirs=args.feature_dirs, log_dir=log_dir)
        except (ConfigError, FeatureLoadError) as err:
            return _error(f"invalid config {args.config}:\n{err}" if isinstance(err, ConfigError) else str(err))
        try:
            layers = args.layers
            if source is not None:
                result = coverage(debug_api.session().config, source[0])
                layers = result.selected()
                notes.append(f"layers: {source[1]}; {len(layers)} selected by the config")
                if result.unselected:
                    notes.append(
                        f"not shown: {len(result.unselected)} layer(s) no section selects (every GEMM "
                        f"as the recipe, no inspection): " + ", ".join(result.unselected)
                    )
                for layer, sections in result.overlaps.items():
                    notes.append(
                        f"error: layer '{layer}' is selected by sections " + ", ".join(f"'{s}'" for s in sections)
                    )
                    layers = [name for name in layers if name != layer]
            rows = plan_rows(layers, args.iteration)
        finally:
            debug_api.end_debug()
    _emit(
        "\n".join(
            [
                f"plans at iteration {args.iteration} (Quantize = the layer's recipe; next = the next iteration "
                f"at which any hook of that tensor may answer differently)",
                *notes,
                *rows,
            ]
        )
    )
    return 1 if source is not None and result.overlaps else 0


def _add_plan(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="show what a config does to each tensor/GEMM of given layers")
    parser.add_argument("config", help="path of the YAML config")
    _add_layer_source_arguments(parser, explicit_layers=True)
    parser.add_argument("--iteration", type=int, default=0, help="the training iteration to evaluate (default 0)")
    parser.add_argument(
        "--feature-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="extra directories with feature files (as initialize(feature_dirs=...))",
    )
    parser.set_defaults(handler=run_plan)


# ------------------------------------------------------------------------------------------------- schema
def statistic_names(registry) -> Dict[str, List[str]]:
    """``"namespace.Feature" -> the statistic names its `stats` list accepts`` for every registered feature that
    logs statistics (a feature class declares them with a classmethod ``statistic_names()``; the built-in
    statistics features are listed from their definitions)."""
    from tedebug.features.fp8_stat_names import supported_fp8_stat_names
    from tedebug.stats.definitions import BLOCKWISE_KIND, HP_KINDS

    builtin = {
        "transformer_engine.LogTensorStats": lambda: (
            list(HP_KINDS) + [f"{BLOCKWISE_KIND} (a mapping: {{{BLOCKWISE_KIND}: {{block_size: 32, dims: 1}}}})"]
        ),
        "transformer_engine.LogFp8TensorStats": supported_fp8_stat_names,
        "transformer_engine.LogNvfp4TensorStats": lambda: ["underflows%", "mse"],
    }
    names = {}
    for info in registry.all_features():
        declared = getattr(info.cls, "statistic_names", None)
        if callable(declared):
            try:
                names[info.qualified_name] = list(declared())
            except Exception as err:  # a feature's own code: report it, list the others
                names[info.qualified_name] = [f"(statistic_names() failed: {type(err).__name__}: {err})"]
        elif info.qualified_name in builtin and info.cls.__module__.startswith("tedebug.features."):
            names[info.qualified_name] = builtin[info.qualified_name]()
    return dict(sorted(names.items()))


def run_schema(args: argparse.Namespace) -> int:
    try:
        registry = build_registry(args.feature_dirs)
    except FeatureLoadError as err:
        return _error(str(err))
    stats = statistic_names(registry)
    if args.stats:
        _emit("\n".join(f"{feature}: {', '.join(names)}" for feature, names in stats.items()))
        return 0
    schema = config_json_schema(registry.feature_names())
    schema["x-tedebug-statistics"] = stats  # informative (validators ignore unknown keywords)
    _emit(json.dumps(schema, indent=2, sort_keys=True))
    return 0


def _add_schema(subparsers) -> None:
    parser = subparsers.add_parser(
        "schema", help="print the JSON Schema of debug configs (--stats: the statistic names each feature accepts)"
    )
    parser.add_argument(
        "--feature-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="extra directories whose feature names are listed in the schema",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print the statistic names each statistics feature accepts, one feature per line",
    )
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
        report = build_report(
            args.run_dir, compare_to=args.compare, threshold=args.threshold, stats=args.stat, config_path=args.config
        )
        output = args.output or (
            os.path.join(args.run_dir, "report.html")
            if args.format == "html"
            else os.path.join(args.run_dir, "figures")
        )
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
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="output file (html, default RUN_DIR/report.html) or folder (png/svg/pdf, default RUN_DIR/figures)",
    )
    parser.add_argument(
        "--format",
        choices=["html", "png", "svg", "pdf"],
        default="html",
        help="html: one self-contained page; png/svg/pdf: a folder of figures plus report.txt",
    )
    parser.add_argument(
        "--compare",
        default=None,
        metavar="OTHER_RUN",
        help="add the comparison with another run (as `tedebug compare RUN_DIR OTHER_RUN`)",
    )
    parser.add_argument("--stat", nargs="+", default=None, metavar="STAT", help="only these statistics")
    parser.add_argument(
        "--threshold", type=float, default=None, help=f"relative threshold of --compare (default {DEFAULT_THRESHOLD})"
    )
    parser.add_argument(
        "--config", default=None, help="the config file to show (default: the one named in the run's main log)"
    )
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
    parser.add_argument(
        "--stat",
        nargs="+",
        default=None,
        metavar="STAT",
        help="statistics to compare (default: every statistic both runs logged)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help=f"a point departs when |b - a| / max(|a|, |b|) exceeds this (default {DEFAULT_THRESHOLD})",
    )
    parser.add_argument(
        "--fail-on-departure", action="store_true", help="exit with status 1 when any statistic departs (for CI)"
    )
    parser.set_defaults(handler=run_compare)


# ------------------------------------------------------------------------------------------------- registry
# Subcommands, in help order. A new subcommand (e.g. `bench`) adds its `_add_<name>` function here.
SUBCOMMANDS: List[Callable] = [_add_validate, _add_plan, _add_schema, _add_bench, _add_report, _add_compare]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tedebug",
        description="tedebug: precision debugging for low-precision training (TransformerEngine-compatible configs)",
    )
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
