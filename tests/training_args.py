"""Command-line overrides shared by the tests that run the training command in a subprocess."""

from __future__ import annotations


def tiny_training_args(epochs: int) -> list[str]:
    """A training of seconds on the CPU: 64² images, 32² crops, 4 queries, batches of 2, epochs of 2 iterations,
    validation every 2 epochs, no progress bar."""
    return [
        *("--epochs", str(epochs), "--epoch_length", "2", "--val_interval", "2", "--batch_size", "2"),
        *("--image_size", "[64,64]", "--crop_size", "[32,32]", "--num_queries", "4", "--progress_bar", "False"),
    ]
