"""Benchmarks: scripts that print ratios measured side by side in one run (``nox -s bench``)."""
