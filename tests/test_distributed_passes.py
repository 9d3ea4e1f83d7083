"""The passes over images before an evaluation (template ranking, pseudo-templates, template features, stage 2's
pseudo-labels) under torchrun: 2 gloo CPU processes share the images and hold what one process computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bundle.configs import bundle_parser
from bundle.data.synthetic import generate_synthetic_2d
from bundle.networks.xfeat import available as xfeat_available

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed_passes_worker.py"


def _run(command: list[str], logs: Path | None = None) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rank_output = "".join(f"\n--- {p}:\n{p.read_text()[-3000:]}" for p in sorted((logs or ROOT).rglob("*.log")) if logs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + rank_output


@pytest.mark.slow
def test_two_gloo_processes_share_the_images_and_hold_one_process_results(tmp_path):
    source = generate_synthetic_2d(tmp_path / "data", n_training=5, n_validation=1, n_test=1, size=(64, 72), seed=1)
    datalist = json.loads(source.read_text())
    datalist.pop("template")  # the templates ranked (by landmarks), pseudo-templates added
    datalist_path = source.with_name("ranked.json")
    datalist_path.write_text(json.dumps(datalist))
    torch.manual_seed(0)
    network = bundle_parser("configs/train.yaml", datalist=str(datalist_path)).get_parsed_content("network")
    torch.save(network.state_dict(), tmp_path / "weights.pt")
    args = [str(datalist_path), str(tmp_path / "weights.pt")]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    _run([sys.executable, str(WORKER), *args, str(one)])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", "2"]
    logs = tmp_path / "logs"
    _run([*torchrun, "--log-dir", str(logs), "--redirects", "3", str(WORKER), *args, str(two)], logs)

    alone = torch.load(one / "rank0.pt", weights_only=False)
    ranks = [torch.load(two / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    calls = [json.loads((two / f"calls_rank{r}.json").read_text()) for r in (0, 1)]
    # map_shards: every item once, in its rank's share (every other one); all results in order on every rank
    assert calls[0]["mapped"] == [0, 2, 4, 7] and calls[1]["mapped"] == [1, 3]
    assert all(r["squares"] == [0, 1, 4, 9, 16] and r["one"] == [49] for r in ranks)
    # an error on rank 1's share is raised on both ranks (none waits for the other); rank 0 decides for both
    assert all(r["error"] == "item 3 refused on rank 1" for r in ranks)
    assert alone["error"] == "item 3 refused on rank 0"
    assert [r["rank_0_says"] for r in ranks] == ["rank 0", "rank 0"]

    for r in ranks:  # bit for bit what one process computed: the same features, choices and pseudo-labels
        for key in ("features", "cached_features"):
            assert r[key]["sources"] == alone[key]["sources"] and r[key]["pseudo_sources"]
            torch.testing.assert_close(r[key]["queries"], alone[key]["queries"], rtol=0, atol=0, equal_nan=True)
        assert r["by_features"] == alone["by_features"]
        assert [it["image"] for it in r["pseudo_labels"]] == [it["image"] for it in alone["pseudo_labels"]]
        assert [it["landmarks"] for it in r["pseudo_labels"]] == [it["landmarks"] for it in alone["pseudo_labels"]]

    # each image a pass prepares or refines (each pass named by its progress bar), by one rank alone; the same as one
    # process does; the second call of the features reads rank 0's cache and computes nothing
    prepared = [[tuple(c) for c in rank_calls["computed"]] for rank_calls in calls]
    alone_prepared = [tuple(c) for c in json.loads((one / "calls_rank0.json").read_text())["computed"]]
    assert sorted(prepared[0] + prepared[1]) == sorted(alone_prepared) == sorted(set(alone_prepared))
    assert {(call, p) for call, p, _ in alone_prepared} == {
        ("template features", "template candidates"),
        ("template features", "pseudo-labels"),
        ("features rule", "template candidates"),
        ("stage 2", "pseudo-labels"),
        *[("stage 2", "XFeat refinement")] * xfeat_available(),
    }
    assert prepared[0] and prepared[1]
    # the files: the template cache and pseudo_labels.json written, and the cache read, by rank 0 alone
    assert [Path(p).name for p in calls[0]["written"]] == [Path(calls[0]["written"][0]).name, "pseudo_labels.json"]
    assert len(calls[0]["cache_read"]) == 1 and calls[1]["written"] == calls[1]["cache_read"] == []
    written = json.loads((two / "pseudo_labels.json").read_text())
    assert [it["landmarks"] for it in written["training"]] == [it["landmarks"] for it in alone["pseudo_labels"]]
