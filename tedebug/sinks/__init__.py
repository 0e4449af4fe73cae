"""tedebug.sinks (see module docstrings)."""
