"""Shared pytest configuration."""

from hypothesis import settings

# Tests check correctness, never wall-clock time: hypothesis's default 200 ms deadline per example failed
# property tests on a machine busy with real engines (test_pairing, 369 ms once, 6 ms when rerun).
settings.register_profile("disagg", deadline=None)
settings.load_profile("disagg")
