"""The paper's comparison methods (scripts.experiments.mixing): MoCHi, Zhu et al.'s feature transformation and
Un-mix, each against a hand computation of its defining property, wired through the loss and the training step
(scripts/experiments/configs/comparison.yaml); and the hard-negative diagnostic of the comparison
(scripts/experiments/hard_negatives.py)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from bundle.configs import bundle_parser
from bundle.data.synthetic import generate_synthetic_2d
from bundle.engines.contrastive import ContrastiveIterationUpdate
from bundle.losses.infonce import MultiScaleInfoNCELoss
from bundle.networks.contrastive import ContrastiveLandmarkNet
from scripts.experiments.hard_negatives import cell_distances, hard_negative_statistics, scale_statistics
from scripts.experiments.mixing import (
    FeatureTransformation,
    HardNegativeMixing,
    UnmixLoss,
    feature_mixing,
    image_mixing,
    unmix_crops,
    unmix_draw,
    unmix_loss,
)

from tests.test_training_step import _engine

COMPARISON = ["configs/train.yaml", "scripts/experiments/configs/comparison.yaml"]


def key_set(b: int = 2, q: int = 3, k: int = 10, c: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Unit query and keys, their cosines with one left-out cell (-inf) per row, a random positive column."""
    g = torch.Generator().manual_seed(seed)
    query = F.normalize(torch.randn(b, q, c, generator=g, dtype=torch.float64), dim=-1)
    keys = F.normalize(torch.randn(b, q, k, c, generator=g, dtype=torch.float64), dim=-1)
    target = torch.randint(k, (b, q), generator=g)
    left_out = (target + 1 + torch.randint(k - 1, (b, q), generator=g)) % k  # never the positive
    logits = torch.einsum("bqc,bqkc->bqk", query, keys).scatter(-1, left_out[..., None], float("-inf"))
    return query, keys, logits, target


def test_mochi_synthetic_negatives_mix_the_hardest_and_never_the_positive():
    query, keys, logits, target = key_set()
    mochi = HardNegativeMixing(hardest=0.3, synthetic=1.0, query_synthetic=0.5)
    assert mochi.counts(9) == (3, 9, 5)
    torch.manual_seed(0)
    syn = mochi.synthesize(query, keys, logits, target)
    assert syn.vectors.shape == (2, 3, 14, 8) and bool(syn.usable.all())
    for b in range(2):
        for i in range(3):
            negatives = {j: float(logits[b, i, j]) for j in range(10) if j != target[b, i] and logits[b, i, j] > -1e9}
            hardest = set(sorted(negatives, key=negatives.get)[-3:])  # the 3 highest cosines
            for m in range(14):
                first, second, w = int(syn.first[b, i, m]), int(syn.second[b, i, m]), float(syn.share[b, i, m])
                assert second in hardest and first != int(target[b, i])
                if m < 9:  # between two hard negatives
                    assert first in hardest and 0.0 <= w <= 1.0
                    mix = w * keys[b, i, first] + (1 - w) * keys[b, i, second]
                else:  # between the query and a hard negative, the query's share below 0.5
                    assert first == -1 and 0.0 <= w < 0.5
                    mix = w * query[b, i] + (1 - w) * keys[b, i, second]
                torch.testing.assert_close(syn.vectors[b, i, m], mix / mix.norm())
    torch.testing.assert_close(syn.vectors.norm(dim=-1), torch.ones(2, 3, 14, dtype=torch.float64))
    # harder on average than the real negatives: higher cosine with the query
    real = logits.scatter(-1, target[..., None], float("-inf"))
    real_mean = real[torch.isfinite(real)].mean()
    assert torch.einsum("bqc,bqsc->bqs", query, syn.vectors).mean() > real_mean + 0.2
    # the loss sees the K real columns unchanged, then the synthetic ones as negatives; the positive stays put
    torch.manual_seed(0)
    mixed, new_target = mochi(query, keys, logits, target)
    assert mixed.shape == (2, 3, 24) and torch.equal(mixed[..., :10], logits) and torch.equal(new_target, target)
    torch.testing.assert_close(mixed[..., 10:], torch.einsum("bqc,bqsc->bqs", query, syn.vectors))


def test_mochi_leaves_out_mixes_of_left_out_cells():
    query, keys, logits, target = key_set(b=1, q=1, k=4)
    logits = logits.clone()
    logits[0, 0, [j for j in range(4) if j != target[0, 0]][1:]] = float("-inf")  # a single real negative
    mochi = HardNegativeMixing(hardest=1.0, synthetic=1.0, query_synthetic=1.0)  # the hard set holds left-out cells
    torch.manual_seed(0)
    syn = mochi.synthesize(query, keys, logits, target)
    torch.manual_seed(0)
    mixed, _ = mochi(query, keys, logits, target)
    for m in range(6):
        mixed_cells = [int(syn.second[0, 0, m])] + [int(syn.first[0, 0, m])] * (m < 3)
        assert bool(syn.usable[0, 0, m]) == all(math.isfinite(float(logits[0, 0, j])) for j in mixed_cells)
    assert torch.equal(torch.isneginf(mixed[0, 0, 4:]), ~syn.usable[0, 0])
    assert not bool((syn.first == target[..., None]).any() | (syn.second == target[..., None]).any())
    assert math.isfinite(float(F.cross_entropy(mixed[0] / 0.1, target[0])))


def orthogonal_case(k: int = 6, c: int = 8) -> tuple[torch.Tensor, ...]:
    """Query and positive in span(e0, e1), negatives in the orthogonal complement (so q^ . n^ = 0)."""
    g = torch.Generator().manual_seed(1)
    query = torch.zeros(1, 1, c, dtype=torch.float64)
    query[..., :2] = torch.tensor([1.0, 0.0])
    positive = torch.tensor([0.6, 0.8], dtype=torch.float64)
    keys = torch.zeros(1, 1, k, c, dtype=torch.float64)
    keys[..., 2:] = F.normalize(torch.randn(1, 1, k, c - 2, generator=g, dtype=torch.float64), dim=-1)
    target = torch.tensor([[2]])
    keys[0, 0, 2] = 0.0
    keys[0, 0, 2, :2] = positive
    logits = torch.einsum("bqc,bqkc->bqk", query, keys)
    logits[0, 0, 4] = float("-inf")
    return query, keys, logits, target


def test_zhu_extrapolates_the_positive_pair_and_interpolates_negatives():
    query, keys, logits, target = orthogonal_case()
    zhu = FeatureTransformation()
    torch.manual_seed(3)
    t = zhu.transform(query, keys, logits, target)
    lam, mu = float(t.lam), float(t.mu)
    assert 1.0 <= lam <= 2.0 and 0.0 <= mu <= 1.0
    q, k = query[0, 0], keys[0, 0, 2]
    # beyond the pair on the line through them: q^ = k + lam (q - k), k^ = q + lam (k - q)
    torch.testing.assert_close(t.query[0, 0], k + lam * (q - k))
    torch.testing.assert_close(t.positive[0, 0], q + lam * (k - q))
    assert (t.query[0, 0] - t.positive[0, 0]).norm() >= (q - k).norm()
    # each real negative mixed with another real negative of a random permutation (positive, left-out excluded)
    real = [0, 1, 3, 5]
    partner = t.partner[0, 0].tolist()
    assert sorted(partner[j] for j in real) == real
    for j in real:
        torch.testing.assert_close(t.keys[0, 0, j], mu * keys[0, 0, j] + (1 - mu) * keys[0, 0, partner[j]])
    # the loss rises as intended: the positive's cosine c drops to c + 2 lam (1 - lam) (1 - c), negatives stay 0
    torch.manual_seed(3)
    mixed, _ = zhu(query, keys, logits, target)
    c = 0.6
    hat = c + 2 * lam * (1 - lam) * (1 - c)
    assert torch.isneginf(mixed[0, 0, 4]) and float(mixed[0, 0, 2]) == pytest.approx(hat)
    temperature = 0.1
    expected = -math.log(math.exp(hat / temperature) / (math.exp(hat / temperature) + 4))
    loss = float(F.cross_entropy(mixed[0] / temperature, target[0]))
    assert loss == pytest.approx(expected) and loss > float(F.cross_entropy(logits[0] / temperature, target[0]))


def feature_maps(b: int, dims: int, seed: int, c: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [F.normalize(torch.randn(b, c, *([n] * dims), generator=g), dim=1) for n in (2, 4)]


def points(b: int, q: int, dims: int, size: int, seed: int) -> torch.Tensor:
    return (size - 1) * torch.rand(b, q, dims, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dims", [2, 3])
def test_mixing_none_is_todays_loss_and_the_methods_run_in_2d_and_3d(dims):
    image, crop = feature_maps(2, dims, 0), feature_maps(2, dims, 1)
    for f in crop:
        f.requires_grad_(True)
    args = (image, crop, points(2, 5, dims, 8, 2), points(2, 5, dims, 8, 3), (8,) * dims, (8,) * dims)
    base = MultiScaleInfoNCELoss(0.1, 3)(*args)
    assert feature_mixing("none") is None
    assert torch.equal(MultiScaleInfoNCELoss(0.1, 3, feature_mixing=feature_mixing("none"))(*args), base)
    for name in ("mochi", "zhu"):
        torch.manual_seed(0)
        first = MultiScaleInfoNCELoss(0.1, 3, feature_mixing=feature_mixing(name))(*args)
        torch.manual_seed(0)
        assert torch.equal(MultiScaleInfoNCELoss(0.1, 3, feature_mixing=feature_mixing(name))(*args), first)
        assert torch.isfinite(first) and first > base  # harder negatives / harder positives
        (grad,) = torch.autograd.grad(first, crop[1])
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("dims", [2, 3])
def test_unmix_mixes_crops_pixelwise_and_weights_own_and_partner_losses(dims):
    b, q = 3, 4  # odd: the middle sample is its own partner
    crops = torch.rand(b, 1, *([6] * dims), generator=torch.Generator().manual_seed(0))
    lam = 0.3
    mixed = unmix_crops(crops, lam)
    for i in range(b):
        torch.testing.assert_close(mixed[i], lam * crops[i] + (1 - lam) * crops[b - 1 - i])
    image, crop = feature_maps(b, dims, 4), feature_maps(b, dims, 5)
    image_points, crop_points = points(b, q, dims, 8, 6), points(b, q, dims, 8, 7)
    loss_fn, size = MultiScaleInfoNCELoss(0.1, 3), (8,) * dims

    def one(i: int, j: int) -> torch.Tensor:  # crop i's queries against sample j's points and image features
        pick = slice(i, i + 1)
        return loss_fn([f[j : j + 1] for f in image], [f[pick] for f in crop], image_points[j : j + 1],
                       crop_points[j : j + 1], size, size)  # fmt: skip

    own = torch.stack([one(i, i) for i in range(b)]).mean()
    partner = torch.stack([one(i, b - 1 - i) for i in range(b)]).mean()
    got = unmix_loss(loss_fn, image, crop, image_points, crop_points, size, size, lam)
    torch.testing.assert_close(got, lam * own + (1 - lam) * partner)


@pytest.mark.parametrize("dims", [2, 3])
def test_unmix_cutmix_pastes_a_box_of_the_partner_and_lam_is_the_own_share(dims):
    size = (12, 10, 8)[:dims]
    crops = torch.rand(3, 1, *size, generator=torch.Generator().manual_seed(1))
    partner = crops.flip(0)
    kinds = []
    for seed in range(40):
        torch.manual_seed(seed)
        draw = unmix_draw(size, alpha=1.0, global_prob=0.0)
        mixed = unmix_crops(crops, draw.lam, draw.box)
        own = mixed == crops
        assert ((mixed == partner) | own).all()  # every pixel is the crop's own or its partner's
        # the partner's pixels fill one axis-aligned box inside the crop (the middle sample is its own partner)
        pasted = ~own[0, 0]
        if pasted.any():
            index = pasted.nonzero()
            lo, hi = index.min(0).values, index.max(0).values
            box = tuple(slice(int(a), int(b) + 1) for a, b in zip(lo, hi))
            assert pasted[box].all() and int(pasted.sum()) == math.prod(s.stop - s.start for s in box)
        assert draw.lam == pytest.approx(float(own[0].float().mean()))  # lam: the crop's own share
        kinds.append(draw.box is None)
    assert not any(kinds)
    torch.manual_seed(0)
    assert all(unmix_draw(size, global_prob=1.0).box is None for _ in range(20))
    global_share = sum(unmix_draw(size, global_prob=0.5).box is None for _ in range(400)) / 400
    assert 0.4 < global_share < 0.6


def _view_pair_batch() -> dict:
    """A fixed batch of two view pairs (32x32 images, 16x16 crops, 4 queries)."""
    g = torch.Generator().manual_seed(0)
    return {
        "image": torch.rand(2, 1, 32, 32, generator=g),
        "crop": torch.rand(2, 1, 16, 16, generator=g),
        "query": 4 + 24 * torch.rand(2, 4, 2, generator=g),
        "crop_query": 4 + 8 * torch.rand(2, 4, 2, generator=g),
    }


@pytest.mark.parametrize("global_prob", [1.0, 0.0])
def test_training_step_unmix_feeds_the_mixed_crop_and_is_reproducible(global_prob):
    batch = _view_pair_batch()
    losses, seen = [], []
    for _ in range(2):
        torch.manual_seed(0)
        net = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
        encode = net.encode_crops
        net.encode_crops = lambda x, encode=encode: seen.append(x.clone()) or encode(x)
        engine = _engine(net, MultiScaleInfoNCELoss(0.1, 3))
        torch.manual_seed(7)
        draw = unmix_draw((16, 16), 1.0, global_prob)
        lam = draw.lam
        expected = lam * batch["crop"] + (1 - lam) * batch["crop"].flip(0)
        if draw.box is not None:  # CutMix: the partner's pixels in the box, the crop's own elsewhere
            inside = torch.zeros(16, 16, dtype=torch.bool)
            inside[draw.box] = True
            expected = torch.where(inside, batch["crop"].flip(0), batch["crop"])
        before = copy.deepcopy(net)  # the weights the step's loss saw (its encode_crops is still the recording one)

        def before_crops(x, before=before):
            return ContrastiveLandmarkNet.encode_crops(before, x)

        torch.manual_seed(7)
        step = ContrastiveIterationUpdate(extra_loss=UnmixLoss(global_prob=global_prob))
        losses.append(float(step(engine, dict(batch))["loss"].detach()))
        # the plain crops, then the mixed ones; the loss is the plain loss plus the mixed crops' weighted loss
        torch.testing.assert_close(seen[-2], batch["crop"])
        torch.testing.assert_close(seen[-1], expected)
        with torch.no_grad():
            args = (before(batch["image"]), batch["query"], batch["crop_query"], (32, 32), (16, 16))
            mixed = seen[-1]
            plain = MultiScaleInfoNCELoss(0.1, 3)(args[0], before_crops(batch["crop"]), *args[1:])
            own = MultiScaleInfoNCELoss(0.1, 3)(args[0], before_crops(mixed), *args[1:])
            flipped = [f.flip(0) for f in args[0]]
            partner = MultiScaleInfoNCELoss(0.1, 3)(
                flipped, before_crops(mixed), batch["query"].flip(0), batch["crop_query"].flip(0), *args[3:]
            )
        assert losses[-1] == pytest.approx(float(plain + lam * own + (1 - lam) * partner), rel=1e-5)
    assert losses[0] == losses[1]


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: feature_mixing("mixup"), "mixing"),
        (lambda: feature_mixing("mochi", mochi_hardest=0.0), "mochi_hardest"),
        (lambda: feature_mixing("mochi", mochi_synthetic=2.0), "mochi_synthetic"),
        (lambda: feature_mixing("mochi", mochi_query_synthetic=-0.1), "mochi_query_synthetic"),
        (lambda: feature_mixing("zhu", zhu_pos_alpha=0.0), "zhu_pos_alpha"),
        (lambda: feature_mixing("zhu", zhu_neg_alpha=-1.0), "zhu_neg_alpha"),
        (lambda: image_mixing("mixup"), "mixing"),
        (lambda: image_mixing("unmix", unmix_alpha=0.0), "unmix_alpha"),
        (lambda: image_mixing("unmix", unmix_global_prob=1.5), "unmix_global_prob"),
    ],
)
def test_bad_settings_name_their_key(make, key):
    with pytest.raises(ValueError, match=key):
        make()


@pytest.mark.parametrize("mixing", ["none", "unmix", "mochi", "zhu"])
def test_the_training_config_turns_each_method_on(mixing):
    parser = bundle_parser(COMPARISON, mixing=mixing, unmix_alpha=0.5, unmix_global_prob=0.25, zhu_neg_alpha=1.2)
    loss, step = parser.get_parsed_content("loss"), parser.get_parsed_content("train#trainer#iteration_update")
    kinds = {"mochi": HardNegativeMixing, "zhu": FeatureTransformation}
    assert type(loss.feature_mixing) is kinds.get(mixing, type(None))
    assert (step.extra_loss is not None) == (mixing == "unmix")
    if mixing == "unmix":
        assert step.extra_loss.alpha == 0.5 and step.extra_loss.global_prob == 0.25
    if mixing == "zhu":
        assert loss.feature_mixing.neg_alpha == 1.2


def test_mixing_none_through_the_experiment_config_is_the_products_training_bit_for_bit():
    """``mixing: none`` through comparison.yaml: the same loss object settings and the same training step as
    configs/train.yaml alone, and the same loss, gradients and updated weights on a fixed batch."""
    product, experiment = bundle_parser(["configs/train.yaml"]), bundle_parser(COMPARISON, mixing="none")
    steps = [p.get_parsed_content("train#trainer#iteration_update") for p in (product, experiment)]
    losses = [p.get_parsed_content("loss") for p in (product, experiment)]
    assert losses[1].feature_mixing is None and steps[1].extra_loss is None
    assert vars(losses[0]) == vars(losses[1])
    batch = _view_pair_batch()
    results = []
    for step, loss_function in zip(steps, losses):
        torch.manual_seed(0)
        net = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
        engine = _engine(net, loss_function)
        loss = step(engine, dict(batch))["loss"]
        results.append((loss, [p.detach().clone() for p in net.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_hard_negative_statistics_against_a_hand_built_key_set():
    # a 5 x 5 window (K = 25, positive at column 12): MoCHi's hard set is ceil(24 / 16) = 2 negatives
    query = F.normalize(torch.ones(1, 1, 4), dim=-1)
    keys = F.normalize(torch.rand(1, 1, 25, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    logits = torch.full((1, 1, 25), 0.1)
    logits[0, 0, 12] = 0.8  # the positive
    logits[0, 0, [7, 13]] = torch.tensor([0.7, 0.9])  # the two hardest touch it; 13 ranks above the positive
    logits[0, 0, 0] = float("-inf")  # a cell outside the map
    target = torch.tensor([[12]])
    distance = cell_distances(logits, target, 5, (8, 8))
    assert distance[0, 0].reshape(5, 5).tolist() == [[max(abs(r - 2), abs(c - 2)) for c in range(5)] for r in range(5)]
    stats = scale_statistics((query, keys, logits, target), torch.tensor([[True]]), 5, (8, 8), HardNegativeMixing())
    assert stats["hard_set_size"] == 2 and stats["hard_adjacent_pct"] == 100.0
    assert stats["adjacent_pct"] == pytest.approx(100 * 8 / 23, abs=0.01)  # 8 of the 23 real negatives
    assert stats["real_above_positive_pct"] == pytest.approx(100 / 23, abs=0.01)
    assert stats["positive_cosine"] == pytest.approx(0.8) and stats["hard_cosine"] == pytest.approx(0.8)
    # global columns: the cells of a 3 x 4 map, positive at (1, 2)
    glob = cell_distances(torch.zeros(1, 1, 12), torch.tensor([[6]]), None, (3, 4))
    assert glob[0, 0].reshape(3, 4).tolist() == [[max(abs(r - 1), abs(c - 2)) for c in range(4)] for r in range(3)]


def test_hard_negative_statistics_run_on_a_checkpoint(tmp_path):
    datalist = generate_synthetic_2d(tmp_path / "data", n_training=4, n_validation=1, n_test=1, seed=1)
    torch.manual_seed(0)
    ckpt = tmp_path / "model.pt"
    torch.save(bundle_parser("configs/train.yaml").get_parsed_content("network_def").state_dict(), ckpt)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        hard_negative_statistics(str(tmp_path / "missing.pt"), datalist=str(datalist))
    out = tmp_path / "hard.json"
    scales = hard_negative_statistics(str(ckpt), datalist=str(datalist), batches=3, batch_size=2, output=str(out))
    assert [s["window"] for s in scales] == [None, 9, 9, 9]  # coarse to fine, the loss's windows
    assert [s["map_size"] for s in scales] == [[12, 12], [24, 24], [48, 48], [96, 96]]
    for s in scales:
        assert s["queries"] == 3 * 2 * 16 and s["hard_set_size"] == (9 if s["window"] is None else 5)
        assert 0 <= s["hard_adjacent_pct"] <= 100 and 0 <= s["synthetic_above_positive_pct"] <= 100
        assert all(-1 <= s[k] <= 1 for k in ("positive_cosine", "hard_cosine", "synthetic_cosine"))
    assert json.loads(out.read_text())["scales"] == scales


def test_cell_distances_stay_on_the_logits_device():
    for window in (5, None):
        logits = torch.zeros(1, 1, 25 if window else 12, device="meta")
        distance = cell_distances(
            logits, torch.zeros(1, 1, dtype=torch.long, device="meta"), window, (5, 5) if window else (3, 4)
        )
        assert distance.device.type == "meta" and distance.shape == logits.shape
