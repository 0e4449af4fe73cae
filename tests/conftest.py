"""Fixtures shared by the test modules (helpers that are not fixtures live in tests/support/, imported as
`support.<module>`; pytest puts this folder on sys.path)."""

import pytest

from tedebug import debug_api


@pytest.fixture
def no_debug_session():
    """No tedebug session before the test and none left after it, and no sink queued for the next initialize."""
    debug_api.end_debug()
    debug_api._queued_sinks.clear()
    yield
    debug_api.end_debug()
    debug_api._queued_sinks.clear()
