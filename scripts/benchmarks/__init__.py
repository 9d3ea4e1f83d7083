"""The sections of ``python -m scripts.benchmark``, one module per measurement."""
