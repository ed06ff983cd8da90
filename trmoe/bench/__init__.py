"""Benchmarks (`python -m trmoe.bench <name>`): measured side by side in one run, reported as ratios."""
