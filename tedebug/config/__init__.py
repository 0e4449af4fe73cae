"""tedebug.config (see module docstrings)."""
