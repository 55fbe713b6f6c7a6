"""Benchmarks and fault injection: they start the project's processes and measure them from outside.

Nothing in trainer/, inference/ or environments/ imports this package; `python -m benchmarks --help` lists the
commands."""
