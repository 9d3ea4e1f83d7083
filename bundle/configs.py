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
import torch
from bundle.data.datalist import is_finite_number
from bundle.distributed import launched, rank_device
from bundle.settings import as_flag, check_cpu_threads, check_settings, is_unset
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
    ``a#b`` keys applied), with ``bundle_root`` set and each of ``overrides`` (ids may contain ``#``) set, its values
    checked (:func:`bundle.settings.check_settings`)."""
    files = [config_files] if isinstance(config_files, str) else list(config_files)
    parser = ConfigParser()
    parser.read_config([str(Path(bundle_root) / f) for f in files])
    parser["bundle_root"] = str(bundle_root)
    for key, value in overrides.items():
        parser[key] = value
    check_settings(parser)
    return parser


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


# the command lines check_command_line has passed in this process: the configs' initialize step and the command's first
# step both ask (bundle.commands), the files are read once
_PASSED_COMMAND_LINES: set[tuple[str, ...]] = set()


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """Refuse, before any work, a ``monai.bundle run`` override that would be accepted and do something else:

    - a key that none of its config files defines (a typo such as ``--gamma`` for ``--sampling_gamma`` would be a
      new key that nothing reads), naming the closest keys;
    - a key given without a value (``--epochs`` alone: MONAI's command line makes it ``True``, which counts as 1)
      unless the config's value is a yes/no;
    - a value that is not a number where the config's value is one (``--max_templates two``), or not an integer
      where it is an integer (``2.7``); ``null`` / ``none`` pass (:func:`is_unset`), ranges are bundle.settings' checks;
    - a word that is no option's value (:func:`stray_words`) nor a config item (``init_id``, ``final_id``): a shell
      wildcard or an unquoted space split a value.

    The first step of every command; a no-op outside ``python -m monai.bundle run``, and for a command line it has
    passed already in this process."""
    argv = tuple(sys.argv if argv is None else argv)
    if argv in _PASSED_COMMAND_LINES:
        return
    _check_command_line(argv)
    _PASSED_COMMAND_LINES.add(argv)


def _check_command_line(argv: tuple[str, ...]) -> None:
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
