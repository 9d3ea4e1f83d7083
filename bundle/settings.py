"""What the configs' values may be: the rules that read and check a value, naming its key (:func:`as_flag`,
:func:`as_number`, ...), and the settable keys' rules declared once (:data:`SETTINGS`), checked once: every command
checks its config against them before anything is built (:func:`check_settings`, called by the configs'
``initialize`` step, :func:`bundle.commands.check_workflow`, and by :func:`bundle.configs.bundle_parser` for Python
callers). A value that a rule refuses stops the command naming the key and the value; the value the rule gives (a
yes/no word read as a bool, a whole number as an int) replaces the one given, so that the configs pass the keys on
as they are (``'@epochs'``).

A key whose value is an expression or a reference (``$...``, ``@...``) is the config's own derivation and is not
checked here; the checks that need several keys or derived values (``crop_size`` against ``image_size``,
:func:`check_crop_size`) stay where the values meet.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np
from bundle.data.datalist import is_finite_number
from monai.bundle import ConfigParser


def is_unset(value: Any) -> bool:
    """Whether a config value means "none": None, or what a command line gives for it (``--key null``:
    ``monai.bundle run`` drops a ``None`` override, so ``null`` / ``none`` / ``""`` arrive as strings)."""
    return value is None or (isinstance(value, str) and value.strip().casefold() in ("", "null", "none"))


FLAG_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def as_flag(value: Any, key: str, path: bool = False) -> bool | str:
    """A yes/no config value as a bool, given in YAML (``true``) or on the command line (``--key false``, which
    reaches the config as the string ``'false'``): a bool, the integers 1/0, or true/false, yes/no, 1/0 in any case.

    Every yes/no key of :data:`SETTINGS` is read through this as a command starts. Anything else
    raises ``ValueError`` naming ``key`` and the value; with ``path`` (``resume``: yes/no or a checkpoint) any
    other string is returned as given.

    Args:
        value: the config value.
        key: its key, for the error.
        path: any other non-empty string is a path, returned as given.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        flag = FLAG_WORDS.get(value.strip().lower())
        if flag is not None:
            return flag
        if path and value.strip():
            return value
    raise ValueError(f"{key}: expected true or false (yes/no, 1/0, any case), got {value!r}")


def flag_or_auto(value: Any, key: str) -> bool | str:
    """``"auto"`` (in any case), else a yes/no value as :func:`as_flag` reads it (``xfeat_refinement``,
    ``contrast_adaptation``: the run chooses where ``auto``)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return as_flag(value, key)
    except ValueError:
        raise ValueError(f"{key}: expected auto, true or false (yes/no, 1/0, any case), got {value!r}") from None


def as_number(value: Any, key: str, minimum: float | None = None, integer: bool = False, maximum: float | None = None):
    """A numeric config value (an int when ``integer``), refused (``ValueError`` naming ``key`` and the value) when
    it is not a finite number (a bool, NaN, text), below ``minimum`` or above ``maximum``.

    Args:
        value: the config value.
        key: its key, for the error.
        minimum: the lowest value allowed, None: no bound.
        integer: the value must be an integer, returned as an int.
        maximum: the highest value allowed, None: no bound.
    """
    ok = is_finite_number(value) and (not integer or float(value).is_integer())
    if not ok or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        kind = "an integer" if integer else "a finite number"
        if minimum is not None and maximum is not None:
            bound = f" in [{minimum:g}, {maximum:g}]"
        else:
            bound = f" >= {minimum:g}" if minimum is not None else f" <= {maximum:g}" if maximum is not None else ""
        raise ValueError(f"{key}: expected {kind}{bound}, got {value!r}")
    return int(value) if integer else value


def positive_numbers(value: Any, key: str, count: int) -> list[float]:
    """``count`` positive finite numbers (a per-axis spacing in mm, say), refused naming ``key`` otherwise (MONAI's
    ``Spacingd`` pads a short list and ignores extra or zero entries).

    Args:
        value: the config value.
        key: its key, for the error.
        count: how many numbers (one per axis).
    """
    if (
        not isinstance(value, (list, tuple))
        or len(value) != count
        or not all(is_finite_number(v) and v > 0 for v in value)
    ):
        raise ValueError(f"{key}: expected {count} positive numbers, got {value!r}")
    return [float(v) for v in value]


def intensity_window(value: Any, key: str) -> tuple[float, float]:
    """``[low, high]`` with low < high (a CT window in HU), refused naming ``key`` otherwise (reversed, it inverts
    the contrast; equal, it divides by zero).

    Args:
        value: the config value.
        key: its key, for the error.
    """
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(is_finite_number(v) for v in value):
        raise ValueError(f"{key}: expected [low, high], two numbers, got {value!r}")
    if not value[0] < value[1]:
        raise ValueError(f"{key}: expected low < high, got {list(value)!r}")
    return float(value[0]), float(value[1])


def check_image_size(image_size: Any, spatial_dims: int, divisor: int = 16, key: str = "image_size") -> list[int]:
    """``image_size`` as a list of ints, refused (``ValueError`` naming the key and the value) unless it holds
    ``spatial_dims`` positive integers, each divisible by ``divisor`` (both encoders downsample 4 times: 16).

    MONAI's ``Resized`` would read 0 or a negative size as "keep the image's own size" and fail later
    without naming the key; the configs pass ``image_size`` through this wherever they resize.
    """
    values = list(image_size) if isinstance(image_size, (list, tuple)) else None
    if (
        values is None
        or len(values) != spatial_dims
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % divisor == 0 for v in values)
    ):
        need = f", each divisible by {divisor} (the encoder's deepest stride)" if divisor > 1 else ""
        raise ValueError(
            f"{key}: expected {spatial_dims} positive integers (the network grid){need}, got {image_size!r}"
        )
    return [int(v) for v in values]


def check_crop_size(crop_size: Any, image_size: Any, spatial_dims: int, batch_size: int, stride: int = 16) -> list[int]:
    """``crop_size`` checked as :func:`check_image_size` does (naming ``crop_size``), no larger than ``image_size``,
    and large enough that a batch's coarsest crop features hold more than one value per channel (BatchNorm of
    the light encoder fails on one: ``crop_size`` 16 with ``batch_size`` 1, say).

    Args:
        crop_size: the training crops' size, one int per axis.
        image_size: the network grid (:func:`check_image_size`).
        spatial_dims: 2 or 3.
        batch_size: the training batch size.
        stride: the encoders' deepest stride, what each size must be divisible by.

    Returns:
        ``crop_size`` as a list of ints.

    Raises:
        ValueError: naming the key and the value.
    """
    batch_size = as_number(batch_size, "batch_size", minimum=1, integer=True)
    crop = check_image_size(crop_size, spatial_dims, stride, key="crop_size")
    image = check_image_size(image_size, spatial_dims, stride)
    if any(c > i for c, i in zip(crop, image)):
        raise ValueError(f"crop_size: {crop} is larger than image_size {image} along an axis")
    if int(batch_size) * int(np.prod([c // stride for c in crop])) < 2:
        raise ValueError(
            f"crop_size: {crop} with batch_size {batch_size} gives one coarsest feature per channel (stride "
            f"{stride}), too few to normalise: use a larger crop_size or batch_size"
        )
    return crop


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system tells it, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_cpu_threads(cpu_threads: int | str | None) -> int | str | None:
    """``cpu_threads`` as given (null, ``auto`` or a positive integer), an integer above :func:`available_cpus`
    lowered to it with a warning naming the key (more threads than CPUs only slow torch down, and 100000 crashed
    it); another value raises ValueError naming the key.

    Args:
        cpu_threads: the config's ``cpu_threads``.
    """
    if cpu_threads is None or cpu_threads == "auto":
        return cpu_threads
    if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1:
        raise ValueError(f"cpu_threads must be null, 'auto' or a positive integer, got {cpu_threads!r}")
    cpus = available_cpus()
    if cpu_threads > cpus:
        logging.getLogger(__name__).warning(
            f"cpu_threads {cpu_threads}: more than the {cpus} CPUs this process may use; {cpus} threads are used"
        )
        return cpus
    return cpu_threads


Rule = Callable[[Any, str], Any]


def _flag_or_path(value: Any, key: str) -> bool | str:
    return as_flag(value, key, path=True)


def _number(minimum: float | None = None, integer: bool = False, optional: bool = False) -> Rule:
    """A number (an int when ``integer``) >= ``minimum``; null too when ``optional``."""

    def rule(value: Any, key: str) -> Any:
        if optional and is_unset(value):
            return None
        return as_number(value, key, minimum=minimum, integer=integer)

    return rule


def _cpu_threads(value: Any, key: str) -> Any:
    return None if is_unset(value) else check_cpu_threads(value)


def _window(value: Any, key: str) -> list[float]:
    return list(intensity_window(value, key))


def _spacing_3d(value: Any, key: str) -> list[float]:
    return positive_numbers(value, key, 3)


SETTINGS: dict[str, Rule] = {
    # yes/no keys: true/false, yes/no, 1/0 in any case (the command line gives them as words)
    "amp": as_flag,
    "adaptive_augmentation": as_flag,
    "contrast_adaptation": flag_or_auto,  # or auto: chosen on the validation images (3D)
    "cpu_channels_last": as_flag,
    "cudnn_benchmark": as_flag,
    "entropy_sampling": as_flag,
    "overlays": as_flag,
    "pin_memory": as_flag,
    "progress_bar": as_flag,
    "random_init": as_flag,
    "resume": _flag_or_path,  # or the checkpoint to resume from
    # counts and sizes of the training
    "batch_size": _number(1, integer=True),
    "embed_dim": _number(1, integer=True),
    "epoch_length": _number(1, integer=True),
    "epochs": _number(1, integer=True),
    "val_interval": _number(1, integer=True),
    "learning_rate": _number(0),
    "sampling_gamma": _number(0),
    "cache_gb": _number(0),
    "max_minutes": _number(0, optional=True),
    "cpu_threads": _cpu_threads,
    # matching
    "registration_tolerance": _number(0, optional=True),
    # 3D: the CT window in HU and the voxel spacing volumes are resampled to
    "hu_window": _window,
    "target_spacing": _spacing_3d,
}


def _is_expression(value: Any) -> bool:
    return isinstance(value, str) and value.lstrip()[:1] in ("$", "@", "%")


def check_settings(parser: ConfigParser) -> None:
    """Check the values of ``parser``'s config against :data:`SETTINGS` (the keys it has, given as values), each
    replaced by what its rule gives; ``ValueError`` naming the first key a rule refuses."""
    config = parser.get()
    for key, rule in SETTINGS.items():
        if key not in config or _is_expression(config[key]):
            continue
        parser[key] = rule(config[key], key)
