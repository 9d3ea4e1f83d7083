"""The bundle's command-line tools: data preparation, template building, experiments, packaging and checks.

Run from the repository root as modules, e.g. ``python -m scripts.prepare_data labelme --root DIR --out D``.
"""
