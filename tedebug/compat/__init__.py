"""Compatibility with code written for NVIDIA's nvdlfw-inspect and TransformerEngine's debug tools.

- `tedebug.compat.nvdlfw_inspect`: the public modules of nvdlfw-inspect (``api``, ``registry``, ``base``,
  ``logging``, ``utils``, ``config_manager``, ``debug_features.log_tensor_stats``) backed by tedebug.  A script
  written for TE's debug tools changes one import: ``import nvdlfw_inspect.api as debug_api`` becomes
  ``import tedebug.compat.nvdlfw_inspect.api as debug_api``.
- `tedebug.compat.te_features_api`: ``TEConfigAPIMapper`` (TE's ``transformer_engine.debug.features.api``).
- `tedebug.compat.aliases`: while tedebug executes a feature file, ``nvdlfw_inspect.*`` and
  ``transformer_engine.debug.features.api`` resolve to the modules above, so feature files load unchanged.
"""
