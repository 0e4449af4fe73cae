"""nvdlfw-inspect's built-in features (``nvdlfw_inspect.debug_features``), loaded by every tedebug session."""
