"""The bundle's command-line tools: data preparation, template building, benchmarks, packaging and checks
(the experiments behind docs/results.md are in ``scripts/experiments/``, outside the zoo archive).

Run from the repository root as modules, e.g. ``python -m scripts.prepare_data labelme --root DIR --out D``.
"""
