"""Compiled CPU kernels: C sources in ``bundle/csrc`` built on first use and loaded with ctypes.

A kernel is built with the system C compiler (``$CC``, else the one Python was built with, else ``cc``, ``gcc``
or ``clang``) into ``kernels`` in :func:`bundle.io_utils.cache_root`, under a name holding the hash of its
source and of the compiler command, so a changed source or compiler builds anew. The library is written under
a temporary name and renamed (:func:`bundle.io_utils.atomic_path`): concurrent processes never load a
half-written one. Without a compiler, or when the build fails, :func:`load_kernel` returns None (once per
process, logged) and the caller runs its numpy implementation, which gives the same results.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from bundle.io_utils import atomic_path, cache_root

__all__ = ["load_kernel", "kernel_library"]

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
# portable flags only: a cache folder may be shared by machines with other processors
FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")


def _compiler() -> list[str] | None:
    for command in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        words = shlex.split(command) if command else []
        if words and shutil.which(words[0]):
            return words
    return None


def kernel_library(name: str) -> Path | None:
    """The built library of ``bundle/csrc/<name>.c`` (building it if needed); None without a C compiler.

    Raises:
        OSError: the compiler failed (its message ends the error) or the cache folder is not writable.
    """
    compiler = _compiler()
    if compiler is None:
        return None
    source = SOURCES / f"{name}.c"
    command = [*compiler, *FLAGS]
    digest = hashlib.sha256(source.read_bytes() + " ".join(command).encode()).hexdigest()[:16]
    library = cache_root() / "kernels" / f"{name}_{digest}.so"
    if not library.exists():
        with atomic_path(library) as partial:
            build = subprocess.run([*command, str(source), "-o", str(partial)], capture_output=True, text=True)
            if build.returncode != 0:
                raise OSError(f"{' '.join(command)} {source} failed: {build.stderr.strip()[-2000:]}")
    return library


@functools.cache
def load_kernel(name: str) -> ctypes.CDLL | None:
    """The loaded library of ``bundle/csrc/<name>.c``; None (logged once) if it cannot be built or loaded."""
    try:
        library = kernel_library(name)
        if library is None:
            logger.info("no C compiler found ($CC, cc, gcc, clang): %s runs its numpy implementation", name)
            return None
        return ctypes.CDLL(str(library))
    except OSError as error:
        logger.warning("could not build or load the %s kernel (%s): its numpy implementation runs instead", name, error)
        return None
