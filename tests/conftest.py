"""Suite-wide checks: tests write only to temporary folders (the source tree is the same after the session)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what running Python and pytest leaves by itself, and the environments `make` creates
ALLOWED = ("__pycache__/", ".pytest_cache/", ".venv/", ".venv-monailabel/")


def _tree_state() -> set[str] | None:
    """Untracked and ignored paths and modified tracked files of the checkout; None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--ignored=matching", "--untracked-files=normal"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    paths = {line[3:] for line in done.stdout.splitlines()}
    return {p for p in paths if not any(part in p or p.startswith(part) for part in ALLOWED)}


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The commands' user cache (template features of ``inferring --datalist``) in a temporary folder, for this
    process and the commands it starts."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous


@pytest.fixture(scope="session", autouse=True)
def source_tree_unchanged():
    """Fails the session when a test wrote into the repository (outputs, generated data, edited files)."""
    before = _tree_state()
    yield
    after = _tree_state()
    if before is not None and after is not None:
        written = sorted(after - before)
        assert not written, f"tests wrote into the source tree {ROOT}: {written[:20]}"


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs at ``tmp_path / "disk"`` (skipped where it cannot be mounted: not root, no tmpfs)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs mounted here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


ABOVE_THE_CACHE = ["open folder", "foreign folder", "sticky folder"]


@pytest.fixture(params=ABOVE_THE_CACHE)
def cache_home(request, tmp_path, monkeypatch):
    """``XDG_CACHE_HOME`` set to the user's own 0700 folder inside a folder above the cache that is open to all
    (mode 0777), given to another user (uid 12345: root only), or sticky (1777, as /tmp); yields ``(home, why)``,
    ``why`` the start of the refusal naming the folder above (None for the sticky one: trusted)."""
    case = request.param
    if case == "foreign folder" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod({"open folder": 0o777, "foreign folder": 0o755, "sticky folder": 0o1777}[case])
    home = shared / "mine"
    home.mkdir(mode=0o700)
    if case == "foreign folder":
        os.chown(home, 12345, 12345)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    why = {
        "open folder": f"{shared}, above the cache, has owner uid {os.getuid()} and mode 0o777",
        "foreign folder": f"{home}, above the cache, has owner uid 12345 and mode 0o700",
    }.get(case)
    yield home, why


@pytest.fixture(scope="module")
def synthetic_setup():
    """The intensity estimators' synthetic case (:func:`estimation_data.estimation_case`), imported by the tests that
    ask for it alone."""
    from estimation_data import estimation_case

    return estimation_case()
