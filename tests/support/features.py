"""Shared helpers of the feature tests: a recording sink, a one-section config and a session context."""

from __future__ import annotations

import contextlib

from tedebug import debug_api
from tedebug.sinks.base import Sink


class RecordingSink(Sink):
    """Keeps every emitted statistic: `rows` is a list of (name, value, iteration)."""

    def __init__(self):
        self.rows = []

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.rows.append((name, value, iteration))

    def values(self):
        """{(name, iteration): value}; a statistic emitted twice for one iteration is a test failure."""
        out = {}
        for name, value, iteration in self.rows:
            assert (name, iteration) not in out, f"{name} emitted twice for iteration {iteration}"
            out[(name, iteration)] = value
        return out


def section(features, **layers):
    """A one-section config selecting every layer (or `layers`) with the given transformer_engine features."""
    return {
        "test": {
            "enabled": True,
            "layers": layers or {"layer_name_regex_pattern": ".*"},
            "transformer_engine": features,
        }
    }


@contextlib.contextmanager
def debug_session(config, log_dir, sink=None, **kwargs):
    """initialize(config) ... end_debug(), even when the body fails."""
    debug_api.initialize(config, statistics_logger=sink, log_dir=str(log_dir), **kwargs)
    try:
        yield debug_api.transformer_engine
    finally:
        debug_api.end_debug()
