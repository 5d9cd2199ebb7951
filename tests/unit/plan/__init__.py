"""Tests of `hpd plan`, the capacity planner."""
