"""What a first GPU run needs, checked on the CPU: checkpoints hold CPU tensors, buffers follow the module's
device, the loss and the template combination read the device rarely, each torchrun process has its own
random stream and a new data order on every pass, and the data loader feeds a GPU from workers."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from bundle.checkpoints import read_checkpoint, read_state_dict, save_atomically
from bundle.configs import bundle_parser, seed_everything
from bundle.data.samplers import ReshufflingDistributedSampler
from bundle.kshot import geometric_median
from bundle.losses.infonce import MultiScaleInfoNCELoss
from bundle.networks.contrastive import ContrastiveLandmarkNet
from bundle.networks.landmark_points import LandmarkPointsNet
from monai.bundle import ckpt_export

from host_syncs import HostSyncCounter

ROOT = Path(__file__).resolve().parents[1]


class _GpuTensorShim(torch.Tensor):
    """Stands for a CUDA tensor on a machine without one: records the moves to the CPU."""

    moves = 0

    def cpu(self, *args, **kwargs):
        type(self).moves += 1
        return self.as_subclass(torch.Tensor)


def _cuda_tagged_copy(src: Path, dst: Path) -> Path:
    """``src`` (a torch.save file) with every storage's location rewritten to ``cuda:0``: the file a GPU run
    writes when it saves its tensors as they are."""
    with zipfile.ZipFile(src) as zin:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = zin.read(info.filename)
                if info.filename.endswith("data.pkl"):
                    data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
                zout.writestr(info.filename, data)
    dst.write_bytes(buffer.getvalue())
    return dst


def test_checkpoints_are_written_with_cpu_tensors_and_export_without_a_gpu(tmp_path):
    network = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
    on_gpu = {k: v.as_subclass(_GpuTensorShim) for k, v in network.state_dict().items()}
    _GpuTensorShim.moves = 0
    adam_step = torch.tensor(5.0).as_subclass(_GpuTensorShim)
    save_atomically(
        {"model": on_gpu, "optimizer": {"state": {0: {"step": adam_step}}}, "epoch": 3}, tmp_path / "last.pt"
    )
    assert _GpuTensorShim.moves == len(on_gpu) + 1
    # plain CPU tensors: the file loads with weights_only (a tensor subclass would be refused) and no map_location
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in loaded["model"].values())
    assert loaded["optimizer"]["state"][0]["step"].device.type == "cpu" and loaded["epoch"] == 3

    # what a GPU-saved file did to a CPU-only user: plain torch.load refuses it, the bundle's reader maps it
    torch.save(network.state_dict(), tmp_path / "cpu.pt")
    tagged = _cuda_tagged_copy(tmp_path / "cpu.pt", tmp_path / "cuda.pt")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tagged, weights_only=True)
    state = read_state_dict(tagged)
    assert set(state) == set(network.state_dict()) and all(v.device.type == "cpu" for v in state.values())

    # the model zoo's export (MONAI's ckpt_export loads without map_location) of a checkpoint the savers wrote
    save_atomically({k: v.as_subclass(_GpuTensorShim) for k, v in _shipped_state().items()}, tmp_path / "model.pt")
    ckpt_export(
        net_id="network_def",
        filepath=str(tmp_path / "model.ts"),
        ckpt_file=str(tmp_path / "model.pt"),
        meta_file=str(ROOT / "configs" / "metadata.json"),
        config_file=str(ROOT / "configs" / "inference.yaml"),
        bundle_root=str(ROOT),
    )
    assert (tmp_path / "model.ts").stat().st_size > 0
    assert read_checkpoint(tmp_path / "model.pt").keys() == _shipped_state().keys()


def _shipped_state() -> dict:
    return torch.load(ROOT / "models" / "model.pt", weights_only=True)


def test_the_export_network_buffers_follow_its_device():
    network = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
    template = {
        "format": "infoguided-landmarks-template/1",
        "landmark_names": ["a", "b"],
        "queries": torch.randn(2, 2, 2, 8),
        "strides": [4, 2],
        "spatial_dims": 2,
        "sources": ["t1", "t2"],
    }
    model = LandmarkPointsNet(network, template).to("meta")
    assert {t.device.type for t in [*model.buffers(), *model.parameters()]} == {"meta"}
    fresh = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
    scripted = torch.jit.script(LandmarkPointsNet(fresh, template)).to("meta")
    assert scripted.queries.device.type == "meta" and scripted.valid.device.type == "meta"


def test_the_loss_reads_the_device_once_per_call_with_the_same_value():
    torch.manual_seed(0)
    image = [torch.randn(2, 8, 24 // s, 24 // s) for s in (8, 4, 2)]
    crop = [torch.randn(2, 8, 12 // s, 12 // s) for s in (4, 2, 1)]
    points, crop_points = 2 + 20 * torch.rand(2, 5, 2), 1 + 10 * torch.rand(2, 5, 2)
    points[0, 1] = float("nan")  # a left-out query
    loss = MultiScaleInfoNCELoss(0.1, 3)
    loss(image, crop, points, crop_points, (24, 24), (12, 12))  # builds the window offsets once
    with HostSyncCounter() as syncs:
        value = loss(image, crop, points, crop_points, (24, 24), (12, 12))
    assert syncs.total == 1, syncs.kinds  # the check that the queries lie on their grids (22 before)
    # the value against a direct per-query computation of the left-in queries' InfoNCE at the global scale
    _, terms = loss(image, crop, points, crop_points, (24, 24), (12, 12), return_terms=True)
    keys = image[0].flatten(2)  # (B, C, 9)
    expected = []
    for b, q in [(0, 0), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]:
        crop_scale = [c / 12 for c in crop[0].shape[2:]]
        pos = [(crop_points[b, q, a] + 0.5) * crop_scale[a] - 0.5 for a in range(2)]
        feature = torch.nn.functional.grid_sample(
            crop[0][b : b + 1],
            torch.tensor(
                [[[[(2 * (pos[1] + 0.5) / crop[0].shape[3]) - 1, (2 * (pos[0] + 0.5) / crop[0].shape[2]) - 1]]]]
            ),
            align_corners=False,
            padding_mode="border",
        ).flatten()
        feature = feature / feature.norm()
        cell = [min(max(int(torch.round((points[b, q, a] + 0.5) * (3 / 24) - 0.5)), 0), 2) for a in range(2)]
        logits = feature @ keys[b] / 0.1
        expected.append(torch.logsumexp(logits, 0) - logits[cell[0] * 3 + cell[1]])
    torch.testing.assert_close(terms[0], torch.stack(expected).mean(), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(value)


def test_the_geometric_median_reads_the_device_once_per_newton_step():
    torch.manual_seed(0)
    points = torch.randn(5, 3, 19, 2) * 10
    with HostSyncCounter() as syncs:
        median = geometric_median(points)
    assert 0 < syncs.total <= 32, syncs.kinds  # one read per Newton step: 19 here (785 for Weiszfeld alone)
    cost = (points.double() - median).norm(dim=-1).sum(0)
    for step in ([1e-6, 0.0], [0.0, 1e-6], [-1e-6, 0.0], [0.0, -1e-6]):  # a minimum: no small move does better
        moved = (points.double() - (median + torch.tensor(step, dtype=torch.float64))).norm(dim=-1).sum(0)
        assert (moved >= cost - 1e-12).all()


def test_each_pass_of_the_distributed_sampler_draws_a_new_order_split_between_ranks():
    data = list(range(10))
    ranks = [ReshufflingDistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1)]
    passes = [[list(iter(sampler)) for sampler in ranks] for _ in range(3)]  # one epoch read three times
    for share0, share1 in passes:
        assert sorted(share0 + share1) == data  # disjoint shares covering the data
    assert len({tuple(p[0]) for p in passes}) == 3  # the parent repeats its first pass
    plain = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    assert list(iter(plain)) == list(iter(plain)) == passes[0][0]


def test_seeding_names_the_cudnn_autotuner_and_differs_per_rank():
    before = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    try:
        seed_everything(3, "true")
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
        assert torch.initial_seed() == 3
        seed_everything(3 + 1, False)
        assert not torch.backends.cudnn.benchmark and torch.initial_seed() == 4
        with pytest.raises(ValueError, match="cudnn_benchmark"):
            seed_everything(0, "maybe")
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before


@pytest.mark.parametrize("cuda", [False, True])
def test_the_training_loader_uses_workers_and_pinned_memory_on_a_gpu(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    parser = bundle_parser("configs/train.yaml")
    workers, pinned = parser.get_parsed_content("num_workers"), parser.get_parsed_content("pin_memory")
    assert (workers > 0, pinned) == (cuda, cuda)
    loader = parser.get("train#dataloader")
    assert "@pin_memory" in loader["pin_memory"] and loader["num_workers"] == "@num_workers"
    assert "@pin_memory" in parser.get("train#trainer#non_blocking")
