"""Checkpoint files: reading them safely (errors that name the file), loading weights, writing atomically.

Every checkpoint is read with ``torch.load(weights_only=True)`` and written, with CPU tensors, through a
hidden temporary that is renamed into place (:func:`save_atomically`), with the JSON record of the training
that made it where there is one (:func:`save_with_record`); :func:`resume_path` is the file ``--resume`` continues
from; :func:`check_training_outputs` refuses, before a training writes, a symbolic link it would write through.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from bundle.data.datalist import read_json
from bundle.io_utils import atomic_path, write_json_atomic
from bundle.settings import as_flag

# the key of a checkpoint record (:func:`save_with_record`) that names the checkpoint files it describes
RECORD_KEY = "checkpoints"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and what is wrong with it."""


class UndescribedCheckpointError(CheckpointError):
    """A checkpoint that the record beside it (:func:`save_with_record`) does not describe: a later training in its
    folder wrote the record, and the file holds an earlier training's weights."""


def read_checkpoint(path: str | Path, device: torch.device | str = "cpu", what: str = "checkpoint") -> dict:
    """The dict a checkpoint file holds, read with ``torch.load(weights_only=True)``.

    A missing file raises ``FileNotFoundError``; an empty (0-byte), truncated or foreign file, or one that
    holds something else than a dict, raises :class:`CheckpointError`; both name the file.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a folder: give the checkpoint file in it (a model.pt)")
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} not found: {path} (train first, or check the path: --ckpt_path, --init_weights)"
        )
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{what} {path} is empty (0 bytes): a write that was interrupted, or not a checkpoint")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # EOFError, zip-archive RuntimeError, UnpicklingError, ...
        raise CheckpointError(
            f"{what} {path} ({size} bytes) is not a readable PyTorch checkpoint (truncated, or not written by "
            f"torch.save): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{what} {path} holds a {type(state).__name__}, not a dict (a state dict, or a dict with one under 'model')"
        )
    return dict(state)


def read_state_dict(path: str | Path, device: torch.device | str = "cpu", what: str = "checkpoint") -> dict:
    """The state dict (names -> tensors) of a checkpoint file: the file's dict, or the dict under its ``model``.

    A missing, empty, truncated or foreign file (:func:`read_checkpoint`), one that holds no state dict, or one
    with NaN or infinite weights raises an error that names the file.
    """
    state = read_checkpoint(path, device, what)
    if isinstance(state.get("model"), Mapping):
        state = dict(state["model"])
    foreign = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if foreign:
        raise CheckpointError(
            f"{what} {path} is not a state dict (names -> tensors): entries {[repr(k) for k in foreign[:5]]} "
            f"of its {len(state)} are not named tensors"
        )
    broken = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if broken:
        raise CheckpointError(
            f"{what} {path} holds non-finite weights (NaN or inf) in {broken[:3]}"
            f"{f' and {len(broken) - 3} more' if len(broken) > 3 else ''}: a training that diverged "
            "(train again with a lower learning_rate)"
        )
    return state


def load_weights(network: torch.nn.Module, path: str | Path, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Load a checkpoint (a state dict, or a dict holding one under ``model``) into ``network`` and return it.

    Checkpoints load with ``torch.load(weights_only=True)`` (:func:`read_state_dict`); a missing, empty,
    truncated or foreign file, a file that is no state dict, and mismatched keys raise errors that name the file.

    Args:
        network: the network the weights are for.
        path: the checkpoint file.
        device: where the weights are read to and the network is moved.

    Returns:
        ``network``, loaded, on ``device``.
    """
    path = Path(path)
    state = read_state_dict(path, device)
    try:
        network.load_state_dict(state)
    except RuntimeError as e:
        raise RuntimeError(f"checkpoint {path} does not fit the configured network: {e}") from e
    return network.to(device)


def initial_weights(network: torch.nn.Module, path: str | Path | None, device: torch.device | str) -> torch.nn.Module:
    """``network`` on ``device``, with the weights of ``path`` when given (``init_weights``: a fine-tuning's start),
    else as initialised.

    Args:
        network: the network.
        path: a checkpoint (:func:`load_weights`), None or empty: none.
        device: where the network goes.
    """
    return load_weights(network, path, device) if path else network.to(device)


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor inside its dicts, lists and tuples moved to the CPU (other values kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, Mapping):
        return type(obj)((k, to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_atomically(checkpoint: Mapping, path: str | Path, save=torch.save) -> None:
    """``save(to_cpu(checkpoint), tmp)`` to a unique hidden temporary beside ``path``
    (``.<name>.<pid>.<random>.tmp``, never ``*.pt``), then ``os.replace`` onto ``path``
    (:func:`bundle.io_utils.atomic_path`): a killed write leaves the previous checkpoint whole, and its leftover
    temporary is removed by the next save. Tensors are saved on the CPU, so that a checkpoint written on a GPU
    loads (``torch.load``, MONAI's ``ckpt_export``) on a machine without one."""
    try:
        with atomic_path(path, keep_suffix=False) as tmp:
            save(to_cpu(checkpoint), tmp)
    except (OSError, RuntimeError) as e:  # a full disk reaches torch.save as "unexpected pos ..."
        free = shutil.disk_usage(Path(path).parent).free if Path(path).parent.is_dir() else None
        space = f"; {free / 2**20:.0f} MiB free there" if free is not None else ""
        raise CheckpointError(
            f"cannot write checkpoint {path} (the previous one, if any, is kept){space}: {type(e).__name__}: {e}"
        ) from e


def read_record(record_path: str | Path, what: str = "checkpoint record") -> dict:
    """The JSON record at ``record_path`` (:func:`save_with_record`); an unreadable one raises
    :class:`bundle.data.datalist.DatalistError` (:func:`bundle.data.datalist.read_json`), one that is not a JSON object
    :class:`CheckpointError`, both naming it as ``what``."""
    record = read_json(record_path, what)
    if not isinstance(record, dict):
        raise CheckpointError(f"{record_path}: a {what} must be a JSON object, got {type(record).__name__}")
    return record


def describes(record: Mapping, path: str | Path) -> bool:
    """Whether ``record`` (:func:`save_with_record`) describes the checkpoint file ``path`` of its folder: ``path`` is
    among its ``checkpoints``, or the record has no such key (one written whole for its folder's files)."""
    named = record.get(RECORD_KEY)
    return named is None or Path(path).name in named


def save_with_record(checkpoint: Mapping, path: str | Path, record_path: str | Path, record: Mapping) -> None:
    """:func:`save_atomically` of ``checkpoint`` to ``path`` with ``record`` (what the training that made it is, a
    JSON object) at ``record_path`` beside it, naming under ``checkpoints`` the files of this training it describes.

    A record of another training there first stops naming ``path``, then the weights are written, then this record is
    written naming ``path`` and the files this training wrote before: wherever the writing stops, no file is named by
    a record of a training other than the one that wrote it (a new training in a folder never lends its record to the
    previous training's files). Each write is atomic."""
    path, record_path = Path(path), Path(record_path)
    record = json.loads(json.dumps(dict(record)))  # as it reads back: lists for tuples
    previous = read_record(record_path) if record_path.is_file() else None
    described = []
    if previous is not None:
        named = previous.get(RECORD_KEY)
        if named is None:  # a record of every file there
            named = sorted(p.name for p in record_path.parent.glob("*.pt"))
        if {k: v for k, v in previous.items() if k != RECORD_KEY} == record:
            described = named
        elif path.name in named:
            write_json_atomic(record_path, {**previous, RECORD_KEY: [n for n in named if n != path.name]})
    save_atomically(checkpoint, path)
    write_json_atomic(record_path, {**record, RECORD_KEY: sorted({*described, path.name})})


def resume_path(ckpt_dir: str | Path, resume: bool | str, filename: str = "last.pt") -> str | None:
    """The checkpoint to resume from: ``resume`` itself when it is a path, ``ckpt_dir/filename`` when it is true.

    ``resume: true`` with no such file starts afresh (nothing to resume, e.g. the first run); a path that
    does not exist is an error.

    Args:
        ckpt_dir: the training's checkpoint folder.
        resume: a checkpoint path, or a yes/no value (``true``: ``ckpt_dir/filename``).
        filename: the last checkpoint's file name.

    Returns:
        the checkpoint path, None: start afresh.

    Raises:
        FileNotFoundError: ``resume`` is a path that does not exist.
    """
    resume = as_flag(resume, "resume", path=True)
    if isinstance(resume, str):
        if not Path(resume).is_file():
            raise FileNotFoundError(f"resume checkpoint not found: {resume}")
        return resume
    if resume:
        path = Path(ckpt_dir) / filename
        return str(path) if path.is_file() else None
    return None


def check_training_outputs(output_dir: str | os.PathLike, folders: list[str | os.PathLike]) -> None:
    """Refuse, before a training writes anything, a symbolic link that its files would go through (into the linked
    folder) or replace: a folder below ``output_dir`` (itself not: the user's choice) on the way to one of ``folders``
    (the checkpoint folder first, then the others it writes to), or a checkpoint (``*.pt``) or record (``*.json``) in
    the first.

    Args:
        output_dir: the training's output folder.
        folders: the folders it writes to, its checkpoint folder first.

    Raises:
        FileExistsError: naming the link.
    """
    root = Path(os.path.abspath(Path(output_dir).expanduser()))
    for folder in (Path(os.path.abspath(Path(f).expanduser())) for f in folders):
        parts = folder.relative_to(root).parts if folder.is_relative_to(root) else ()
        for step in (root.joinpath(*parts[: i + 1]) for i in range(len(parts))):
            if step.is_symlink():
                raise FileExistsError(
                    f"{step}: a symbolic link in output_dir {root}, on the way to {folder}; a training never writes "
                    "through a link: remove it or choose another output_dir"
                )
    ckpt_dir = Path(folders[0]).expanduser()
    for entry in sorted([*ckpt_dir.glob("*.pt"), *ckpt_dir.glob("*.json")]):
        if entry.is_symlink():
            raise FileExistsError(
                f"{entry}: a symbolic link where the training writes its checkpoints; it is never replaced: remove "
                "it or choose another ckpt_dir"
            )
