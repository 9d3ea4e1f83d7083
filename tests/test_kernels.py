"""Compiled kernels (bundle.kernels): built once into the cache, rebuilt never, failures reported and survived."""

from __future__ import annotations

import logging
import subprocess

import numpy as np
import pytest
from bundle import kernels
from bundle.transforms import entropy as entropy_module
from bundle.transforms.entropy import local_entropy
from skimage.filters.rank import entropy as skimage_entropy

needs_compiler = pytest.mark.skipif(kernels._compiler() is None, reason="no C compiler here")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels.load_kernel.cache_clear()
    yield tmp_path / "infoguided-landmarks" / "kernels"
    kernels.load_kernel.cache_clear()


@needs_compiler
def test_kernel_is_built_once_into_the_cache(fresh_cache, monkeypatch):
    library = kernels.kernel_library("local_entropy")
    assert library.parent == fresh_cache and library.name.startswith("local_entropy_") and library.suffix == ".so"
    assert [p.name for p in fresh_cache.iterdir()] == [library.name]  # no temporary left beside it
    built = library.stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(subprocess, "run", no_build)
    assert kernels.kernel_library("local_entropy") == library and library.stat().st_mtime_ns == built
    assert kernels.load_kernel("local_entropy").local_entropy_rows is not None


def test_failed_build_is_reported_and_the_numpy_path_runs(fresh_cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.raises(OSError, match="false .*local_entropy.c failed"):
        kernels.kernel_library("local_entropy")
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir())  # nothing half-written left
    with caplog.at_level(logging.WARNING, logger="bundle.kernels"):
        assert kernels.load_kernel("local_entropy") is None
    assert "could not build or load the local_entropy kernel" in caplog.text
    monkeypatch.setattr(entropy_module, "_entropy_rows_kernel", lambda: entropy_module.load_kernel("local_entropy"))
    image = np.random.default_rng(0).integers(0, 256, (40, 30)).astype(np.uint8)
    expected = skimage_entropy(image, np.ones((5, 5), dtype=bool))
    np.testing.assert_allclose(local_entropy(image, 5).numpy(), expected, rtol=0, atol=1e-5)


def test_no_compiler_means_no_kernel(fresh_cache, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    assert kernels.kernel_library("local_entropy") is None
    with caplog.at_level(logging.INFO, logger="bundle.kernels"):
        assert kernels.load_kernel("local_entropy") is None
    assert "no C compiler found" in caplog.text
