"""Where the pixel-wise loss's hardest negatives lie, and how hard MoCHi's mixtures of them are.

A diagnostic for the comparison of docs/results.md: MoCHi (Kalantidis et al., NeurIPS 2020;
:class:`scripts.experiments.mixing.HardNegativeMixing`) mixes synthetic negatives from a query's hardest negatives. With
feature pixels as the instances of the multi-scale InfoNCE (Quan et al., CVPR 2023, Sec. 3.1) those may be
the positive cell's own neighbours. For view pairs drawn by the training config's sampler and a trained
checkpoint, each scale of the loss reports (over the queries inside both views):

* ``hard_adjacent_pct``: the share of the ``N`` hardest negatives (MoCHi's hard set) that touch the positive
  cell (Chebyshev distance 1), beside ``adjacent_pct``, the share of all real negatives that do (chance);
* ``hard_distance_median``: the median Chebyshev distance in cells of the hard set from the positive;
* ``real_above_positive_pct`` / ``synthetic_above_positive_pct``: the share of real negatives / of MoCHi's
  synthetic negatives whose cosine with the query exceeds the positive's;
* ``positive_cosine`` / ``hard_cosine`` / ``synthetic_cosine``: the mean cosines.

    python -m scripts.experiments.hard_negatives --ckpt_path runs/hamedan_comparison/baseline_s0/models/model.pt \
        --datalist runs/hamedan/protocol.json --batches 20 --output hard.json
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from bundle.configs import bundle_parser
from bundle.io_utils import write_json_atomic
from bundle.losses.infonce import window_offsets
from scripts.cli import run_fire
from scripts.experiments.mixing import HardNegativeMixing

# the training config with the comparison methods' keys (mochi_*), as the comparison's runs trained
TRAIN_CONFIGS = ("configs/train.yaml", "scripts/experiments/configs/comparison.yaml")


class KeySetRecorder:
    """A stand-in for the loss's ``feature_mixing`` that keeps each scale's ``(query, keys, logits, target)`` and
    changes nothing."""

    def __init__(self) -> None:
        self.key_sets: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, query, keys, logits, target):
        self.key_sets.append((query.detach(), keys.detach(), logits.detach(), target))
        return logits, target


def cell_distances(logits: torch.Tensor, target: torch.Tensor, window: int | None, spatial) -> torch.Tensor:
    """Chebyshev distance in cells ``(B, Q, K)`` of every key column from the positive's cell: the loss's
    window columns are the cells of :func:`bundle.losses.infonce.window_offsets`, its global columns the row-major cells
    of the map."""
    if window is not None:
        return window_offsets(window, len(spatial), logits.device).abs().amax(-1).expand(logits.shape)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    cells = torch.stack(torch.unravel_index(columns, tuple(spatial)), -1)  # (K, D), on the logits' device
    positive = cells[target]  # (B, Q, D)
    return (cells[None, None] - positive[:, :, None]).abs().amax(-1)


def scale_statistics(key_set, valid: torch.Tensor, window: int | None, spatial, mochi: HardNegativeMixing) -> dict:
    """The statistics of one scale (module docstring) over the ``valid (B, Q)`` queries."""
    query, keys, logits, target = key_set
    distance = cell_distances(logits, target, window, spatial)
    negative = torch.isfinite(logits).scatter(-1, target[..., None], False) & valid[..., None]
    positive_cos = logits.gather(-1, target[..., None])  # (B, Q, 1)
    hard = mochi.hard_set(logits, target)
    hard_real = torch.isfinite(logits.gather(-1, hard)) & valid[..., None]
    hard_distance = distance.gather(-1, hard)[hard_real].float()
    syn = mochi.synthesize(query, keys, logits, target)
    synthetic_cos = torch.einsum("bqc,bqsc->bqs", query, syn.vectors)
    usable = syn.usable & valid[..., None]

    def pct(mask: torch.Tensor, within: torch.Tensor) -> float:
        return round(100.0 * float(mask[within].float().mean()), 2)

    return {
        "window": window,
        "map_size": list(spatial),
        "queries": int(valid.sum()),
        "hard_set_size": int(hard.shape[-1]),
        "hard_adjacent_pct": round(100.0 * float((hard_distance == 1).float().mean()), 2),
        "adjacent_pct": pct(distance == 1, negative),
        "hard_distance_median": float(hard_distance.median()),
        "real_above_positive_pct": pct(logits > positive_cos, negative),
        "synthetic_above_positive_pct": pct(synthetic_cos > positive_cos, usable),
        "positive_cosine": round(float(positive_cos[..., 0][valid].mean()), 4),
        "hard_cosine": round(float(logits.gather(-1, hard)[hard_real].mean()), 4),
        "synthetic_cosine": round(float(synthetic_cos[usable].mean()), 4),
    }


def hard_negative_statistics(
    ckpt_path: str,
    datalist: str | None = None,
    config_file=TRAIN_CONFIGS,
    batches: int = 20,
    seed: int = 0,
    output: str | None = None,
    **overrides,
) -> list[dict]:
    """Statistics per scale (coarse to fine) over the queries of ``batches`` training batches drawn with
    ``seed``; written to ``output`` (JSON) when given. ``overrides`` are training config keys
    (``--batch_size 4``)."""
    if not Path(ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path {ckpt_path}: no such checkpoint")
    configs = [config_file] if isinstance(config_file, str) else list(config_file)
    if datalist is not None:
        overrides["datalist"] = str(Path(datalist).resolve())
    parser = bundle_parser(configs, init_weights=str(Path(ckpt_path).resolve()), seed=seed, **overrides)
    parser.get_parsed_content("ensure_data")
    torch.manual_seed(seed)
    network = parser.get_parsed_content("network").eval()
    loss = parser.get_parsed_content("loss")
    loader = parser.get_parsed_content("train#dataloader")
    mochi = HardNegativeMixing(
        parser.get_parsed_content("mochi_hardest"),
        parser.get_parsed_content("mochi_synthetic"),
        parser.get_parsed_content("mochi_query_synthetic"),
    )
    device = next(network.parameters()).device
    recorder, valid, windows, spatial = KeySetRecorder(), [], None, None
    loss.feature_mixing = recorder
    with torch.no_grad():
        for batch in itertools.islice(_endless(loader), batches):
            image, crop, points, crop_points = (batch[k].to(device) for k in ("image", "crop", "query", "crop_query"))
            image_features, crop_features = network(image), network.encode_crops(crop)
            loss(image_features, crop_features, points, crop_points, image.shape[2:], crop.shape[2:])
            valid.append(~(torch.isnan(points).any(-1) | torch.isnan(crop_points).any(-1)))
            windows, spatial = loss.windows_for(len(image_features)), [f.shape[2:] for f in image_features]
    if not valid:
        raise ValueError(f"the training dataloader of {configs} gave no batch")
    num_scales = len(windows)
    result = []
    for i in range(num_scales):  # the recorder holds the scales of each batch in turn
        key_set = [torch.cat(parts) for parts in zip(*recorder.key_sets[i::num_scales])]
        result.append(scale_statistics(key_set, torch.cat(valid), windows[i], spatial[i], mochi))
    if output:
        write_json_atomic(output, {"ckpt_path": ckpt_path, "batches": batches, "seed": seed, "scales": result})
    return result


def _endless(loader):
    """The loader's batches, pass after pass (each pass draws new view pairs)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return


def main(**kwargs) -> None:
    """Command line: the statistics of :func:`hard_negative_statistics` printed as JSON."""
    print(json.dumps(hard_negative_statistics(**kwargs), indent=1))


if __name__ == "__main__":
    run_fire(main)
