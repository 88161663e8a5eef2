"""Benchmarks for ooo_wrap: the model families, the A/B suite and the host-overhead probe.

Run them as scripts (``python benchmarks/suite.py``, ``python benchmarks/overhead.py``);
the package form exists so that the tests and ``scripts/`` can import the same code.
"""
