"""Atomic file writing: outputs and checkpoints are written to a temporary name, then renamed.

Temporary files are hidden siblings of their target, ``.<name>.<pid>.<random>.tmp[<suffixes>]``: unique per
write (two writers never share one), never taken for the target itself (a loader opens the target's own
name only), and a leftover of a killed process (SIGKILL leaves no chance to clean up) is removed by the next
write of the same target once that process is gone. Folders of outputs are built the same way
(:class:`StagedOutputs`): in a hidden sibling folder, moved into place only when complete.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """The bundle's cache folder: ``$XDG_CACHE_HOME`` (else ``~/.cache``; a relative one is ignored, as the XDG
    specification asks) ``/infoguided-landmarks``."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):
        root = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "infoguided-landmarks"


def not_private(path: str | os.PathLike) -> str | None:
    """Why ``path`` may not be trusted (a symbolic link, another user's, writable by its group or others: the rule
    of ssh and pip); None when it is the current user's alone or is not there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        return (
            f"{path} has owner uid {info.st_uid} and mode {stat.S_IMODE(info.st_mode):#o} (it must be yours, uid "
            f"{os.getuid()}, and writable by no one else)"
        )
    return None


def _unsafe_above(folder: Path) -> str | None:
    """Why ``folder``, above a cache, may not be trusted: its owner (and root) can rename what it holds, and so can
    whoever may write to it unless it has the sticky bit (as ``/tmp``): swap the cache between its check and its
    use. Group-writable is refused too, as ssh's StrictModes does: a user private group cannot be told from a
    shared one here, and being strict costs little (a temporary kernel build, no template cache)."""
    info = os.stat(folder)
    if info.st_uid in (0, os.getuid()) and not (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
        return None
    return (
        f"{folder}, above the cache, has owner uid {info.st_uid} and mode {stat.S_IMODE(info.st_mode):#o} (it must "
        f"be yours, uid {os.getuid()}, or root's, and writable by no one else unless sticky, as /tmp)"
    )


def private_folder(root: str | os.PathLike, *parts: str) -> Path:
    """``root/<parts>``, each level from ``root`` down made (mode 0700) where missing and checked with
    :func:`not_private`, every folder above ``root`` up to ``/`` (those it is reached through and, past a link,
    its target's) made where missing (mode 0700, as the XDG specification asks) and checked by the rule of ssh and
    pip: the user's or root's, writable by no one else unless sticky.

    Raises:
        PermissionError: a level is a link, another user's or writable by others (the reason names it).
    """
    folder = Path(root)
    above = Path(os.path.abspath(folder)).parents
    for parent in reversed(above):
        with contextlib.suppress(FileExistsError):
            parent.mkdir(mode=0o700)
        if reason := _unsafe_above(parent):
            raise PermissionError(reason)
    real = Path(os.path.realpath(folder.parent))
    for parent in [p for p in reversed((real, *real.parents)) if p not in above]:
        if reason := _unsafe_above(parent):
            raise PermissionError(reason)
    for part in ("", *parts):
        folder = folder / part if part else folder
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        reason = not_private(folder)
        if reason:
            raise PermissionError(reason)
    return folder


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def error_summary(error: BaseException) -> str:
    """``<type>: <first line of its message>``: a reader's error in one line (MONAI's ``LoadImage`` appends every
    reader's traceback to its message, ``torch.load`` paragraphs of advice)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _process_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` runs on this machine (a temporary file of a live writer is kept)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError included: the process exists, owned by another user
        return True
    return True


def _temp_prefix(name: str) -> str:
    return f".{name}.{os.getpid()}."


def _stale_temporaries(folder: Path, name: str, marker: str) -> list[Path]:
    """Leftover temporaries ``.<name>.<pid>.<random><marker>...`` in ``folder`` whose process ``pid`` is gone."""
    pattern = re.compile(r"^\." + re.escape(name) + r"\.(\d+)\.[^/]*" + re.escape(marker))
    stale = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = pattern.match(entry.name)
        if match and not _process_alive(int(match.group(1))):
            stale.append(entry)
    return stale


def remove_stale_temporaries(path: str | os.PathLike, marker: str = ".tmp") -> list[Path]:
    """Remove the temporaries that killed writers of ``path`` left beside it; return what was removed."""
    path = Path(path)
    removed = []
    for entry in _stale_temporaries(path.parent, path.name, marker):
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry)
        except OSError:
            pass  # another process cleans it up, or it is not ours to remove
    return removed


def check_output_file(path: str | os.PathLike) -> Path:
    """``path`` (with ``~`` expanded), refused when it is a folder or when one of its parents is a file.

    Writers call it before their work, so that a wrong output name is refused before minutes of computing.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"{path}: a folder; give the name of the file to write")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{path}: {parent} is a file, not a folder")
            break
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, keep_suffix: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``, on error removed.

    Use it for writers that need a file name (``torch.save``, ``PIL.Image.save``, ``nib.save``): a
    crash leaves either the old file or the new one, never a half-written one. The temporary name keeps
    ``path``'s suffixes (writers that choose the format by suffix, such as ``nib.save``, need them) unless
    ``keep_suffix`` is false (checkpoints: a ``*.pt`` pattern must never match a half-written file).
    """
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    suffix = ".tmp" + ("".join(path.suffixes) if keep_suffix else "")
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_current_umask())  # mkstemp makes 0600; give the usual permissions
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically and return the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically and return the path."""
    return write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


_ACTIVE_STAGING: set[Path] = set()


@atexit.register
def _remove_active_staging() -> None:
    """Staging folders of runs that failed (their exception ended the process) do not outlive it."""
    for folder in list(_ACTIVE_STAGING):
        shutil.rmtree(folder, ignore_errors=True)


class StagedOutputs:
    """A set of output files of ``output_dir`` built in a hidden folder and moved in only when complete.

    ``folder`` is ``<base>/.<output_dir name>.<pid>.<random>.staging`` (:attr:`base`: the parent folder, or
    ``output_dir`` itself when it is on another file system): write every output there, then
    :meth:`commit` moves them into ``output_dir``, or :meth:`discard` removes the folder after a failure,
    leaving ``output_dir`` as it was. A run replaces or removes only files that it can prove a run wrote: those
    the manifest ``output_dir/.outputs.json`` lists with the size and SHA-256 they still have. The previous run's
    files that this one does not write again are removed, so that old and new outputs never mix (one changed since
    is left, with a warning); a file the run would write that no run wrote (a user's) is refused, and so is a
    symbolic link on the way to any file (:meth:`check`), before anything is moved. A staging folder that a killed
    process left behind is removed by the next staging of the same folder.
    """

    MARKER = ".staging"
    MANIFEST = ".outputs.json"

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.output_dir = Path(output_dir)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise NotADirectoryError(f"output_dir {self.output_dir}: a file, not a folder (give a folder)")
        self._folder: Path | None = None
        self._previous: dict[str, dict] | None = None  # the manifest's records, as check read them

    @property
    def base(self) -> Path:
        """Where the staging and set-aside folders go: beside ``output_dir``, or inside it when it is on another
        file system than its parent (a mount point, a link to another disk), where a rename could not reach it."""
        parent = self.output_dir.parent
        parent.mkdir(parents=True, exist_ok=True)
        if self.output_dir.is_dir() and os.stat(self.output_dir).st_dev != os.stat(parent).st_dev:
            return self.output_dir
        return parent

    @property
    def folder(self) -> Path:
        """The staging folder, created on first use."""
        if self._folder is None:
            base = self.base
            remove_stale_temporaries(base / self.output_dir.name, self.MARKER)
            self._folder = Path(
                tempfile.mkdtemp(prefix=_temp_prefix(self.output_dir.name), suffix=self.MARKER, dir=base)
            )
            _ACTIVE_STAGING.add(self._folder)
        return self._folder

    @property
    def started(self) -> bool:
        return self._folder is not None

    def discard(self) -> None:
        """Remove the staging folder (``output_dir`` keeps its previous outputs)."""
        self._previous = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            _ACTIVE_STAGING.discard(self._folder)
            self._folder = None

    def _target(self, name: str) -> Path:
        """``output_dir/name``; FileExistsError when a folder or the file on the way is a symbolic link (a write
        or removal there would reach outside ``output_dir``) or a folder on the way is a file."""
        path = self.output_dir
        for i, part in enumerate(Path(name).parts):
            path = path / part
            if path.is_symlink():
                raise FileExistsError(
                    f"{path}: a symbolic link in output_dir {self.output_dir}, on the way to {name}; outputs are never "
                    "written or removed through a link: remove it or choose another output_dir"
                )
            if i < len(Path(name).parts) - 1 and os.path.lexists(path) and not path.is_dir():
                raise FileExistsError(
                    f"{path}: a file where the run needs a folder for {name}: remove it or choose another output_dir"
                )
        return path

    def previous_outputs(self) -> dict[str, dict]:
        """The files (relative paths) runs wrote into ``output_dir``, each with the ``size`` and ``sha256`` the
        manifest records; entries without them (a manifest of an older version, or written by hand) are left out."""
        try:
            listed = json.loads(self._target(self.MANIFEST).read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        if not isinstance(listed, dict):
            return {}
        return {
            f: r
            for f, r in listed.items()
            if ".." not in Path(f).parts
            and not Path(f).is_absolute()
            and isinstance(r, dict)
            and isinstance(r.get("size"), int)
            and isinstance(r.get("sha256"), str)
        }

    @staticmethod
    def _record(path: Path) -> dict:
        return {"size": path.stat().st_size, "sha256": file_sha256(path)}

    @staticmethod
    def _unchanged(path: Path, record: dict | None) -> bool:
        """Whether ``path`` is a file with the size and SHA-256 of ``record``."""
        return (
            record is not None
            and path.is_file()
            and path.stat().st_size == record["size"]
            and (file_sha256(path) == record["sha256"])
        )

    def check(self, names: Iterable[str], fresh: bool = False) -> None:
        """Refuse outputs ``names`` (relative paths) that would replace a file no run wrote, and any link on the way
        to them or to the previous run's files (which the commit removes): FileExistsError naming the file.

        The writer calls it as soon as it knows a name, so that the refusal comes before the work; the manifest and
        the links to the previous run's files are read once until :meth:`discard` (a run checks a name per image).
        :meth:`commit` calls it again with every file, ``fresh`` (the manifest read again), before it moves anything.
        """
        if fresh or self._previous is None:
            self._target(self.MANIFEST)
            previous = self.previous_outputs()
            for name in previous:
                self._target(name)
            self._previous = previous
        previous = self._previous
        for name in names:
            target = self._target(name)
            if target.is_dir():
                raise FileExistsError(
                    f"{target}: a folder where the run writes the file {name}: remove it or choose another output_dir"
                )
            if os.path.lexists(target) and not self._unchanged(target, previous.get(name)):
                raise FileExistsError(
                    f"{target}: the run would replace this file, which no run of this bundle wrote (or which changed "
                    f"since, by {self.output_dir / self.MANIFEST}): remove it or choose another output_dir"
                )

    def commit(self) -> list[Path]:
        """Move the staged outputs into ``output_dir``, in place of the previous run's; return the new paths.

        The files being replaced are first moved aside (into a hidden folder beside the staging one, removed at the
        end), so that ``output_dir`` never holds old and new outputs together; the manifest listing the new files with
        their sizes and SHA-256 is written before anything moves (a full disk leaves ``output_dir`` as it was) and
        renamed into place last. Another run's commit into the same ``output_dir`` waits until this one is done
        (:meth:`_locked`), so that each replaces exactly the outputs of the commit before it.
        """
        staged = self.folder
        new = {str(p.relative_to(staged)): self._record(p) for p in sorted(staged.rglob("*")) if p.is_file()}
        try:
            with self._locked():
                return self._commit(staged, new)
        finally:
            self.discard()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An advisory lock (``flock``) on the folder ``output_dir``, held by one commit at a time: without it, a run
        that had read the manifest before another run's commit moved its outputs in left that run's other files under
        its own manifest (old and new outputs mixed)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.output_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _commit(self, staged: Path, new: dict[str, dict]) -> list[Path]:
        """:meth:`commit`'s check and moves, under its lock."""
        self.check(new, fresh=True)
        replaced = [self.output_dir / f for f in new]
        for name, record in self.previous_outputs().items():
            path = self.output_dir / name
            if name in new or not os.path.lexists(path):
                continue
            if self._unchanged(path, record):
                replaced.append(path)
            else:
                logger.warning("%s: an earlier run's output, changed since: left as it is", path)
        trash = None
        try:
            # the new manifest is written (beside its name) before anything moves: a full disk fails here, with
            # output_dir as it was (written last, the new outputs stood under the old manifest, unprovable)
            with self._new_manifest(new):
                trash = Path(
                    tempfile.mkdtemp(prefix=_temp_prefix(self.output_dir.name), suffix=self.MARKER, dir=staged.parent)
                )
                for i, p in enumerate(replaced):
                    if p.is_file():
                        os.replace(p, trash / f"{i}_{p.name}")
                for folder in sorted({p.parent for p in replaced}, key=lambda d: len(d.parts), reverse=True):
                    if folder != self.output_dir and folder.is_dir() and not any(folder.iterdir()):
                        folder.rmdir()  # emptied by the replacement: the previous run made it
                moved = []
                for f in new:
                    target = self.output_dir / f
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staged / f, target)
                    moved.append(target)
        finally:
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
        return moved

    @contextlib.contextmanager
    def _new_manifest(self, files: dict[str, dict]) -> Iterator[Path]:
        """The manifest listing ``files``, written to a temporary file beside it, renamed into place on leaving;
        OSError naming it when it cannot be written."""
        path = self.output_dir / self.MANIFEST
        with atomic_path(path) as tmp:
            try:
                tmp.write_text(json.dumps({"files": files}, indent=2) + "\n", encoding="utf-8")
            except OSError as e:
                raise OSError(
                    e.errno, f"{path} not written ({e.strerror}): output_dir {self.output_dir} left as it was"
                ) from None
            yield tmp
