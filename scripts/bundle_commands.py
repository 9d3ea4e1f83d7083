"""Run a bundle command from code as a user types it, and read back what it wrote.

:func:`run_command` runs ``python -m monai.bundle run COMMAND --config_file [...] --KEY VALUE ...`` in a
subprocess from the bundle root (each config list from ``bundle.configs.config_files``) and returns what the
command wrote to its files (:func:`read_outputs`), never what it printed:

    done = run_command("evaluating", config_files("evaluate"), {"datalist": D, "output_dir": Y}, log=Y / "eval.log")
    done.outputs["mre_mm"], done.seconds, done.peak_rss_mb
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from bundle.configs import BUNDLE_ROOT, bundle_parser
from bundle.reporting import read_predictions_csv


class CommandRun(NamedTuple):
    """A finished command: what it wrote (:func:`read_outputs`), its wall time and its peak resident memory."""

    outputs: dict[str, Any]
    seconds: float
    peak_rss_mb: float


def run_command(
    command: str,
    config_files: Sequence[str],
    overrides: Mapping[str, Any] | None = None,
    log: str | os.PathLike | None = None,
    append: bool = False,
    bundle_root: str | os.PathLike = BUNDLE_ROOT,
) -> CommandRun:
    """Run the bundle's ``command`` (``training``, ``evaluating``, ``inferring``) on ``config_files`` (relative to
    ``bundle_root``, where it runs) with each of ``overrides`` as ``--KEY str(VALUE)``; its console output goes to
    ``log`` (appended to with ``append``; None: this process's console). Raises ``RuntimeError`` naming the log
    when the command fails."""
    overrides = dict(overrides or {})
    args = [sys.executable, "-m", "monai.bundle", "run", command, "--config_file", repr(list(config_files))]
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    start = time.perf_counter()
    with open(log, "a" if append else "w") if log else contextlib.nullcontext() as out:
        proc = subprocess.Popen(args, cwd=bundle_root, stdout=out, stderr=subprocess.STDOUT if out else None)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        where = f"; see {log}:\n{Path(log).read_text(encoding='utf-8', errors='replace')[-3000:]}" if log else ""
        raise RuntimeError(f"{command} failed (exit {code}){where}")
    outputs = read_outputs(command, config_files, overrides, bundle_root)
    return CommandRun(outputs, seconds, usage.ru_maxrss / 1024.0)


def read_outputs(
    command: str,
    config_files: Sequence[str],
    overrides: Mapping[str, Any] | None = None,
    bundle_root: str | os.PathLike = BUNDLE_ROOT,
) -> dict[str, Any]:
    """What a finished ``command`` wrote, found through its config's folders: ``evaluating``: its
    ``output_dir/metrics.json``; ``inferring``: ``{"predictions": rows of output_dir/predictions.csv}``;
    ``training``: ``{KEY_METRIC: value}``, the validation key metric (``val_mre_mm``) of the best checkpoint
    (``model.pt``) as the checkpoint saver ranks it in ``ckpt_dir/last.pt`` (``{}`` before any validation)."""
    values = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in (overrides or {}).items()}
    parser = bundle_parser(config_files, bundle_root, **values)

    def folder(key: str) -> Path:  # a relative folder is relative to the bundle root, where the command ran
        return Path(bundle_root) / parser.get_parsed_content(key)

    if command == "evaluating":
        return json.loads((folder("output_dir") / "metrics.json").read_text(encoding="utf-8"))
    if command == "inferring":
        return {"predictions": read_predictions_csv(folder("output_dir") / "predictions.csv")}
    if command == "training":
        (name,) = parser.get("validate#key_metric")
        sign = -1.0 if parser.get("validate#best_saver#key_metric_negative_sign") else 1.0
        ranking = torch.load(folder("ckpt_dir") / "last.pt", weights_only=True)["best_saver"].get("_saved", [])
        return {name: sign * float(max(ranking)[0])} if ranking else {}
    raise ValueError(f"unknown command {command!r}: training, evaluating or inferring")
