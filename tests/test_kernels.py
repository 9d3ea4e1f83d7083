"""Compiled kernels (bundle.kernels): built once into the cache, a damaged library built again, failures reported and
the numpy implementation run instead."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess

import numpy as np
import pytest
from bundle import kernels
from bundle.transforms import entropy as entropy_module
from bundle.transforms.entropy import local_entropy
from skimage.filters.rank import entropy as skimage_entropy

needs_compiler = pytest.mark.skipif(kernels._compiler() is None, reason="no C compiler here")
ROWS = ("local_entropy", "local_entropy_rows", ctypes.c_int, ())


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_PRIVATE", [], raising=False)  # no private folder made yet
    kernels.kernel_function.cache_clear()
    yield tmp_path / "infoguided-landmarks" / "kernels"
    kernels.kernel_function.cache_clear()


def fake_compiler(folder, name: str, script: str) -> str:
    """An executable shell script standing in for a C compiler (its arguments: flags, source, -o, output)."""
    path = folder / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)
    return str(path)


def entropy_runs_by_numpy() -> None:
    """local_entropy with the kernel as kernel_function now gives it (None here): the numpy path, skimage's map."""
    image = np.random.default_rng(0).integers(0, 256, (40, 30)).astype(np.uint8)
    expected = skimage_entropy(image, np.ones((5, 5), dtype=bool))
    np.testing.assert_allclose(local_entropy(image, 5).numpy(), expected, rtol=0, atol=1e-5)


@needs_compiler
def test_kernel_is_built_once_into_the_cache(fresh_cache, monkeypatch):
    library = kernels.kernel_library("local_entropy")
    assert library.parent == fresh_cache and library.name.startswith("local_entropy_") and library.suffix == ".so"
    assert sorted(p.name for p in fresh_cache.iterdir()) == sorted([library.name, library.with_suffix(".sha256").name])
    built = library.stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(subprocess, "run", no_build)
    assert kernels.kernel_library("local_entropy") == library and library.stat().st_mtime_ns == built
    assert kernels.kernel_function(*ROWS) is not None


@needs_compiler
def test_a_cache_built_under_an_open_umask_is_trusted(fresh_cache, monkeypatch, caplog):
    """Under umask 002 (user private groups) the folders and files are still made writable by their owner only, so
    the next run trusts them."""
    mask = os.umask(0o002)
    try:
        library = kernels.kernel_library("local_entropy")
    finally:
        os.umask(mask)
    made = (fresh_cache.parent, fresh_cache, library, library.with_suffix(".sha256"))
    modes = [p.stat().st_mode & 0o777 for p in made]
    assert modes == [0o700, 0o700, 0o755, 0o644]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("built again"))
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        assert kernels.kernel_library("local_entropy") == library
    assert caplog.text == ""


def planted_library(folder, marker) -> bytes:
    """A real shared library whose constructor, run as it is loaded, writes ``marker``."""
    source = folder / "planted.c"
    source.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void planted(void) "
        f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
    )
    command = [*kernels._compiler(), "-shared", "-fPIC", str(source), "-o", str(folder / "planted.so")]
    subprocess.run(command, check=True)
    return (folder / "planted.so").read_bytes()


@needs_compiler
@pytest.mark.parametrize("plant", ["open folder", "foreign file", "linked library", "linked folder"])
def test_a_library_planted_in_the_cache_is_not_loaded(fresh_cache, tmp_path, monkeypatch, caplog, plant):
    """Any library in the cache whose .sha256 matched was loaded: another user who could write there (a cache folder
    of mode 0777, a link to their folder) had their code run as the training's user. The cache is now trusted only
    when it is the user's alone: the kernels are built in a private temporary folder instead, said once."""
    if plant == "foreign file" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    library = kernels.kernel_library("local_entropy")  # its name, which the planter can predict
    kernels.kernel_function.cache_clear()
    marker = tmp_path / "planted_code_ran"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = planted_library(elsewhere, marker)
    record = f"{hashlib.sha256(planted).hexdigest()}\n"
    library.unlink()
    if plant == "linked library":
        library.symlink_to(elsewhere / "planted.so")
    elif plant == "linked folder":
        (elsewhere / library.name).write_bytes(planted)
        (elsewhere / library.with_suffix(".sha256").name).write_text(record)
        for p in fresh_cache.iterdir():
            p.unlink()
        fresh_cache.rmdir()
        fresh_cache.symlink_to(elsewhere, target_is_directory=True)
    else:
        library.write_bytes(planted)
    library.with_suffix(".sha256").write_text(record)
    if plant == "open folder":
        fresh_cache.chmod(0o777)
    if plant == "foreign file":
        os.chown(library, 12345, 12345)
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        entropy_runs_by_numpy()  # the map is computed (by the kernel built elsewhere)
        assert not marker.exists(), "the planted library was loaded"
        assert kernels.kernel_function(*ROWS) is not None  # a second kernel_library call: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    why = {
        "open folder": f"{fresh_cache} has owner uid {os.getuid()} and mode 0o777",
        "foreign file": f"{library} has owner uid 12345 and mode 0o644",
        "linked library": f"{library} is a symbolic link",
        "linked folder": f"{fresh_cache} is a symbolic link",
    }[plant]
    assert len(warnings) == 1 and f"kernel cache not trusted: {why}" in warnings[0], warnings
    private = kernels._PRIVATE[0]
    assert f"kernels are built in {private} instead" in warnings[0] and private.stat().st_mode & 0o777 == 0o700
    assert kernels.kernel_library("local_entropy") == private / library.name


@needs_compiler
def test_the_folders_above_the_cache_are_checked(cache_home, monkeypatch, caplog):
    """Only the folders from infoguided-landmarks down were checked: whoever could write to a folder above them (an
    XDG_CACHE_HOME in a mode 0777 folder, or another user's) could swap the cache between its check and the
    library's load. Such a cache is not trusted (the kernels built in a private temporary folder, said once); one in
    the user's own folder in a sticky one, as /tmp, is."""
    home, why = cache_home
    monkeypatch.setattr(kernels, "_PRIVATE", [], raising=False)
    kernels.kernel_function.cache_clear()
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        entropy_runs_by_numpy()
        library = kernels.kernel_library("local_entropy")
    kernels.kernel_function.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if why is None:
        assert warnings == [] and library.parent == home / "infoguided-landmarks" / "kernels"
        return
    assert len(warnings) == 1 and f"kernel cache not trusted: {why}" in warnings[0], warnings
    assert library == kernels._PRIVATE[0] / library.name


@needs_compiler
@pytest.mark.parametrize("damage", ["truncated", "empty", "no hash file"])
def test_damaged_library_is_built_again(fresh_cache, damage):
    """A library cut short (a crash after its rename) killed the interpreter when loaded (SIGBUS), run after run; one
    whose bytes do not match its hash file, or without one, is now built again before it is loaded."""
    library = kernels.kernel_library("local_entropy")
    whole = library.read_bytes()
    if damage == "no hash file":
        library.with_suffix(".sha256").unlink()
    else:
        library.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else b"")
    assert kernels.kernel_library("local_entropy") == library and library.read_bytes() == whole
    assert kernels.kernel_function(*ROWS) is not None


@pytest.mark.parametrize(
    "compiler, message",
    [
        ("false", r"false .*local_entropy\.c failed"),  # exits 1
        ("writes_nothing", "no output written"),  # exits 0 without writing the library
        ("not_latin", r"failed: caf\ufffd"),  # a message that is not text in the locale's encoding
    ],
)
def test_failed_build_is_reported_and_the_numpy_path_runs(
    fresh_cache, tmp_path, monkeypatch, caplog, compiler, message
):
    scripts = {"writes_nothing": "exit 0", "not_latin": "printf 'caf\\351' >&2; exit 1"}
    command = fake_compiler(tmp_path, compiler, scripts[compiler]) if compiler in scripts else compiler
    monkeypatch.setenv("CC", command)
    with pytest.raises(OSError, match=message):
        kernels.kernel_library("local_entropy")
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir())  # nothing half-written left
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        assert kernels.kernel_function(*ROWS) is None
    assert "could not build or load the local_entropy kernel" in caplog.text
    monkeypatch.setattr(entropy_module, "_entropy_rows_kernel", lambda: kernels.kernel_function(*ROWS))
    entropy_runs_by_numpy()


def test_hanging_compiler_is_given_up(fresh_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "hangs", "exec sleep 30"))
    monkeypatch.setattr(kernels, "BUILD_TIMEOUT", 1)
    with pytest.raises(subprocess.TimeoutExpired):
        kernels.kernel_library("local_entropy")
    assert kernels.kernel_function(*ROWS) is None


@needs_compiler
def test_missing_symbol_and_unreadable_cc_fall_back(fresh_cache, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        assert kernels.kernel_function("local_entropy", "no_such_function", ctypes.c_int, ()) is None
    assert "no_such_function" in caplog.text
    monkeypatch.setenv("CC", "'unclosed")  # shlex cannot read it: a warning, then the other compilers
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        assert kernels._compiler() is not None
    assert 'CC="\'unclosed" is not a compiler found on PATH' in caplog.text


def test_switched_off_or_no_cache_folder_means_no_kernel(fresh_cache, monkeypatch, caplog):
    monkeypatch.setenv(kernels.SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="bundle.kernels"):
        assert kernels.kernel_function(*ROWS) is None
    assert f"{kernels.SWITCH}=0" in caplog.text
    entropy_runs_by_numpy()
    monkeypatch.delenv(kernels.SWITCH)
    kernels.kernel_function.cache_clear()

    def no_home():
        raise RuntimeError("Could not determine home directory.")  # pathlib, where no home folder is known

    monkeypatch.setattr(kernels, "cache_root", no_home)
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        assert kernels.kernel_function(*ROWS) is None
    assert "home directory" in caplog.text


def test_no_compiler_means_no_kernel(fresh_cache, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    assert kernels.kernel_library("local_entropy") is None
    with caplog.at_level(logging.INFO, logger="bundle.kernels"):
        assert kernels.kernel_function(*ROWS) is None
    assert "no C compiler found" in caplog.text


def test_relative_cache_home_is_ignored(tmp_path, monkeypatch):
    from bundle.io_utils import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "infoguided-landmarks"
