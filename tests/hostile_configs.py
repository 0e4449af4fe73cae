"""A corpus of hostile debug configs, shared by tests/test_fault_injection.py (CI) and tools/measure_reliability.py
(the figures in docs/reliability.md).

`hand_written(folder)` writes every hand-written hostile config into `folder` and returns ``[(label, source)]``
where `source` is what goes to `load_config` / `initialize` (a path, or a dict for the dict-only cases).  Every one
of them must be rejected with a `ConfigError` naming the file.  `mutants(folder, count, seed)` writes `count`
random mutants of the shipped configs (configs/*.yaml): each must either load or be rejected with a `ConfigError`,
never another exception.
"""

from __future__ import annotations

import os
import pathlib
import random
from typing import List, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))

GOOD = """\
s:
  enabled: True
  layers:
    layer_types: [fc1]
  transformer_engine:
    LogTensorStats:
      enabled: True
      tensors: [activation]
      stats: [max]
"""


def _alias_bomb(levels: int, width: int = 9) -> str:
    text = "a0: &a0 [" + ", ".join(['"lol"'] * width) + "]\n"
    for level in range(1, levels):
        text += f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]\n"
    return text


def _replace(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new)


# (label, YAML text or bytes) -- each must be rejected with a ConfigError
_TEXTS: List[Tuple[str, object]] = [
    ("alias bomb 9^6", _alias_bomb(6)),
    ("alias bomb 9^9", _alias_bomb(9)),
    ("alias bomb 9^12", _alias_bomb(12)),
    (
        "alias bomb inside a section",
        GOOD + "  bomb:\n" + "".join("    " + line + "\n" for line in _alias_bomb(9).splitlines()),
    ),
    ("900-deep flow sequence", "a: " + "[" * 900 + "]" * 900 + "\n"),
    ("900-deep flow mapping", "a: " + "{a: " * 900 + "1" + "}" * 900 + "\n"),
    ("200-deep block mapping", "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "v\n"),
    ("NUL byte", GOOD.replace("[max]", "[max\x00]")),
    ("bell character", GOOD.replace("[max]", "[max\x07]")),
    ("invalid UTF-8", GOOD.encode() + b"  x: \xff\xfe\n"),
    ("UTF-16 file", GOOD.encode("utf-16")),
    ("truncated UTF-8 sequence", GOOD.encode() + b"# \xe2\x82\n"),
    ("lone surrogate bytes", GOOD.encode() + b"# \xed\xa0\x80\n"),
    ("over 1 MiB of comments", "#" + "x" * (1 << 20) + "\n" + GOOD),
    ("over 100k nodes", "big: [" + ", ".join("1" for _ in range(100_001)) + "]\n"),
    ("empty file", ""),
    ("only comments", "# nothing\n# here\n"),
    ("top-level list", "- a\n- b\n"),
    ("top-level scalar", "42\n"),
    ("unclosed bracket", GOOD.replace("[max]", "[max")),
    ("tab indentation", GOOD.replace("  enabled: True\n  layers", "\tenabled: True\n  layers")),
    ("duplicate key", GOOD + "s:\n  enabled: False\n"),
    ("two documents", GOOD + "---\n" + GOOD),
    ("python tag", GOOD.replace("[max]", "!!python/object/apply:os.system ['true']")),
    ("unknown tag", GOOD.replace("[max]", "!custom [max]")),
    ("recursive alias", "s: &s\n  enabled: True\n  layers: {layer_types: [x]}\n  self: *s\n"),
    ("merge key bomb", _alias_bomb(8) + "m:\n  <<: {x: *a7}\n"),
    ("enabled 'False' string", _replace("  enabled: True\n  layers", "  enabled: 'False'\n  layers")),
    ("enabled '0' string", _replace("  enabled: True\n  layers", "  enabled: '0'\n  layers")),
    ("enabled [False]", _replace("  enabled: True\n  layers", "  enabled: [False]\n  layers")),
    ("enabled 0", _replace("  enabled: True\n  layers", "  enabled: 0\n  layers")),
    ("enabled 1", _replace("  enabled: True\n  layers", "  enabled: 1\n  layers")),
    ("enabled null", _replace("  enabled: True\n  layers", "  enabled:\n  layers")),
    ("feature enabled 'False'", _replace("      enabled: True", "      enabled: 'False'")),
    ("feature enabled 'no' string", _replace("      enabled: True", "      enabled: 'no'")),
    ("feature enabled {}", _replace("      enabled: True", "      enabled: {}")),
    ("feature enabled 2.5", _replace("      enabled: True", "      enabled: 2.5")),
    ("feature without enabled", _replace("      enabled: True\n", "")),
    ("section without enabled", _replace("  enabled: True\n  layers", "  layers")),
    ("section without layers", _replace("  layers:\n    layer_types: [fc1]\n", "")),
    ("empty tensors", _replace("[activation]", "[]")),
    ("tensors items commented out", _replace("      tensors: [activation]", "      tensors:\n      # - activation")),
    (
        "empty gemms",
        GOOD.replace(
            "    LogTensorStats:",
            "    FakeQuant:\n      enabled: True\n      gemms: []\n"
            "      tensors: [activation]\n      quant_format: FP8E4M3\n    LogTensorStats:",
        ),
    ),
    ("empty stats", _replace("[max]", "[]")),
    ("stats string", _replace("[max]", "max")),
    ("stats typo l2norm", _replace("[max]", "[l2norm]")),
    ("stat of another feature", _replace("[max]", "[underflows%]")),
    ("unknown stat", _replace("[max]", "[median]")),
    ("layer_types string", _replace("[fc1]", "fc1")),
    ("layer_types empty", _replace("[fc1]", "[]")),
    ("layer_types number", _replace("[fc1]", "[3]")),
    ("layer_numbers negative", _replace("layer_types: [fc1]", "layer_numbers: [-1]")),
    ("layer_numbers bad range", _replace("layer_types: [fc1]", "layer_numbers: ['5-2']")),
    ("layer_numbers float", _replace("layer_types: [fc1]", "layer_numbers: [1.5]")),
    ("bad regex", _replace("layer_types: [fc1]", "layer_name_regex_pattern: '(unclosed'")),
    ("regex not a string", _replace("layer_types: [fc1]", "layer_name_regex_pattern: [a]")),
    ("layers empty mapping", _replace("    layer_types: [fc1]\n", "    {}\n").replace("layers:\n    {}", "layers: {}")),
    ("layers unknown key", _replace("layer_types", "layer_type")),
    ("layers a list", _replace("  layers:\n    layer_types: [fc1]", "  layers: [fc1]")),
    ("section without features", "s:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n"),
    ("empty namespace block", "s:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n  transformer_engine:\n"),
    ("empty feature block", _replace("      enabled: True\n      tensors: [activation]\n      stats: [max]\n", "")),
    # (a section-level LogTensorStats is nvdlfw-inspect's generic base feature: valid, with a warning)
    (
        "feature outside its namespace",
        "s:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n"
        "  LogFp8TensorStats:\n    enabled: True\n    tensors: [activation]\n"
        "    stats: [underflows%]\n",
    ),
    (
        "FakeQuant outside its namespace",
        "s:\n  enabled: True\n  layers:\n    layer_types: [fc1]\n"
        "  FakeQuant:\n    enabled: True\n    gemms: [fprop]\n"
        "    tensors: [activation]\n    quant_format: FP8E4M3\n",
    ),
    ("unknown namespace", _replace("transformer_engine:", "transformer_engin:")),
    ("unknown feature", _replace("LogTensorStats:", "LogTensorStat:")),
    (
        "feature block a list",
        _replace(
            "    LogTensorStats:\n      enabled: True\n      tensors: [activation]\n      stats: [max]\n",
            "    LogTensorStats: [1, 2]\n",
        ),
    ),
    ("feature unknown key", _replace("      stats: [max]", "      stats: [max]\n      frequency: 2")),
    ("freq 0", _replace("      stats: [max]", "      stats: [max]\n      freq: 0")),
    ("freq string", _replace("      stats: [max]", "      stats: [max]\n      freq: '10'")),
    ("freq bool", _replace("      stats: [max]", "      stats: [max]\n      freq: True")),
    ("start after end", _replace("      stats: [max]", "      stats: [max]\n      start_step: 9\n      end_step: 3")),
    ("start_end_list reversed", _replace("      stats: [max]", "      stats: [max]\n      start_end_list: [[5, 2]]")),
    ("start_end_list triple", _replace("      stats: [max]", "      stats: [max]\n      start_end_list: [[1, 2, 3]]")),
    ("negative start_step", _replace("      stats: [max]", "      stats: [max]\n      start_step: -3")),
    ("unknown tensor name", _replace("[activation]", "[activations]")),
    ("tensor name number", _replace("[activation]", "[7]")),
    (
        "tensors_struct without tensor",
        _replace("      tensors: [activation]", "      tensors_struct:\n        - stats: [max]"),
    ),
    ("blockwise block_size 0", _replace("[max]", "[{max_blockwise_dynamic_range: {block_size: 0}}]")),
    ("blockwise dims 3", _replace("[max]", "[{max_blockwise_dynamic_range: {block_size: 4, dims: 3}}]")),
    ("blockwise unknown key", _replace("[max]", "[{max_blockwise_dynamic_range: {size: 4}}]")),
    ("blockwise as a string", _replace("[max]", "[max_blockwise_dynamic_range]")),
    (
        "FakeQuant bad format",
        GOOD.replace(
            "    LogTensorStats:",
            "    FakeQuant:\n      enabled: True\n"
            "      gemms: [fprop]\n      tensors: [activation]\n"
            "      quant_format: FP8E3M4\n    LogTensorStats:",
        ),
    ),
    (
        "FakeQuant bad gemm",
        GOOD.replace(
            "    LogTensorStats:",
            "    FakeQuant:\n      enabled: True\n"
            "      gemms: [fprop2]\n      tensors: [activation]\n"
            "      quant_format: FP8E4M3\n    LogTensorStats:",
        ),
    ),
    (
        "gemms_struct with enabled",
        GOOD.replace(
            "    LogTensorStats:",
            "    DisableQuantizationGEMM:\n"
            "      enabled: True\n      gemms_struct:\n"
            "        - gemm: fprop\n          enabled: True\n    LogTensorStats:",
        ),
    ),
    (
        "DumpTensors flag string",
        GOOD.replace(
            "    LogTensorStats:",
            "    DumpTensors:\n      enabled: True\n"
            "      tensors: [activation]\n      high_precision_tensor: 'yes'\n"
            "    LogTensorStats:",
        ),
    ),
    (
        "garbage in a disabled section",
        GOOD + "spare:\n  enabled: False\n  layers: {layer_typo: [x]}\n"
        "  transformer_engine:\n    NoSuchFeature: {enabled: True}\n",
    ),
    (
        "garbage in a disabled feature",
        _replace(
            "      stats: [max]",
            "      stats: [max]\n    FakeQuant:\n"
            "      enabled: False\n      gemms: [fprop]\n"
            "      tensors: [activation]\n      quant_format: bogus",
        ),
    ),
    ("every section disabled", _replace("  enabled: True\n  layers", "  enabled: False\n  layers")),
    ("section is a list", "s: [1, 2]\n"),
    ("section is a string", "s: on\n"),
    ("non-string section key", "? [a, b]\n: {enabled: True}\n"),
    ("huge integer", _replace("      stats: [max]", "      stats: [max]\n      freq: " + "9" * 5000)),
    ("BOM then garbage", "\ufeff" + GOOD + "  : :\n"),
]

# (label, dict source) -- dict-only hostile inputs (no file)
_DICTS: List[Tuple[str, object]] = [
    (
        "dict: enabled 'False'",
        {
            "s": {
                "enabled": "False",
                "layers": {"layer_types": ["x"]},
                "transformer_engine": {
                    "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["max"]}
                },
            }
        },
    ),
    ("dict: enabled numpy-like int", {"s": {"enabled": 1, "layers": {"layer_types": ["x"]}}}),
    (
        "dict: non-str stat",
        {
            "s": {
                "enabled": True,
                "layers": {"layer_types": ["x"]},
                "transformer_engine": {
                    "LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": [object()]}
                },
            }
        },
    ),
    ("dict: empty", {}),
    ("dict: tuple section", {"s": (1, 2)}),
]


def hand_written(folder: pathlib.Path) -> List[Tuple[str, object]]:
    """Write the hand-written hostile configs into `folder`; ``[(label, source)]`` (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    cases: List[Tuple[str, object]] = []
    for index, (label, content) in enumerate(_TEXTS):
        path = folder / f"hostile_{index:03d}.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8", errors="surrogatepass")
        cases.append((label, str(path)))
    fifo = folder / "fifo.yaml"
    if hasattr(os, "mkfifo"):
        if not fifo.exists():
            os.mkfifo(fifo)
        cases.append(("a FIFO as the config path", str(fifo)))
    directory = folder / "a_directory.yaml"
    directory.mkdir(exist_ok=True)
    cases.append(("a directory as the config path", str(directory)))
    if os.path.exists("/dev/zero"):
        cases.append(("/dev/zero as the config path", "/dev/zero"))
    dangling = folder / "dangling.yaml"
    if not dangling.is_symlink():
        dangling.symlink_to(folder / "does_not_exist.yaml")
    cases.append(("a dangling symlink", str(dangling)))
    cases.extend(_DICTS)
    return cases


_MUTATIONS = (
    "drop_line",
    "duplicate_line",
    "swap_lines",
    "truncate",
    "quote_bool",
    "flip_bool",
    "typo_key",
    "typo_value",
    "indent",
    "dedent",
    "empty_list",
    "insert_tab",
    "insert_control",
    "insert_alias",
    "stringify_list",
)


def _mutate(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    kind = rng.choice(_MUTATIONS)
    i = rng.randrange(len(lines))
    line = lines[i]
    if kind == "drop_line":
        del lines[i]
    elif kind == "duplicate_line":
        lines.insert(i, line)
    elif kind == "swap_lines":
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "truncate":
        return text[: rng.randrange(len(text))]
    elif kind == "quote_bool":
        return text.replace("True", "'False'", 1) if "True" in text else text.replace("False", "'True'", 1)
    elif kind == "flip_bool":
        return text.replace("True", "False")
    elif kind == "typo_key" and ":" in line:
        key, rest = line.split(":", 1)
        lines[i] = f"{key[:-1]}:{rest}" if len(key.strip()) > 1 else line
    elif kind == "typo_value" and ":" in line:
        lines[i] = line.rstrip("\n") + "x\n"
    elif kind == "indent":
        lines[i] = "  " + line
    elif kind == "dedent":
        lines[i] = line[2:] if line.startswith("  ") else line
    elif kind == "empty_list" and "[" in line:
        lines[i] = line[: line.index("[")] + "[]\n"
    elif kind == "insert_tab":
        lines[i] = "\t" + line
    elif kind == "insert_control":
        position = rng.randrange(len(line) + 1)
        lines[i] = line[:position] + rng.choice("\x00\x01\x1b\x7f") + line[position:]
    elif kind == "insert_alias":
        lines[i] = line.rstrip("\n") + " *missing\n"
    elif kind == "stringify_list" and "[" in line:
        lines[i] = line.replace("[", "'[").replace("]", "]'")
    return "".join(lines)


def mutants(folder: pathlib.Path, count: int, seed: int = 0) -> List[Tuple[str, str]]:
    """Write `count` mutants (one to three mutations each) of the shipped configs; ``[(label, path)]``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        source = rng.choice(SHIPPED)
        text = source.read_text()
        for _ in range(rng.randint(1, 3)):
            text = _mutate(text, rng)
        path = folder / f"mutant_{index:04d}_{source.stem}.yaml"
        path.write_text(text, encoding="utf-8")
        cases.append((f"mutant {index} of {source.name}", str(path)))
    return cases
