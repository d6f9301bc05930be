"""Fixtures for tests/integration/: see tests/conftest.py for the shared ones."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sandbox3(sandbox_factory):
    """3 hosts without GPUs, shared by the tests of one module and removed after it."""
    sb = sandbox_factory(hosts=3)
    yield sb
    sandbox_factory.down(sb)
