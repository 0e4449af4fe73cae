"""nvdlfw-inspect's public modules, backed by tedebug (see `tedebug.compat`).

``import tedebug.compat.nvdlfw_inspect.api as debug_api`` replaces ``import nvdlfw_inspect.api as debug_api``;
feature files importing ``nvdlfw_inspect.*`` load unchanged through `tedebug.compat.aliases`.  What still differs
from nvdlfw-inspect is listed in docs/differences.md ("nvdlfw-inspect compatibility").
"""
