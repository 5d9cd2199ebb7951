"""Test helpers shared by the suites."""
