"""Measure the figures of docs/reliability.md: hostile configs tried / rejected clearly / crashed, the slowest
rejection, and kill trials / iterations lost.  Run once from the repository root (a few minutes on 2 CPU cores):

    .venv/bin/python tools/measure_reliability.py [--mutants 300] [--kills 40]

"Rejected clearly" means a `ConfigError` whose first line names the file (or ``<dict>``); "crashed" means any other
exception.  A mutant of a shipped config may also load (it is still valid).  Kill trials run tests/fault_child.py and
end it after a random number of steps by SIGKILL, SIGTERM, SIGINT or an uncaught exception (equal shares); an
iteration is lost when its `step()` returned but its statistics are missing from the JSONL file, the text file
or the TensorBoard event files.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import random
import sys
import tempfile
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fault_trials  # noqa: E402
import hostile_configs  # noqa: E402
from tedebug.config import ConfigError, load_config  # noqa: E402
from tedebug.registry import build_registry  # noqa: E402


def measure_configs(folder: pathlib.Path, mutants: int) -> dict:
    registry = build_registry()
    names, validators = registry.feature_names(), registry.feature_validators()
    figures = collections.Counter()
    slowest = (0.0, "")
    crashes = []
    groups = (
        ("hand-written", hostile_configs.hand_written(folder / "hand")),
        ("mutant", hostile_configs.mutants(folder / "mutants", mutants, seed=2026)),
    )
    for group, cases in groups:
        for label, source in cases:
            figures[f"{group} tried"] += 1
            start = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    load_config(source, feature_names=names, feature_validators=validators)
                figures[f"{group} loaded"] += 1
            except ConfigError as err:
                where = "<dict>" if isinstance(source, dict) else str(source)
                clear = str(err).splitlines()[0].startswith(where)
                figures[f"{group} rejected clearly" if clear else f"{group} rejected without the file"] += 1
            except Exception as err:  # noqa: BLE001 - counted: that is what is measured
                figures[f"{group} crashed"] += 1
                crashes.append(f"{label}: {type(err).__name__}: {err}")
            elapsed = time.perf_counter() - start
            if elapsed > slowest[0]:
                slowest = (elapsed, label)
    return {"figures": dict(figures), "slowest": slowest, "crashes": crashes}


def measure_kills(folder: pathlib.Path, trials: int) -> dict:
    rng = random.Random(18)
    ways = ("SIGKILL", "SIGTERM", "SIGINT", "exception")
    table = {how: collections.Counter() for how in ways}
    for index in range(trials):
        how = ways[index % len(ways)]
        result = fault_trials.kill_trial(how, str(folder / f"trial_{index:03d}"), after=rng.randint(0, 60))
        row = table[how]
        row["trials"] += 1
        row["iterations returned"] += len(result.returned)
        row["iterations lost"] += len(result.lost)
        row["trials losing the last iteration only"] += int(bool(result.lost) and result.lost == {max(result.returned)})
        row["trials losing more"] += int(bool(result.lost - {max(result.returned)}))
        row["malformed lines"] += len(result.bad_lines)
        row["wrong values"] += len(result.wrong_values)
    return {how: dict(counts) for how, counts in table.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=300)
    parser.add_argument("--kills", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        configs = measure_configs(folder, args.mutants)
        print("configs:", configs["figures"])
        print(f"slowest load: {configs['slowest'][0]:.3f} s ({configs['slowest'][1]})")
        for crash in configs["crashes"]:
            print("  crash:", crash)
        for how, counts in measure_kills(folder, args.kills).items():
            print(f"kills {how}: {counts}")


if __name__ == "__main__":
    main()
