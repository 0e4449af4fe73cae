"""tedebug.backends (see module docstrings)."""
