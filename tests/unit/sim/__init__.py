"""Tests of the cluster simulator."""
