"""Readable references of the runtime's fast paths (tests and benchmarks only).

Each module is the plain reading of a fast path in ``src/lrmoe`` — loops where the
runtime sorts, torch where it uses numpy, masks where it compacts — and the tests compare
the two on fresh random inputs (docs/design.md §1 conventions).
"""
