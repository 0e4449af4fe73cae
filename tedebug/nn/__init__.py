"""tedebug.nn (see module docstrings)."""
