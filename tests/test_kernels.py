"""Compiled kernels (bundle.kernels): built once into the cache, a damaged library built again, failures reported and
the numpy implementation run instead."""

from __future__ import annotations

import ctypes
import logging
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
