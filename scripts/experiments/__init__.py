"""Experiments: the studies, sweeps and comparison methods behind docs/results.md, outside the shipped package."""
