"""Benchmarks of the bundle's heavy pieces, one command per section.

Run from the repository root, e.g. ``python -m scripts.benchmark entropy --repeats 3``; ``inferring`` and
``suggestion`` compare this tree with a checkout of an earlier version (``git worktree add /tmp/reference v0.9.0``).
"""

from __future__ import annotations

from scripts.benchmarks.entropy import entropy
from scripts.benchmarks.inference import inference, inference_3d, template_cache
from scripts.benchmarks.inferring import inferring
from scripts.benchmarks.refinement import refinement
from scripts.benchmarks.scale import inferring_scale, templates_scale
from scripts.benchmarks.scale_plot import scale_plot
from scripts.benchmarks.scale_training import training_scale
from scripts.benchmarks.suggestion import suggestion
from scripts.benchmarks.training import training, training_3d
from scripts.cli import run_fire


def all(repeats: int = 3) -> None:  # noqa: A001 - the CLI's name for every section
    """Every section in turn."""
    entropy(repeats=repeats)
    training()
    inference(repeats=repeats)


COMMANDS = {
    "entropy": entropy,
    "training": training,
    "inference": inference,
    "all": all,
    "training_3d": training_3d,
    "inference_3d": inference_3d,
    "template_cache": template_cache,
    "inferring": inferring,
    "suggestion": suggestion,
    "refinement": refinement,
    "inferring_scale": inferring_scale,
    "templates_scale": templates_scale,
    "training_scale": training_scale,
    "scale_plot": scale_plot,
}

if __name__ == "__main__":
    run_fire(COMMANDS)
