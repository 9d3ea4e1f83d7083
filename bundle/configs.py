"""The bundle's YAML configs loaded in Python (scripts, the MONAI Label app, tests), merged as ``monai.bundle run``
does."""

from __future__ import annotations

import ast
import difflib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import fire.parser
import numpy as np
import torch
from bundle.data.datalist import is_finite_number
from bundle.distributed import launched, rank_device
from monai.bundle import ConfigParser
from monai.utils import set_determinism

BUNDLE_ROOT = Path(__file__).resolve().parents[1]

# the config files each command of the bundle merges, in order (paths relative to the bundle root; the README's
# command lines); the 3D configuration merges THREE_D's twin right after each of its 2D files
CONFIG_FILES: dict[str, tuple[str, ...]] = {
    "train": ("configs/train.yaml",),
    "train_multi_gpu": ("configs/train.yaml", "configs/multi_gpu_train.yaml"),
    "train_stage2": ("configs/train.yaml", "configs/train_stage2.yaml"),
    "finetune": ("configs/train.yaml", "configs/train_stage2.yaml", "configs/finetune.yaml"),
    "evaluate": ("configs/train.yaml", "configs/evaluate.yaml"),
    "inference": ("configs/inference.yaml",),
}
THREE_D = {"configs/train.yaml": "configs/train_3d.yaml", "configs/inference.yaml": "configs/train_3d.yaml"}


def config_files(name: str, spatial_dims: int = 2) -> list[str]:
    """The config files of ``name`` (a key of ``CONFIG_FILES``) for 2D images or 3D volumes (``spatial_dims``);
    ``ValueError`` for a name without a 3D configuration asked for 3D."""
    files = list(CONFIG_FILES[name])
    if spatial_dims == 2:
        return files
    if spatial_dims != 3 or not any(f in THREE_D for f in files):
        raise ValueError(f"{name}: no configuration for spatial_dims {spatial_dims!r}")
    return [g for f in files for g in (f, THREE_D.get(f)) if g]


def bundle_parser(
    config_files: str | Sequence[str], bundle_root: str | os.PathLike = BUNDLE_ROOT, **overrides: Any
) -> ConfigParser:
    """A ``ConfigParser`` over ``config_files`` (paths relative to ``bundle_root``, merged in order, nested
    ``a#b`` keys applied), with ``bundle_root`` set and each of ``overrides`` (ids may contain ``#``) set."""
    files = [config_files] if isinstance(config_files, str) else list(config_files)
    parser = ConfigParser()
    parser.read_config([str(Path(bundle_root) / f) for f in files])
    parser["bundle_root"] = str(bundle_root)
    for key, value in overrides.items():
        parser[key] = value
    return parser


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


def is_unset(value: Any) -> bool:
    """Whether a config value means "none": None, or what a command line gives for it (``--key null``:
    ``monai.bundle run`` drops a ``None`` override, so ``null`` / ``none`` / ``""`` arrive as strings)."""
    return value is None or (isinstance(value, str) and value.strip().casefold() in ("", "null", "none"))


FLAG_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def as_flag(value: Any, key: str, path: bool = False) -> bool | str:
    """A yes/no config value as a bool, given in YAML (``true``) or on the command line (``--key false``, which
    reaches the config as the string ``'false'``): a bool, the integers 1/0, or true/false, yes/no, 1/0 in any case.

    Every config reads its yes/no keys through this (``$bundle.configs.as_flag(@key, 'key')``). Anything else
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


def default_device() -> torch.device:
    """The ``device`` key's default: the GPU when there is one (under torchrun, that of the process's ``LOCAL_RANK``),
    else the CPU."""
    if launched():
        return rank_device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_workers() -> int:
    """The ``num_workers`` key's default: with a GPU, 4 data-loading processes (at most the CPUs), so that the view
    pairs' sampling does not stall it; on a CPU the main thread (0)."""
    return min(4, os.cpu_count() or 1) if torch.cuda.is_available() else 0


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, refused (ValueError naming the key) before any work when this machine cannot
    run on it: not a device name, a CUDA device without a CUDA GPU (or beyond the GPUs there are), MPS without it.
    The first step after :func:`check_command_line`, so that a checkpoint is never read onto a missing device."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {str(device)!r} is not a device name (cpu, cuda, cuda:1, mps): {e}") from None
    if device.type not in ("cpu", "cuda", "mps"):  # meta: tensors without data; xla, hip...: not built for here
        raise ValueError(f"device {str(device)!r}: the bundle runs on cpu, cuda (cuda:N) or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r}: this machine has no CUDA GPU (torch.cuda.is_available() is False); use "
                "--device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r}: MPS is not available on this machine; use --device cpu")
    return device


def apply_cpu_threads(cpu_threads: int | str | None) -> int:
    """``cpu_threads`` for a whole command that has no stage-1 step (stage 2, fine-tuning, evaluation; the stage-1 step
    sets its own: :class:`bundle.engines.contrastive.ContrastiveIterationUpdate`): an int sets torch's intra-op
    threads, ``auto`` or null leave torch's setting (one thread per core). Returns the threads in use."""
    threads = check_cpu_threads(cpu_threads)
    if isinstance(threads, int):
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def seed_everything(seed: int, cudnn_benchmark: bool = False) -> int:
    """Seed Python, NumPy and torch with ``monai.utils.set_determinism(seed)`` (the data loader seeds the random
    transforms from torch's generator), then set cuDNN's autotuner to ``cudnn_benchmark``: ``set_determinism``
    turns it off, and on a GPU it is the faster setting (results then vary in the last bits between runs).
    Under torchrun the configs pass ``seed + rank``, so that each process draws its own augmentations."""
    benchmark = as_flag(cudnn_benchmark, "cudnn_benchmark")
    set_determinism(seed=seed)
    torch.backends.cudnn.benchmark = benchmark
    if benchmark:
        torch.backends.cudnn.deterministic = False
    logging.getLogger(__name__).info(
        f"random seed {seed}; cuDNN autotuner {'on' if benchmark else 'off'} (cudnn_benchmark)"
    )
    return seed


# the options of ``python -m monai.bundle run`` that are not config keys
RUN_OPTIONS = {"run_id", "init_id", "final_id", "meta_file", "config_file", "logging_file", "tracking", "args_file"}


def command_line_options(args: Sequence[str]) -> list[tuple[int, str, str | None, bool]]:
    """The ``--key value`` / ``--key=value`` options of a command line (Fire's, as ``monai.bundle`` and the scripts
    read it), up to a lone ``--``: ``(position, key with '-' read as '_', its text or None when it is given without a
    value, whether the text is inline after '=')``."""
    options = []
    for i, token in enumerate(args):
        if token == "--":
            break
        if not token.startswith("--") or len(token) <= 2:
            continue
        key, equals, value = token[2:].partition("=")
        following = args[i + 1] if i + 1 < len(args) else None
        text = value if equals else following if following is not None and not following.startswith("--") else None
        options.append((i, key.replace("-", "_"), text, bool(equals)))
    return options


def stray_words(args: Sequence[str]) -> list[str]:
    """The words of a ``monai.bundle run`` command line (after ``run``) that are neither an option, nor an option's
    value, nor the run id (the first such word, unless ``--run_id`` is given): Fire gives them to ``init_id``,
    ``final_id``, ... and the command runs without them, e.g. the second file of ``--images *.png`` as the shell
    expands it."""
    used, keys = set(), set()
    for i, key, text, inline in command_line_options(args):
        used.add(i)
        keys.add(key)
        if text is not None and not inline:
            used.add(i + 1)
    end = args.index("--") if "--" in args else len(args)
    free = [args[i] for i in range(end) if i not in used]
    return free if "run_id" in keys else free[1:]


def command_line_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str | None]]:
    """(config files, ``{override key: its text}``) of a ``python -m monai.bundle run ID --config_file F --key value
    ...`` command line, the text None for a key given without a value; empty for any other command line."""
    if len(argv) < 2 or Path(argv[0]).parts[-2:] != ("bundle", "__main__.py") or argv[1] != "run":
        return [], {}
    options = {key: text for _, key, text, _ in command_line_options(argv[2:])}
    files = options.get("config_file") or ""
    try:
        parsed = ast.literal_eval(files)
    except (ValueError, SyntaxError):
        parsed = files
    files = [parsed] if isinstance(parsed, str) else list(parsed)
    return [f for f in files if f], {k: v for k, v in options.items() if k not in RUN_OPTIONS}


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """Refuse, before any work, a ``monai.bundle run`` override that would be accepted and do something else:

    - a key that none of its config files defines (a typo such as ``--gamma`` for ``--sampling_gamma`` would be a
      new key that nothing reads), naming the closest keys;
    - a key given without a value (``--epochs`` alone: MONAI's command line makes it ``True``, which counts as 1)
      unless the config's value is a yes/no;
    - a value that is not a number where the config's value is one (``--max_templates two``), or not an integer
      where it is an integer (``2.7``); ``null`` / ``none`` pass (:func:`is_unset`), ranges are the configs' checks;
    - a word that is no option's value (:func:`stray_words`) nor a config item (``init_id``, ``final_id``): a shell
      wildcard or an unquoted space split a value.

    The first step of every command; a no-op outside ``python -m monai.bundle run``."""
    argv = sys.argv if argv is None else argv
    files, overrides = command_line_overrides(argv)
    stray = stray_words(argv[2:])
    if not files or not (stray or overrides):
        return
    parser = ConfigParser()
    parser.read_config(files)
    config = parser.get()
    known = _config_ids(config)
    stray = [word for word in stray if word not in known]  # an init_id or final_id names an item
    if stray:
        raise ValueError(
            f"command line: {stray} follow(s) no --key: each value must be one word. A shell wildcard (--images *.png) "
            "or a space in a value splits it; quote the pattern, --images 'scans/*.png', give a list as one quoted "
            "word, --images \"['a.png','b.png']\", or a folder: --dataset_dir FOLDER"
        )
    if not overrides:
        return
    unknown = [k for k in overrides if k not in known and not _argument_of_a_component(config, k)]
    if unknown:
        hints = "; ".join(
            f"--{k}: {', '.join(difflib.get_close_matches(k, sorted(known), n=3, cutoff=0.5)) or 'no key is close'}"
            for k in unknown
        )
        raise ValueError(f"unknown config key(s) {unknown} on the command line (closest: {hints}): see {files}")
    problems = [
        problem
        for key, text in overrides.items()
        if key in known and (problem := _override_problem(key, text, parser[key]))
    ]
    if problems:
        raise ValueError(f"command line: {'; '.join(problems)} (config files {files})")


def _override_problem(key: str, text: str | None, default: Any) -> str | None:
    """What is wrong with the command line's ``text`` for ``key`` given the config's own value, or None."""
    if isinstance(default, bool):
        return None  # yes/no words are read by as_flag
    if text is None:
        return f"--{key} needs a value (--{key} VALUE; the config's is {default!r})"
    if not isinstance(default, (int, float)):
        return None
    value = fire.parser.DefaultParseValue(text)
    if is_unset(value):
        return None
    if isinstance(default, int) and not (isinstance(value, int) and not isinstance(value, bool)):
        return f"--{key}: expected an integer as the config's {default!r}, got {text!r}"
    if not is_finite_number(value):
        return f"--{key}: expected a number as the config's {default!r}, got {text!r}"
    return None


def _argument_of_a_component(config: dict, ident: str) -> bool:
    """Whether ``ident`` (``a#b#arg``) adds an argument to a component (a dict with ``_target_``) of the config."""
    parent, _, _ = ident.rpartition("#")
    node: Any = config
    for part in parent.split("#") if parent else []:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return bool(parent) and isinstance(node, dict) and "_target_" in node


def _config_ids(config: Any, prefix: str = "") -> set[str]:
    """Every id of a parsed config: top-level keys and nested ``a#b`` ids (list items by index)."""
    ids: set[str] = set()
    items = config.items() if isinstance(config, dict) else enumerate(config) if isinstance(config, list) else ()
    for key, value in items:
        ident = f"{prefix}{key}"
        ids.add(ident)
        ids |= _config_ids(value, f"{ident}#")
    return ids


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
