"""Fixtures of the sync tests."""

from ._example_peers import cluster  # noqa: F401 - the fixture of the end-to-end tests
