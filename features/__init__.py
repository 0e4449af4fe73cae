"""Built-in tedebug features, one module per feature (installed as ``tedebug.features``), and what they share:
`base` (the base classes and run-time helpers), `config_checks` (checking a feature block at load) and
`fp8_stat_names` (LogFp8TensorStats' statistic names).  The registry imports every module here and registers only
the classes decorated with `register_feature`."""
