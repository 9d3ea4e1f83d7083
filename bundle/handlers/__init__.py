"""Ignite handlers of the configs: checkpoints and resuming, the evaluation report, the detector's confidence,
the console's progress, TensorBoard, templates, the training's time budget."""

from bundle import lazy_submodules
from bundle.handlers.checkpoints import (
    AtomicCheckpointSaver,
    AtomicSaveHandler,
    CheckpointDirReport,
    LastCheckpointSaver,
    ResumeCheckpointLoader,
    resume_handlers,
)
from bundle.handlers.confidence import ConfidenceHandler
from bundle.handlers.progress import EngineProgress
from bundle.handlers.report import LandmarkReportHandler
from bundle.handlers.templates import TemplateHandler
from bundle.handlers.tensorboard import DeferredSummaryWriter
from bundle.handlers.time_budget import TrainingTimeBudget

__all__ = [
    "AtomicCheckpointSaver",
    "AtomicSaveHandler",
    "CheckpointDirReport",
    "DeferredSummaryWriter",
    "EngineProgress",
    "ConfidenceHandler",
    "LandmarkReportHandler",
    "LastCheckpointSaver",
    "ResumeCheckpointLoader",
    "TemplateHandler",
    "TrainingTimeBudget",
    "resume_handlers",
]

__getattr__ = lazy_submodules(__name__)
