"""Fixtures for tests/integration/: see tests/conftest.py for the shared ones (sandbox3 and
sandbox4 included: session-wide, so that tests/test_json_shapes.py shares them too)."""
