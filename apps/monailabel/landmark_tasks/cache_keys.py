"""What the app's caches are keyed by: a file's content, saved labels."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence


def file_key(path: str | Path) -> tuple[str, int, int]:
    """Identity of a file's current content for caches: path, mtime (ns) and size."""
    st = os.stat(path)
    return (str(path), st.st_mtime_ns, st.st_size)


def labels_key(labelled: Sequence[dict]) -> tuple:
    """What of saved labels a result computed from them depends on: each image's id and landmarks."""
    return tuple((it["id"], json.dumps(it["landmarks"])) for it in labelled)
