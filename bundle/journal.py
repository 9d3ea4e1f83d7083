"""A run's predictions written as each image finishes (:class:`PredictionJournal`), so that a long run streams, an
interrupted one resumes, and the processes of a torchrun share their work through the output folder; and the
fingerprint of what predicts (:func:`fingerprint`), which says whether an earlier run's predictions may be reused."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import types
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from bundle import __version__
from bundle.distributed import rank, world_size
from bundle.io_utils import write_json_atomic
from bundle.reporting import unique_name
from bundle.settings import as_flag

logger = logging.getLogger(__name__)

_DESCRIBED_PACKAGES = ("bundle", "monai")


def _describe(obj: Any, depth: int = 0) -> Any:
    """A JSON-able description of ``obj`` that changes when what it computes may change: numbers and strings as they
    are, tensors and arrays by their SHA-256, a module by its state, a function by its name, an object of this
    bundle or of MONAI by its public attributes (a transform's settings), anything else by its type."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj)  # NaN and infinities too
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        array = np.ascontiguousarray(obj.detach().cpu().numpy() if isinstance(obj, torch.Tensor) else obj)
        return [str(array.dtype), list(array.shape), hashlib.sha256(array.tobytes()).hexdigest()]
    if depth > 8:
        return type(obj).__qualname__
    if isinstance(obj, torch.nn.Module):
        return [type(obj).__qualname__, _describe(obj.state_dict(), depth + 1)]
    if isinstance(obj, Mapping):
        return {str(k): _describe(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_describe(v, depth + 1) for v in obj]
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"
    cls = type(obj)
    if cls.__module__.split(".")[0] in _DESCRIBED_PACKAGES and hasattr(obj, "__dict__"):
        public = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        return [f"{cls.__module__}.{cls.__qualname__}", _describe(public, depth + 1)]
    return f"{cls.__module__}.{cls.__qualname__}"


def fingerprint(**parts: Any) -> str:
    """The SHA-256 (hex) of what predicts a run's landmarks: the bundle's version and ``parts`` (weights by their
    values, transforms and inferers by their settings: :func:`_describe`), equal in two runs that predict alike.

    Args:
        parts: what predicts, by name (the network, its preprocessing and inferer, the templates...).
    """
    text = json.dumps({"bundle_version": __version__, **{k: _describe(v) for k, v in parts.items()}}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _floats(array: np.ndarray) -> list:
    """``array`` as nested lists of floats (NaN kept: JSON's ``NaN``, which Python reads back)."""
    return np.asarray(array, dtype=np.float64).tolist()


def _file_state(image: str) -> list[int] | None:
    """The image file's (or DICOM series folder's) size and modification time: a rerun predicts again an image that
    changed since its line was written."""
    try:
        state = os.stat(image)
    except OSError:
        return None
    return [state.st_size, state.st_mtime_ns]


def _entry(line: bytes) -> dict | None:
    """A journal line read back, None when it is not whole (a process killed while writing it)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("image"), str) else None


class PredictionJournal:
    """Each image's predictions as it finishes, in ``output_dir/.journal``: a line per image (its landmarks,
    reference landmarks and spacing) in a file of its own per process and run, and its 2D overlay (under a name of
    its image's path, so that no other image of a later run draws over it).

    The report (:class:`bundle.handlers.report.LandmarkReportHandler`) appends to it as the images come and writes
    the run's files from it at the end, in the order of the run's images (:meth:`pending`), whichever process
    predicted them. With a ``fingerprint`` (inferring: that of what predicts, :func:`fingerprint`) a later run with
    the same fingerprint into the same ``output_dir`` predicts only the images the journal lacks (with ``overlays``,
    a 2D image predicted without its overlay counts as lacking); a run with another fingerprint, or none
    (evaluating), starts a new journal. The folder is this bundle's own (its ``journal.json``
    says so): a folder of that name without it, or a link, is refused, naming it. A run holds the journal from
    :meth:`start` to its end (an advisory lock on its folder), so that a second run into the same ``output_dir`` while
    the first writes is refused, naming the folder, and leaves the first run's journal as it is.

    Args:
        output_dir: the run's output folder.
        items: the run's images (datalist items: their ``image``), in the order of its reports; none: the images in
            the order they come.
        fingerprint: what predicts (:func:`fingerprint`); None: the journal is not reused by a later run.
        overlays: whether the run draws the 2D images' overlays (and its report links them in).
    """

    FOLDER = ".journal"
    MARKER = "journal.json"

    def __init__(
        self,
        output_dir: str | os.PathLike,
        items: Sequence[Mapping] = (),
        fingerprint: str | None = None,
        overlays: bool = True,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.folder = self.output_dir / self.FOLDER
        self.items = list(items)
        self.images = [str(it["image"]) for it in self.items]
        self.fingerprint = fingerprint
        self.overlays = as_flag(overlays, "overlays")
        self._names: dict[str, str] = {}  # image -> its overlay's file stem in the report, in the run's order
        self._taken: set[str] = set()
        for image in self.images:
            self._name(image)
        self._part = None
        self._made_output_dir = False  # whether this run made output_dir (for the journal)
        self._held = None  # the journal folder's file descriptor while this run holds it (process 0)

    def _check_folder(self) -> bool:
        """Whether the journal folder holds a journal of this bundle (False: there is none); FileExistsError naming
        it when it is a link, a file, or a folder this bundle did not write."""
        if self.folder.is_symlink():
            raise FileExistsError(
                f"{self.folder}: a symbolic link; the run's journal is never written through a link: remove it or "
                "choose another output_dir"
            )
        if not os.path.lexists(self.folder):
            return False
        if not self.folder.is_dir() or not (self.folder / self.MARKER).is_file():
            raise FileExistsError(
                f"{self.folder}: not a journal of this bundle (no {self.MARKER}); the run keeps its predictions there: "
                "remove it or choose another output_dir"
            )
        return True

    def _recorded_fingerprint(self) -> str | None:
        try:
            return json.loads((self.folder / self.MARKER).read_text(encoding="utf-8")).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            return None

    def _reusable(self) -> bool:
        return (
            self.fingerprint is not None and self._check_folder() and self._recorded_fingerprint() == self.fingerprint
        )

    def pending(self) -> list[Mapping]:
        """The run's items still to predict: all of them, or those the journal lacks when it has this run's
        fingerprint (the count skipped logged)."""
        index = self._index() if self._reusable() else {}
        todo = [it for it in self.items if not self._done(index, str(it["image"]))]
        if len(todo) < len(self.items):
            logger.info(
                "%d of %d images already predicted by the same weights and settings (%s): not predicted again",
                len(self.items) - len(todo),
                len(self.items),
                self.folder,
            )
        return todo

    def _done(self, index: dict[str, tuple[Path, int, Any, bool]], image: str) -> bool:
        if image not in index:
            return False
        _, _, state, drawn = index[image]
        return state == _file_state(image) and (drawn or not self.overlays)

    def _name(self, image: str) -> str:
        if image not in self._names:
            self._names[image] = unique_name(Path(image).stem, self._taken)
        return self._names[image]

    def overlay_name(self, image: str) -> str:
        """The image's overlay's file name in the report's ``overlays/`` (its stem, made unique among the run's
        images in their order)."""
        return f"{self._name(image)}.png"

    def overlay_path(self, image: str) -> Path:
        """Where the image's overlay is drawn in the journal: ``overlays/<a hash of its path>.png``."""
        return self.folder / "overlays" / f"{hashlib.sha256(image.encode('utf-8')).hexdigest()[:24]}.png"

    def start(self) -> None:
        """Open this process's part of the journal (every process, as the run starts): process 0 first starts a new
        journal unless this one is reused (:meth:`pending`), then every process opens a file of its own."""
        _barrier()  # every process has read the journal (pending) before process 0 changes it
        if rank() == 0:
            self._made_output_dir = self._made_output_dir or not self.output_dir.exists()
            reusable = self._reusable()
            self._hold()
            if not reusable:
                self._empty()
            write_json_atomic(
                self.folder / self.MARKER, {"fingerprint": self.fingerprint, "bundle_version": __version__}
            )
        _barrier()
        self.close()
        name = f"part-{time.time_ns():020d}-{rank()}-{uuid.uuid4().hex}.jsonl"  # in the order the runs came
        self._part = open(self.folder / name, "a", encoding="utf-8")

    def _hold(self) -> None:
        """Hold the journal folder for this run (made when missing; a link or a folder this bundle did not write is
        refused first, :meth:`_check_folder`); RuntimeError naming ``output_dir`` when another run holds it."""
        if self._held is not None:
            return
        self._check_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"{self.output_dir}: another run is writing its predictions there; let it finish or choose another "
                "output_dir"
            ) from None
        self._held = fd

    def _release(self) -> None:
        if self._held is not None:
            os.close(self._held)  # the lock goes with its descriptor
            self._held = None

    def _empty(self) -> None:
        """Remove an earlier journal's files from the folder this run holds (the folder stays: it holds the lock)."""
        for child in self.folder.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def _clear(self) -> None:
        """Remove an earlier journal (this bundle's: :meth:`_check_folder`)."""
        if self._check_folder():
            shutil.rmtree(self.folder)

    def append(
        self, image: str, pred: np.ndarray, ref: np.ndarray, spacing: np.ndarray, overlay: Path | None = None
    ) -> None:
        """Record one image's predictions (``pred``, ``ref``: (L, D) mm; ``spacing``: (D,)) and its ``overlay`` drawn
        (:meth:`overlay_path`; None: not drawn), flushed at once."""
        if self._part is None:
            raise RuntimeError(f"journal {self.folder}: append before start")
        line = {
            "image": image,
            "file": _file_state(image),
            "pred": _floats(pred),
            "ref": _floats(ref),
            "spacing": _floats(spacing),
            "overlay": None if overlay is None else overlay.name,
        }
        self._part.write(json.dumps(line) + "\n")
        self._part.flush()

    def close(self) -> None:
        """Close this process's part (every process, when its images are done)."""
        if self._part is not None:
            self._part.close()
            self._part = None

    def _index(self) -> dict[str, tuple[Path, int, Any, bool]]:
        """Where each image's latest line is in the journal's parts (file, offset), its file's state then and whether
        the line has all it may need (the overlay of a 2D image); a line cut short by a kill left out (its image
        predicted again). Lines are read back one at a time
        (:meth:`records`), so that the memory does not grow with the images' predictions."""
        index: dict[str, tuple[Path, int, Any, bool]] = {}
        for part in sorted(self.folder.glob("part-*.jsonl")):
            with open(part, "rb") as f:
                offset = 0
                for line in f:
                    entry = _entry(line)
                    if entry is not None:
                        drawn = len(entry.get("spacing") or ()) != 2 or self._drawn(entry.get("overlay"))
                        index[entry["image"]] = (part, offset, entry.get("file"), drawn)
                    offset += len(line)
        return index

    def _drawn(self, overlay: Any) -> bool:
        """Whether a line's overlay (its file name in the journal) is there."""
        return isinstance(overlay, str) and (self.folder / "overlays" / overlay).is_file()

    def records(self) -> Iterator[dict]:
        """The run's images' predictions, in the order of its items (else as they came): ``image``, ``pred``,
        ``ref``, ``spacing`` (arrays) and ``overlay`` (its journal file; None when not drawn or the run draws no
        overlays); RuntimeError naming an image without predictions."""
        index = self._index()
        images = self.images or list(index)
        missing = [image for image in images if image not in index]
        if missing:
            raise RuntimeError(f"journal {self.folder}: no predictions for {len(missing)} image(s), {missing[:3]}")
        files: dict[Path, Any] = {}
        try:
            for image in images:
                part, offset, _, _ = index[image]
                if part not in files:
                    files[part] = open(part, "rb")
                files[part].seek(offset)
                entry = _entry(files[part].readline())
                drawn = self.overlays and self._drawn(entry.get("overlay"))
                overlay = self.folder / "overlays" / entry["overlay"] if drawn else None
                yield {
                    "image": image,
                    "pred": np.asarray(entry["pred"], dtype=np.float64),
                    "ref": np.asarray(entry["ref"], dtype=np.float64),
                    "spacing": np.asarray(entry["spacing"], dtype=np.float64),
                    "overlay": overlay,
                }
        finally:
            for f in files.values():
                f.close()

    def discard(self) -> None:
        """Remove the journal when no later run reuses it (no fingerprint), its report written."""
        self.close()
        if self.fingerprint is None:
            self._clear()
        self._release()

    def abandon(self) -> None:
        """After a failed run: keep the predictions that a later run reuses; else remove the journal, and
        ``output_dir`` when the journal made it and it is left empty. A run that never held ``output_dir`` (process 0
        of a run refused by :meth:`start`, the other processes) leaves both as they are."""
        self.close()
        if self._held is None:  # not this run's journal: another run's, or none yet
            return
        if self.fingerprint is None or not (os.path.lexists(self.folder) and self._index()):
            self._clear()
            if self._made_output_dir and self.output_dir.is_dir() and not any(self.output_dir.iterdir()):
                self.output_dir.rmdir()
        self._release()


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` made a hard link to ``source`` (no copy of its bytes), else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


__all__ = ["PredictionJournal", "fingerprint", "link_or_copy"]
