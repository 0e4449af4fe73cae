"""A feature file whose import fails (used to test the error naming the file)."""

import tedebug_module_that_does_not_exist  # noqa: F401
