"""Compute kernels below both ``model/`` and ``parallel/`` (no imports from either)."""
