"""Checkpoint handlers: :class:`AtomicCheckpointSaver` writes the best and the final model files, each through
:func:`bundle.checkpoints.save_atomically` (with the training's record: :func:`bundle.checkpoints.save_with_record`);
:class:`LastCheckpointSaver` writes ``last.pt``, which :class:`ResumeCheckpointLoader` restores (refusing changed
settings); :class:`CheckpointDirReport` prints where they are.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

import ignite.distributed as idist
import torch
from bundle.checkpoints import CheckpointError, read_checkpoint, save_atomically, save_with_record
from ignite.engine import Engine, Events
from ignite.handlers.checkpoint import BaseSaveHandler, Checkpoint
from monai.handlers import CheckpointLoader
from monai.utils import is_scalar

logger = logging.getLogger(__name__)


class AtomicSaveHandler(BaseSaveHandler):
    """Ignite save handler writing every checkpoint to the one file ``dirname/filename`` with
    :func:`bundle.checkpoints.save_atomically` (rank 0): each save replaces the previous file atomically, so
    there is nothing to remove. With a ``record`` (``{"file": name, "content": JSON object}``, what the training is)
    the file ``dirname/name`` is written with each checkpoint and names it
    (:func:`bundle.checkpoints.save_with_record`)."""

    def __init__(self, dirname: str | os.PathLike, filename: str, record: Mapping | None = None) -> None:
        self.path = Path(dirname).expanduser() / filename
        self.record = record
        # read while every process builds its handlers: ignite's first call synchronises the processes
        self.rank = idist.get_rank()

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        if self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.record:
            save_with_record(checkpoint, self.path, self.path.parent / self.record["file"], self.record["content"])
        else:
            save_atomically(checkpoint, self.path)

    def remove(self, filename: str) -> None:
        """Nothing to do: the next save replaces the file."""


class AtomicCheckpointSaver:
    """The configs' model saver (in place of MONAI's ``CheckpointSaver``, whose writes are not atomic).

    Both savings are Ignite ``Checkpoint`` objects (a single object is saved as its own ``state_dict``) writing
    through :class:`AtomicSaveHandler`. ``state_dict``/``load_state_dict`` carry the key-metric ranking, so that a
    resumed run keeps the best file of the run before it.

    Args:
        save_dir: the folder of the files.
        save_dict: the objects to save, by name (e.g. ``{"model": network}``).
        save_final: save the state of ``save_dict`` when the engine completes or fails, to ``final_filename``.
        final_filename: the file name of the final state.
        save_key_metric: save after each evaluation whose key metric (``engine.state.key_metric_name``) is the best
            so far, to ``key_metric_filename``.
        key_metric_filename: the file name of the best state.
        key_metric_negative_sign: the lowest key metric is best (an error such as the MRE).
        record: the training's record (``{"file": name, "content": JSON object}``), written beside each file.
        best_saver: the key-metric saver of the same run; when it has saved nothing by the time the engine completes
            (no validation ran: nothing to choose by), the final state is written under its file name too, with a
            log line saying so.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        save_dict: dict,
        save_final: bool = False,
        final_filename: str = "model_final.pt",
        save_key_metric: bool = False,
        key_metric_filename: str = "model.pt",
        key_metric_negative_sign: bool = False,
        record: Mapping | None = None,
        best_saver: AtomicCheckpointSaver | None = None,
    ) -> None:
        if not save_dict:
            raise ValueError("AtomicCheckpointSaver: save_dict is empty, there is nothing to save")
        self.sign = -1.0 if key_metric_negative_sign else 1.0
        self.logger = logging.getLogger(__name__)
        self.final_checkpoint = self.key_metric_checkpoint = None
        self.best_saver = best_saver
        if save_final:
            self.final_checkpoint = Checkpoint(
                save_dict,
                AtomicSaveHandler(save_dir, final_filename, record),
                score_function=lambda engine: engine.state.iteration,
                score_name="final_iteration",
            )
        if save_key_metric:
            self.key_metric_checkpoint = Checkpoint(
                save_dict,
                AtomicSaveHandler(save_dir, key_metric_filename, record),
                score_function=self.score,
                score_name="key_metric",
            )

    def score(self, engine: Engine) -> float:
        """The evaluation's key metric, signed so that higher ranks better."""
        name = engine.state.key_metric_name
        value = engine.state.metrics[name]
        if not is_scalar(value):
            raise ValueError(f"the key metric {name} must be a scalar to rank checkpoints, got {value!r}")
        return self.sign * float(value)

    def state_dict(self) -> dict:
        return {} if self.key_metric_checkpoint is None else self.key_metric_checkpoint.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self.key_metric_checkpoint is not None and state_dict:
            self.key_metric_checkpoint.load_state_dict(state_dict)

    def attach(self, engine: Engine) -> None:
        if self.final_checkpoint is not None:
            engine.add_event_handler(Events.COMPLETED, self.save_final)
            engine.add_event_handler(Events.EXCEPTION_RAISED, self.save_final_and_raise)
            if self.best_saver is not None:
                engine.add_event_handler(Events.COMPLETED, self.save_final_as_best)
        if self.key_metric_checkpoint is not None:
            engine.add_event_handler(Events.EPOCH_COMPLETED, self.key_metric_checkpoint)

    def save_final(self, engine: Engine) -> None:
        """Write the final state (over an earlier final file of this run: one fixed name)."""
        self.final_checkpoint.reset()
        self.final_checkpoint(engine)
        self.logger.info("final checkpoint saved: %s", self.final_checkpoint.save_handler.path)

    def save_final_as_best(self, engine: Engine) -> None:
        """When ``best_saver`` has saved nothing (no validation ran), write the final state under its file name."""
        best = self.best_saver.key_metric_checkpoint
        if best is None or best.last_checkpoint is not None:
            return
        Checkpoint(self.final_checkpoint.to_save, best.save_handler)(engine)
        self.logger.warning(
            "no validation ran (no validation items, or val_interval above the epochs run): nothing to choose the "
            "best checkpoint by; the final weights are written as %s too",
            best.save_handler.path,
        )

    def save_final_and_raise(self, engine: Engine, error: Exception) -> None:
        """On an exception: keep the state reached, then raise the exception again."""
        self.save_final(engine)
        raise error


class LastCheckpointSaver:
    """Every ``interval`` epochs, the state of every object of ``save_dict`` in one file, written atomically.

    A wrapped (DDP) network is saved unwrapped. Only rank 0 writes. The file loads with
    ``torch.load(weights_only=True)`` and resumes training through MONAI's ``CheckpointLoader``.

    Args:
        path: the file (``last.pt``).
        save_dict: names to objects with ``state_dict()`` (network, optimizer, LR scheduler, savers).
        interval: epochs between savings.
        engine_key: the name under which the engine it is attached to is added (the config cannot name the trainer
            in a handler of that trainer); None: not saved.
    """

    def __init__(
        self, path: str | Path, save_dict: dict[str, Any], interval: int = 1, engine_key: str | None = "trainer"
    ) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        missing = [k for k, v in save_dict.items() if not hasattr(v, "state_dict")]
        if missing:
            raise TypeError(f"save_dict entries {missing} have no state_dict()")
        self.path = Path(path)
        self.save_dict = dict(save_dict)
        self.interval = interval
        self.engine_key = engine_key

    def attach(self, engine: Engine) -> None:
        """Save every ``interval`` epochs; the engine itself is saved under ``engine_key`` (unless None)."""
        if self.engine_key is not None:
            self.save_dict[self.engine_key] = engine
        engine.add_event_handler(Events.EPOCH_COMPLETED(every=self.interval), self)

    def __call__(self, engine: Engine) -> None:
        if idist.get_rank() != 0:
            return
        state = {}
        for name, obj in self.save_dict.items():
            if isinstance(obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
                obj = obj.module
            state[name] = obj.state_dict()
        save_atomically(state, self.path)


class CheckpointDirReport:
    """Prints where the training writes its checkpoints when it starts, and the files there when it completes
    (attached last, after the savers; rank 0, whose handlers save).

    Args:
        ckpt_dir: the checkpoints' folder.
    """

    def __init__(self, ckpt_dir: str | Path) -> None:
        self.ckpt_dir = Path(ckpt_dir).expanduser().resolve()

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self.started)
        engine.add_event_handler(Events.COMPLETED, self.completed)

    def started(self, engine: Engine) -> None:
        print(f"training writes its checkpoints to {self.ckpt_dir}", flush=True)

    def completed(self, engine: Engine) -> None:
        files = ", ".join(sorted(p.name for p in self.ckpt_dir.glob("*.pt")))
        print(f"training finished: checkpoints in {self.ckpt_dir}: {files}", flush=True)


class ResumeCheckpointLoader(CheckpointLoader):
    """MONAI's ``CheckpointLoader`` that also restores the engine it is attached to (under ``engine_key``).

    The trainer's epoch and iteration come back with the network, optimizer and scheduler, so a resumed
    run goes on from the epoch after the last one saved.
    """

    def __init__(self, load_path: str, load_dict: dict[str, Any], engine_key: str = "trainer", **kwargs: Any) -> None:
        super().__init__(load_path=load_path, load_dict=dict(load_dict), **kwargs)
        self.engine_key = engine_key

    def attach(self, engine: Engine) -> None:
        self.load_dict[self.engine_key] = engine
        super().attach(engine)

    def __call__(self, engine: Engine) -> None:
        checkpoint = read_checkpoint(self.load_path, self.map_location or "cpu", "resume checkpoint")
        missing = [k for k in self.load_dict if k not in checkpoint]
        if missing:
            held = sorted(map(str, checkpoint))
            shown = f"{held[:5]} and {len(held) - 5} more" if len(held) > 5 else str(held)
            raise CheckpointError(
                f"resume checkpoint {self.load_path} lacks {missing} (it holds {shown}): "
                "resume from the last.pt that training writes, not from a weights file such as model.pt"
            )
        changed = _changed_settings(checkpoint, self.load_dict, engine)
        if changed:
            raise ValueError(
                f"cannot resume from {self.load_path} with other settings: "
                + "; ".join(f"{key} is {new!r}, the resumed run's {old!r}" for key, new, old in changed)
                + ". A resumed run keeps its settings: resume with the same values, or start a new run in another "
                "ckpt_dir"
            )
        super().__call__(engine)


_SETTING_NAMES = {"initial_lr": "learning_rate", "T_max": "epochs"}


_SCHEDULE_STATE = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "base_lrs", "_is_initial"}


def _changed_settings(checkpoint: Mapping, load_dict: Mapping[str, Any], engine: Engine) -> list[tuple[str, Any, Any]]:
    """(key, configured, resumed) for each setting of the run being resumed that the config now gives otherwise."""
    pairs = []  # (what, configured state, resumed state, state entries that are progress, not settings)
    optimizer, scheduler = load_dict.get("optimizer"), load_dict.get("lr_scheduler")
    if optimizer is not None and "optimizer" in checkpoint:
        groups = zip(optimizer.state_dict()["param_groups"], checkpoint["optimizer"].get("param_groups", []))
        pairs += [("optimizer", new, old, {"params", "lr"}) for new, old in groups]
    if scheduler is not None and "lr_scheduler" in checkpoint:
        pairs.append(("lr_scheduler", scheduler.state_dict(), checkpoint["lr_scheduler"], _SCHEDULE_STATE))
    changed = []
    for what, new, old, progress in pairs:
        for key in sorted(set(new) & set(old) - progress):
            entry = (_SETTING_NAMES.get(key, f"{what} {key}"), new[key], old[key])
            if new[key] != old[key] and entry not in changed:  # one entry for the same change in several groups
                changed.append(entry)
    saved_length = checkpoint.get("trainer", {}).get("epoch_length")
    if saved_length is not None and engine.state.epoch_length not in (None, saved_length):
        changed.append(("epoch_length", engine.state.epoch_length, saved_length))
    return changed


def resume_handlers(resume: str | None, load_dict: dict[str, Any], device: torch.device | str = "cpu") -> list:
    """``[ResumeCheckpointLoader]`` for the checkpoint ``resume``, or ``[]`` when None.

    Args:
        resume: the checkpoint to resume from (:func:`bundle.checkpoints.resume_path`), or None.
        load_dict: the objects it restores, by name (what :class:`LastCheckpointSaver` saved).
        device: where its tensors are read to.
    """
    if resume is None:
        return []
    return [ResumeCheckpointLoader(load_path=resume, load_dict=load_dict, map_location=device)]
