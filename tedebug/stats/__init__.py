"""tedebug.stats (see module docstrings)."""
