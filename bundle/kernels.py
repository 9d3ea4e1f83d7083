"""Compiled CPU kernels: C sources in ``bundle/csrc`` built on first use and loaded with ctypes.

A kernel is built with the system C compiler (``$CC``, else the one Python was built with, else ``cc``, ``gcc``
or ``clang``) into ``kernels`` in :func:`bundle.io_utils.cache_root`, under a name holding the hash of its
source, the compiler command and the machine's architecture, so a changed source or compiler command, or another
kind of processor sharing the folder, builds its own. The library is written under a temporary name, flushed to disk and
renamed (:func:`bundle.io_utils.atomic_path`), then a ``.sha256`` file holding the hash of its bytes is written
beside it; a library whose bytes do not match it (truncated by a crash, or damaged: loading such a file can kill
the interpreter) is built again. The cache is trusted only when its folders (from ``infoguided-landmarks`` down) and
files are the current user's and writable by no one else, and none is a symbolic link, and every folder above is the
user's or root's and writable by no one else unless sticky (:func:`bundle.io_utils.private_folder`): a library
planted there, or a folder swapped in after the check, would run as the user. Otherwise the kernels are
built in a fresh private temporary folder (mode 0700, removed at exit), logged once with the reason. Without a
compiler, when the build fails, or with ``INFOGUIDED_LANDMARKS_KERNELS=0`` in the environment,
:func:`kernel_function` returns None (once per process, logged) and the caller runs its numpy implementation, which
gives the same results.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from bundle.io_utils import atomic_path, cache_root, not_private, private_folder

__all__ = ["kernel_function", "kernel_library"]

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
# portable flags only: a cache folder may be shared by machines with other processors of the same architecture
FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
# seconds a build may take (a few on a slow machine) before it is given up
BUILD_TIMEOUT = 300
# the environment variable that turns the kernels off ("0"): the numpy implementations run
SWITCH = "INFOGUIDED_LANDMARKS_KERNELS"
_BUILDING = threading.Lock()
_PRIVATE: list[Path] = []  # the private temporary folder, once one is made


def _compiler() -> list[str] | None:
    """The C compiler command: ``$CC`` (a warning when it is set but not found), else the one Python was built
    with, else ``cc``, ``gcc`` or ``clang``; None when there is none."""
    candidates = [("$CC", os.environ.get("CC")), ("Python's", sysconfig.get_config_var("CC"))]
    candidates += [(name, name) for name in ("cc", "gcc", "clang")]
    for origin, command in candidates:
        try:
            words = shlex.split(command) if command else []
        except ValueError:
            words = []
        if words and shutil.which(words[0]):
            return words
        if origin == "$CC" and command:
            logger.warning(
                "CC=%r is not a compiler found on PATH: trying the others (Python's, cc, gcc, clang)", command
            )
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _private_folder(reason: str) -> Path:
    """This process's own temporary folder for the kernels (mode 0700, removed at exit), made and logged once."""
    if not _PRIVATE:
        folder = Path(tempfile.mkdtemp(prefix="infoguided-landmarks-kernels."))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _PRIVATE.append(folder)
        logger.warning(
            "kernel cache not trusted: %s; kernels are built in %s instead (removed at exit)", reason, folder
        )
    return _PRIVATE[0]


def _kernel_path(file_name: str) -> Path:
    """Where the library ``file_name`` goes: the cache's ``kernels`` folder when it and the files there are the
    user's alone, else the private temporary folder."""
    try:
        library = private_folder(cache_root(), "kernels") / file_name
        reason = not_private(library) or not_private(library.with_suffix(".sha256"))
    except PermissionError as error:
        reason = str(error)
    return _private_folder(reason) / file_name if reason else library


def _built(library: Path) -> bool:
    """True when ``library`` is there whole: its bytes hash to what its ``.sha256`` file says."""
    record = library.with_suffix(".sha256")
    try:
        return record.read_text(encoding="utf-8").strip() == _digest(library)
    except (OSError, UnicodeDecodeError):
        return False


def kernel_library(name: str) -> Path | None:
    """The built library of ``bundle/csrc/<name>.c`` (building it if it is not there whole); None without a C
    compiler.

    Raises:
        OSError: the compiler failed (its message ends the error), wrote nothing, or the cache folder is not
            writable. subprocess.TimeoutExpired: the build took longer than ``BUILD_TIMEOUT`` seconds.
    """
    compiler = _compiler()
    if compiler is None:
        return None
    source = SOURCES / f"{name}.c"
    command = [*compiler, *FLAGS]
    identity = "\n".join([" ".join(command), sys.platform, platform.machine()]).encode()
    library = _kernel_path(f"{name}_{hashlib.sha256(source.read_bytes() + identity).hexdigest()[:16]}.so")
    if _built(library):
        return library
    with atomic_path(library) as partial:
        build = subprocess.run(
            [*command, str(source), "-o", str(partial)],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=BUILD_TIMEOUT,
        )
        if build.returncode != 0 or partial.stat().st_size == 0:
            raise OSError(f"{' '.join(command)} {source} failed: {build.stderr.strip()[-2000:] or 'no output written'}")
        with open(partial, "rb") as written:
            os.fsync(written.fileno())
        partial.chmod(0o755)  # writable by no one else, whatever the umask
    with atomic_path(library.with_suffix(".sha256")) as record:
        record.write_text(_digest(library) + "\n", encoding="utf-8")
        record.chmod(0o644)
    return library


@functools.cache
def kernel_function(name: str, symbol: str, restype: Any, argtypes: Sequence[Any]) -> Any:
    """Function ``symbol`` of the library of ``bundle/csrc/<name>.c`` (:func:`kernel_library`) with its result and
    argument types; None (logged once) if the kernels are switched off or it cannot be built, loaded or found."""
    if os.environ.get(SWITCH, "").strip() == "0":
        logger.info("%s=0: %s runs its numpy implementation", SWITCH, name)
        return None
    try:
        with _BUILDING:  # threads of one process build once
            library = kernel_library(name)
        if library is None:
            logger.info("no C compiler found ($CC, Python's, cc, gcc, clang): %s runs its numpy implementation", name)
            return None
        function = getattr(ctypes.CDLL(str(library)), symbol)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
        # RuntimeError: pathlib finds no home folder for the cache
        logger.warning("could not build or load the %s kernel (%s): its numpy implementation runs instead", name, error)
        return None
    function.restype = restype
    function.argtypes = list(argtypes)
    return function
