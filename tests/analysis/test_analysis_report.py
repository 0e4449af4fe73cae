"""tedebug report: the HTML page of the demo's runs (an FP8 run compared with its bf16 twin), its figures, tables
and the folder-of-figures format; non-finite events of a synthetic run."""

import base64
import contextlib
import html.parser
import io
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from tedebug import cli
from tedebug.analysis import plots, report
from tedebug.sinks.jsonl import JsonlSink

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "examples"))

import train_gpt  # noqa: E402

FP8_STATS = {"underflows%", "mse", "mxfp8_mse"}  # configs/demo.yaml, LogFp8TensorStats (bf16 twin: mxfp8_mse only)
HP_STATS = {"max", "std", "cur_amax", "dynamic_range", "nan_count"}  # LogTensorStats (both runs)


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """(fp8 log_dir, bf16 log_dir): 12 steps each of the demo (statistics at iterations 0 and 10)."""
    runs = []
    for recipe in ("current", "bf16"):
        log_dir = str(tmp_path_factory.mktemp(recipe))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train_gpt.main(["--steps", "12", "--log-dir", log_dir, "--device", "cpu", "--recipe", recipe])
        runs.append(log_dir)
    return tuple(runs)


def read_record(log_dir):
    """{(layer, tensor, stat, iteration): value} straight from the JSONL file (an oracle independent of pandas)."""
    path = os.path.join(log_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl")
    with open(path) as f:
        return {
            (r["layer"], r["tensor"], r["stat"], r["iteration"]): r["value"]
            for r in map(json.loads, f)
            if r["layer"] is not None
        }


class Page(html.parser.HTMLParser):
    """The figures (attributes + decoded image), section ids and table rows of a report page."""

    def __init__(self):
        super().__init__()
        self.figures, self.sections, self.rows, self.links = [], [], [], []
        self._row = None
        self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.figures.append(attrs)
        elif tag == "img":
            self.figures[-1]["png"] = attrs["src"]
        elif tag == "section":
            self.sections.append(attrs["id"])
        elif tag == "tr":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = ""
        for key in ("src", "href"):
            if key in attrs:
                self.links.append(attrs[key])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag == "td" and self._row is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr":
            if self._row:
                self.rows.append((self.sections[-1], self._row))
            self._row = None


def png_size(data_uri):
    """(width, height) from the PNG's IHDR chunk (checks the signature)."""
    prefix = "data:image/png;base64,"
    assert data_uri.startswith(prefix)
    raw = base64.b64decode(data_uri[len(prefix) :])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    return struct.unpack(">II", raw[16:24])


@pytest.fixture(scope="module")
def page(demo_runs, tmp_path_factory):
    fp8, bf16 = demo_runs
    out = str(tmp_path_factory.mktemp("report") / "report.html")
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        assert cli.main(["report", fp8, "--compare", bf16, "-o", out]) == 0
    assert stdout.getvalue().startswith(f"wrote {out} (")
    with open(out, encoding="utf-8") as f:
        text = f.read()
    parsed = Page()
    parsed.feed(text)
    parsed.close()
    return text, parsed


def test_report_has_every_section_and_chart(page, demo_runs):
    text, parsed = page
    assert parsed.sections == ["overview", "nonfinite", "worst", "heatmaps", "statistics", "comparison", "config"]
    kinds = {}
    for figure in parsed.figures:
        kinds.setdefault(figure["data-kind"], []).append(figure["data-stat"])
        width, height = png_size(figure["png"])
        assert width > 300 and height > 150
    logged = {stat for _, _, stat, _ in read_record(demo_runs[0])}
    assert logged == HP_STATS | FP8_STATS
    assert sorted(kinds["lines"]) == sorted(logged)  # one chart per statistic
    assert sorted(kinds["heatmap"]) == sorted({"dynamic_range", "underflows%", "mse", "mxfp8_mse"})
    both = logged & {stat for _, _, stat, _ in read_record(demo_runs[1])}
    assert both >= HP_STATS | {"mxfp8_mse"}  # the bf16 twin logs what-if statistics of its high-precision tensors
    assert sorted(kinds["compare"]) == sorted(both)  # the statistics both runs logged
    # self-contained: nothing is fetched (only data URIs and in-page anchors)
    assert all(link.startswith(("data:image/png;base64,", "#")) for link in parsed.links)
    with open(os.path.join(REPO, "configs", "demo.yaml")) as f:
        config = f.read()
    assert html.escape(config, quote=False) in text or html.escape(config) in text


def test_worst_layers_table_matches_the_record(page, demo_runs):
    _, parsed = page
    record = read_record(demo_runs[0])
    table = [row for section, row in parsed.rows if section == "worst"]
    for stat in ("mse", "underflows%", "max"):
        peaks = {}
        for (layer, tensor, s, iteration), value in record.items():
            if s == stat and ((layer, tensor) not in peaks or abs(value) > abs(peaks[(layer, tensor)][0])):
                peaks[(layer, tensor)] = (value, iteration)
        ranked = sorted(peaks.items(), key=lambda kv: -abs(kv[1][0]))[:3]
        rows = [row for row in table if row[0] == stat]
        assert [(row[2], row[3]) for row in rows] == [key for key, _ in ranked]
        for row, (key, (value, iteration)) in zip(rows, ranked):
            assert row[4] == f"{value:.5g}" and int(row[5]) == iteration


def test_comparison_text_is_part_of_the_page(page, demo_runs):
    text, _ = page
    fp8, bf16 = demo_runs
    from tedebug.analysis.compare import compare_runs, format_comparison

    expected = format_comparison(compare_runs(fp8, bf16))
    assert html.escape(expected, quote=False) in text.replace("&#x27;", "'").replace("&quot;", '"')


def test_figure_folder_format(demo_runs, tmp_path):
    out = str(tmp_path / "figs")
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["report", demo_runs[0], "--format", "svg", "-o", out, "--stat", "mse", "max"]) == 0
    assert sorted(os.listdir(out)) == ["heatmap_mse.svg", "lines_max.svg", "lines_mse.svg", "report.txt"]
    with open(os.path.join(out, "lines_mse.svg")) as f:
        assert "<svg" in f.read(2000)
    with open(os.path.join(out, "report.txt")) as f:
        summary = f.read()
    assert "== Worst layers ==" in summary and "== Config ==" in summary


def write_nonfinite_run(run_dir):
    sink = JsonlSink(os.path.join(run_dir, "tedebug_statistics", "metrics_globalrank-0.jsonl"))
    records = []
    for iteration in range(0, 50, 10):
        bad = iteration >= 20
        records += [
            ("l0_activation_nan_count", 0, iteration, "l0", "activation", "nan_count"),
            ("l1_gradient_nan_count", 7 if bad else 0, iteration, "l1", "gradient", "nan_count"),
            ("l1_gradient_max", float("nan") if bad else 1.0, iteration, "l1", "gradient", "max"),
            ("l0_activation_max", 2.0, iteration, "l0", "activation", "max"),
        ]
    sink.log_scalars(records)
    sink.close()
    os.makedirs(os.path.join(run_dir, "nvdlfw_inspect_logs"))
    with open(os.path.join(run_dir, "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log"), "w") as f:
        f.write(
            "2026-01-01 00:00:00,000 - INFO - Reading config from Python dictionary.\n"
            "2026-01-01 00:00:01,000 - WARNING - LAYER=l1: First non-finite values: layer=l1 tensor=gradient "
            "gemm=dgrad/wgrad iteration=20 nan_count=7 inf_count=0\n"
        )


def test_nonfinite_events_name_layer_tensor_gemm_and_iterations(tmp_path):
    write_nonfinite_run(str(tmp_path))
    built = report.build_report(str(tmp_path))
    section = next(s for s in built.sections if s.anchor == "nonfinite")
    lines = section.text.splitlines()
    assert lines[0].split() == [
        "layer",
        "tensor",
        "GEMMs",
        "statistic",
        "event",
        "first",
        "iteration",
        "last",
        "iteration",
        "iterations",
        "largest",
        "count",
    ]
    assert lines[2].split() == ["l1", "gradient", "dgrad/wgrad", "nan_count", "count", ">", "0", "20", "40", "3", "7"]
    assert lines[3].split() == ["l1", "gradient", "dgrad/wgrad", "max", "value", "is", "NaN/Inf", "20", "40", "3", "-"]
    assert lines[4].endswith(
        "First non-finite values: layer=l1 tensor=gradient gemm=dgrad/wgrad iteration=20 nan_count=7 inf_count=0"
    )
    config = next(s for s in built.sections if s.anchor == "config")
    assert "Python dictionary" in config.text


def test_downsample_keeps_the_largest_value_per_bin():
    iterations = np.arange(10) * 5
    matrix = np.array([[0, 1, 9, 2, 3, 4, 5, 6, 7, 8], [np.nan] * 4 + [1, np.nan, 2, 3, np.nan, np.nan]], float)
    its, binned = plots.downsample(iterations, matrix, max_columns=4)  # bins of columns [0,2) [2,5) [5,7) [7,10)
    assert its.tolist() == [0, 10, 25, 35]
    assert binned[0].tolist() == [1, 9, 5, 8]
    assert np.isnan(binned[1, 0]) and binned[1, 1:].tolist() == [1, 2, 3]
    same_its, same = plots.downsample(iterations, matrix, max_columns=10)
    assert same is matrix and same_its is iterations


@pytest.mark.browser
def test_report_renders_in_headless_chromium(page, tmp_path):
    """Render the page as a person would open it (Debian's `chromium`) and check the screenshot shows charts."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    text, _ = page
    path, shot = tmp_path / "report.html", tmp_path / "shot.png"
    path.write_text(text, encoding="utf-8")
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=1400,4000",
            path.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[:2] == (4000, 1400)
    coloured = np.abs(pixels[..., 0] - pixels[..., 2]) > 0.2  # chart colours (not grey text on white)
    assert coloured.mean() > 0.02
