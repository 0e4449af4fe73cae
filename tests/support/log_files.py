"""The statistics files of a debug session as comparable text: what two runs that must log the same are compared by."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List


def log_file_lines(log_dir: Path) -> Dict[str, List[str]]:
    """Every ``.jsonl`` and ``.log`` file under `log_dir` (path relative to it -> its lines), with `log_dir` itself
    written as ``<log_dir>`` and the text logs' timestamps (each line's first two words) left out."""
    files = {}
    for path in sorted(log_dir.rglob("*")):
        if path.is_file() and path.suffix in (".jsonl", ".log"):
            lines = path.read_text().replace(str(log_dir), "<log_dir>").splitlines()
            if path.suffix == ".log":
                lines = [line.split(" ", 2)[-1] for line in lines]
            files[str(path.relative_to(log_dir))] = lines
    return files
