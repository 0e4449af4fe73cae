"""Built-in tedebug features, one module per feature (installed as ``tedebug.features``)."""
