"""One-shot template matching (bundle/inferers/oneshot.py, bundle/networks/matching.py) with a stand-in network."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from bundle.geometry import apply_homogeneous
from bundle.inferers.oneshot import OneShotInferer
from bundle.networks.matching import refine_peaks


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of a ``(B, C, *spatial)`` tensor (replicate border)."""
    dims = x.ndim - 2
    radius = max(1, int(3 * sigma))
    t = torch.arange(-radius, radius + 1, dtype=x.dtype)
    kernel = torch.exp(-(t**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    conv = F.conv2d if dims == 2 else F.conv3d
    channels = x.shape[1]
    for axis in range(dims):
        shape = [channels, 1] + [1] * dims
        shape[2 + axis] = kernel.numel()
        pad = [0, 0] * dims
        pad[2 * (dims - 1 - axis)] = pad[2 * (dims - 1 - axis) + 1] = radius
        x = conv(F.pad(x, pad, mode="replicate"), kernel.repeat(channels).reshape(shape), groups=channels)
    return x


class PatchDescriptorNet(torch.nn.Module):
    """Stand-in dense encoder with the real network's interface (list of unit feature maps, coarse to fine).

    At stride s the feature is the zero-mean, unit-norm vector of the image (blurred by s/2) read on a
    k^D lattice of spacing s around the pixel (a normalised cross-correlation descriptor), averaged
    over each s^D cell: content-driven and nearly shift-equivariant, so matching is well defined.
    """

    def __init__(self, strides: tuple[int, ...] = (16, 8, 4, 2), k: int = 5, spatial_dims: int = 2) -> None:
        super().__init__()
        self.strides = strides
        self.k = k
        self.spatial_dims = spatial_dims
        self.register_buffer("eye", torch.eye(k**spatial_dims).reshape(k**spatial_dims, 1, *([k] * spatial_dims)))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        pool = F.avg_pool2d if self.spatial_dims == 2 else F.avg_pool3d
        conv = F.conv2d if self.spatial_dims == 2 else F.conv3d
        out = []
        for s in self.strides:
            field = conv(gaussian_blur(x, s / 2), self.eye, padding=(self.k // 2) * s, dilation=s)
            field = field - field.mean(1, keepdim=True)
            out.append(F.normalize(pool(field, s), dim=1))
        return out


def smooth_random_image(size: tuple[int, ...], seed: int, sigma: float = 3.0) -> torch.Tensor:
    """``(1, 1, *size)`` smooth random texture with unit standard deviation."""
    g = torch.Generator().manual_seed(seed)
    x = gaussian_blur(torch.randn(1, 1, *size, generator=g), sigma)
    return x / x.std()


def crop(big: torch.Tensor, start: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    return big[(Ellipsis, *[slice(s, s + n) for s, n in zip(start, size)])]


POINTS_2D = torch.tensor([[40.0, 50.0], [70.3, 80.6], [90.0, 40.0], [64.0, 64.0], [50.0, 88.5]])


@pytest.fixture(scope="module")
def scene():
    torch.manual_seed(0)
    big = smooth_random_image((160, 160), seed=1)
    return big, crop(big, (16, 16), (128, 128)), PatchDescriptorNet().eval()


def test_apply_homogeneous_forward_inverse_and_nan():
    m = torch.tensor(
        [[[0.1, 0.0, 5.0], [0.0, 0.2, -3.0], [0.0, 0.0, 1.0]], [[2.0, 0.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 1.0]]]
    )
    pts = torch.tensor([[[3.0, 4.0], [float("nan"), 1.0]], [[1.0, 1.0], [0.0, 0.0]]])
    out = apply_homogeneous(m, pts)
    assert out.dtype == torch.float64
    assert torch.allclose(out[0, 0], torch.tensor([5.3, -2.2], dtype=torch.float64))
    assert torch.isnan(out[0, 1]).all()
    assert torch.allclose(out[1], torch.tensor([[2.0, 3.0], [0.0, 1.0]], dtype=torch.float64))
    back = apply_homogeneous(m, out, inverse=True)
    finite = ~torch.isnan(pts).any(-1)
    assert torch.allclose(back[finite], pts.double()[finite])
    with pytest.raises(ValueError, match="homogeneous matrix"):
        apply_homogeneous(torch.eye(4), pts)


def test_refine_peaks_is_subpixel_on_a_smooth_peak():
    centre = (12.3, 20.7)
    ii, jj = torch.meshgrid(torch.arange(32.0), torch.arange(40.0), indexing="ij")
    peak = torch.exp(-((ii - centre[0]) ** 2 + (jj - centre[1]) ** 2) / (2 * 4.0**2))[None, None]
    pos, value = refine_peaks(peak, step=1)
    assert torch.allclose(pos[0, 0], torch.tensor(centre, dtype=torch.float64), atol=0.05)
    integer, _ = refine_peaks(peak, step=0)
    assert integer[0, 0].tolist() == [12.0, 21.0]
    assert value[0, 0] == peak.max()


def test_identical_image_recovers_template_points_subpixel(scene):
    _, template, net = scene
    inferer = OneShotInferer()
    inferer.set_template(template, POINTS_2D)
    pred = inferer(template, net)
    assert pred.shape == (1, 5, 2)
    assert torch.allclose(pred[0], POINTS_2D.double(), atol=0.02)
    coarse = OneShotInferer(refine_radius=0)
    coarse.set_template(template, POINTS_2D)
    on_grid = coarse(template, net)[0]
    assert torch.equal(on_grid, on_grid.round())  # without refinement the answer is stuck on the grid
    assert (on_grid - POINTS_2D).abs().max() > 0.25


@pytest.mark.parametrize("combine", ["product", "sum"])
def test_shifted_image_gives_template_points_plus_shift(scene, combine):
    big, template, net = scene
    inferer = OneShotInferer(combine=combine)
    inferer.set_template(template, POINTS_2D)
    shifts = torch.tensor([[3, -2], [1, 1], [-5, 4], [7, 0], [-3, -7]])
    batch = torch.cat([crop(big, (16 - int(sx), 16 - int(sy)), (128, 128)) for sx, sy in shifts])
    pred = inferer(batch, net)
    expected = POINTS_2D[None].double() + shifts[:, None].double()
    assert (pred - expected).norm(dim=-1).max() < 0.5


def test_missing_template_landmark_is_predicted_nan(scene):
    _, template, net = scene
    points = POINTS_2D.clone()
    points[2] = float("nan")
    inferer = OneShotInferer()
    inferer.set_template(template, points)
    pred = inferer(template, net)[0]
    assert torch.isnan(pred[2]).all()
    keep = [0, 1, 3, 4]
    assert torch.allclose(pred[keep], POINTS_2D[keep].double(), atol=0.02)


def test_grid_to_physical_and_chunking(scene):
    big, template, net = scene
    inferer = OneShotInferer()
    inferer.set_template(template, POINTS_2D)
    batch = torch.cat([template, crop(big, (13, 18), (128, 128))])
    grid_pred = inferer(batch, net)
    matrices = torch.tensor(
        [[[0.1, 0.0, 2.0], [0.0, 0.2, 1.0], [0.0, 0.0, 1.0]], [[0.5, 0.0, 0.0], [0.0, 0.25, 0.0], [0.0, 0.0, 1.0]]]
    )
    physical = inferer(batch, net, grid_to_physical=matrices)
    expected = grid_pred * torch.tensor([[[0.1, 0.2]], [[0.5, 0.25]]], dtype=torch.float64) + torch.tensor(
        [[[2.0, 1.0]], [[0.0, 0.0]]], dtype=torch.float64
    )
    assert torch.allclose(physical, expected)
    chunked = OneShotInferer(max_map_elements=2 * 2 * 128 * 128)  # two landmarks (channels) per chunk
    chunked.set_template(template, POINTS_2D)
    assert torch.allclose(chunked(batch, net), grid_pred, atol=1e-5)


def test_three_dimensional_shift():
    big = smooth_random_image((48, 48, 48), seed=2, sigma=2.0)
    template = crop(big, (8, 8, 8), (32, 32, 32))
    net = PatchDescriptorNet(strides=(4, 2), k=3, spatial_dims=3).eval()
    points = torch.tensor([[14.0, 16.0, 15.0], [17.5, 13.2, 18.0]])
    inferer = OneShotInferer(refine_resolution=0.25)
    inferer.set_template(template, points)
    shift = torch.tensor([2.0, -1.0, 3.0])
    moved = crop(big, (6, 9, 5), (32, 32, 32))
    pred = inferer(moved, net)[0]
    assert (pred - (points.double() + shift.double())).norm(dim=-1).max() < 0.5


def test_scale_weights_and_errors(scene):
    _, template, net = scene
    with pytest.raises(ValueError, match="combine"):
        OneShotInferer(combine="max")
    with pytest.raises(RuntimeError, match="set_template"):
        OneShotInferer()(template, net)
    inferer = OneShotInferer(scale_weights=(1.0, 1.0))
    inferer.set_template(template, POINTS_2D)
    with pytest.raises(ValueError, match="scale_weights"):
        inferer(template, net)
    with pytest.raises(ValueError, match="input grid"):
        inferer(template[..., :64, :64], net)
    with pytest.raises(ValueError, match="points must be"):
        OneShotInferer().set_template(template, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="differ from template 0"):
        OneShotInferer().set_templates([template, template], [POINTS_2D, POINTS_2D[:3]])
    with pytest.raises(ValueError, match="template_combine"):
        OneShotInferer(template_combine="vote")
    finest_only = OneShotInferer(scale_weights=(0.0, 0.0, 0.0, 1.0))
    finest_only.set_template(template, POINTS_2D)
    assert torch.allclose(finest_only(template, net)[0], POINTS_2D.double(), atol=0.02)


def test_k_shot_outvotes_a_template_that_fails_and_fills_its_missing_landmark(scene):
    big, template, net = scene
    wrong = POINTS_2D.clone()
    wrong[1] = torch.tensor([20.0, 110.0])  # one template annotated landmark 1 on another structure
    wrong[3] = float("nan")  # and lacks landmark 3
    other = crop(big, (20, 12), (128, 128))  # a second correct template: the scene shifted by (-4, 4)
    image = crop(big, (13, 18), (128, 128))  # the input: shifted by (3, -2)
    truth = (POINTS_2D + torch.tensor([3.0, -2.0])).double()
    alone = OneShotInferer()
    alone.set_template(template, wrong)
    single = alone(image, net)[0]
    assert (single[1] - truth[1]).norm() > 40 and torch.isnan(single[3]).all()
    for rule in ("geometric_median", "median"):
        inferer = OneShotInferer(template_combine=rule)
        inferer.set_templates([template, other, template], [POINTS_2D, POINTS_2D + torch.tensor([-4.0, 4.0]), wrong])
        pred = inferer(image, net)[0]
        assert (pred - truth).norm(dim=-1).max() < 0.5, rule
    mean = OneShotInferer(template_combine="mean")
    mean.set_templates([template, other, template], [POINTS_2D, POINTS_2D + torch.tensor([-4.0, 4.0]), wrong])
    assert (mean(image, net)[0][1] - truth[1]).norm() > 10  # the non-robust mean is pulled away


def test_cycle_error_is_small_for_true_matches_and_large_on_an_unrelated_image(scene):
    big, template, net = scene
    points = POINTS_2D.clone()
    points[4] = float("nan")
    inferer = OneShotInferer()
    inferer.set_template(template, points)
    batch = torch.cat([crop(big, (13, 18), (128, 128)), smooth_random_image((128, 128), seed=7)])
    per_template, cycle = inferer.predict_per_template(batch, net, cycle=True)
    assert per_template.shape == (1, 2, 5, 2) and cycle.shape == (1, 2, 5)
    assert torch.isnan(cycle[0, :, 4]).all()
    assert cycle[0, 0, :4].max() < 1.0
    assert cycle[0, 1, :4].mean() > 5.0


class TwoScaleEncoder(torch.nn.Module):
    """A small trainable encoder with the network's interface (feature maps at strides 4 and 2), counting its
    forward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.strides = (4, 2)
        self.passes = 0

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.passes += 1
        y = torch.tanh(self.conv(x))
        return [F.avg_pool2d(y, 4), F.avg_pool2d(y, 2)]


def test_template_features_are_computed_once_until_the_weights_change():
    """The templates' feature maps are kept between calls and computed again after an in-place weight update (what
    an optimizer step or a loaded checkpoint does); the predictions are those of a fresh inferer either way."""
    torch.manual_seed(0)
    network = TwoScaleEncoder().eval()
    image, template = smooth_random_image((48, 48), seed=1), smooth_random_image((48, 48), seed=2)
    points = torch.tensor([[10.0, 12.0], [30.0, 20.0]])
    inferer = OneShotInferer()
    inferer.set_template(template, points)
    first = inferer(image, network)
    assert network.passes == 2  # the input and the template
    inferer(image, network)
    assert network.passes == 3  # the input alone
    with torch.no_grad():
        network.conv.weight.mul_(-0.5)  # new weights, in place
    changed = inferer(image, network)
    assert network.passes == 5  # the template's features follow the weights
    fresh = OneShotInferer()
    fresh.set_template(template, points)
    torch.testing.assert_close(changed, fresh(image, network))
    assert not torch.equal(changed, first)


def tissues(image: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    """A head-like phantom of ``image`` ``(1, 1, H, W)``: a disc cut at its texture's quartiles into four regions,
    each given its grey value in ``levels``, on a background of 0."""
    edges = torch.quantile(image.flatten(), torch.tensor([0.25, 0.5, 0.75]))
    ii, jj = torch.meshgrid(*[torch.arange(n, dtype=torch.float32) for n in image.shape[2:]], indexing="ij")
    disc = (ii - image.shape[2] / 2) ** 2 + (jj - image.shape[3] / 2) ** 2 < (0.3 * min(image.shape[2:])) ** 2
    return torch.where(disc, torch.tensor(levels)[torch.bucketize(image, edges)], 0.0)


def test_contrast_adaptation_finds_the_landmarks_in_another_contrast(scene):
    """A template of one contrast (four regions, grey values rising) and inputs of another (the same regions in a
    non-monotone order, as T1w / T2w): the inputs are mapped to the template's contrast and matched as if they had
    it; an input of the template's own contrast maps to itself."""
    from bundle.inferers.contrast import register_templates, template_contrast

    big, _, net = scene
    first, second = (0.1, 0.4, 0.7, 1.0), (0.8, 0.1, 1.0, 0.4)
    template = crop(tissues(big, first), (16, 16), (128, 128))
    shifts = torch.tensor([[3, -2], [-5, 4]])
    same, other = (
        torch.cat([crop(tissues(big, levels), (16 - int(sx), 16 - int(sy)), (128, 128)) for sx, sy in shifts])
        for levels in (first, second)
    )
    expected = POINTS_2D[None].double() + shifts[:, None].double()
    plain, adapted = OneShotInferer(), OneShotInferer(contrast_adaptation=True)
    for inferer in (plain, adapted):
        inferer.set_template(template, POINTS_2D)
    assert (plain(other, net) - expected).norm(dim=-1).max() > 5.0  # matching across contrasts fails
    assert (plain(same, net) - expected).norm(dim=-1).max() < 1.5  # flat regions: less precise than texture
    torch.testing.assert_close(template_contrast(other, register_templates(other, template)), same, atol=0.02, rtol=0)
    torch.testing.assert_close(adapted(other, net), plain(same, net), atol=0.05, rtol=0)
    mapped_same = template_contrast(same, register_templates(same, template))  # the same contrast maps to itself
    torch.testing.assert_close(mapped_same, same, atol=0.02, rtol=0)
    torch.testing.assert_close(adapted(same, net), plain(same, net), atol=0.05, rtol=0)


def test_contrast_adaptation_registers_a_turned_and_scaled_input(scene):
    """An input of the other contrast, turned by 0.1 rad, scaled by 1.1 and shifted: the template registered to it
    by mutual information lies on it, so the input's grey values map back to the template's contrast and the
    landmarks are found as in the input of the template's own contrast. The registration's map carries the
    template's landmarks there too, and ``registration_tolerance`` puts the plain matches that went astray on the
    other contrast back onto them."""
    import SimpleITK as sitk  # noqa: N813
    from bundle.inferers.contrast import carried_points, register_template, register_templates, template_contrast
    from monai.transforms import Affine

    big, _, net = scene
    first, second = (0.1, 0.4, 0.7, 1.0), (0.8, 0.1, 1.0, 0.4)
    template = crop(tissues(big, first), (16, 16), (128, 128))
    turn = Affine(rotate_params=0.1, scale_params=(1.1, 1.1), translate_params=(3, -4), mode="nearest", image_only=True)
    same, other = (
        turn(crop(tissues(big, levels), (16, 16), (128, 128))[0])[None].as_tensor() for levels in (first, second)
    )
    assert (template - same).abs().mean() > 0.1  # the template does not lie on the input as it is
    threads = sitk.ProcessObject.GetGlobalDefaultNumberOfThreads()
    registration = register_template(template[0, 0], same[0, 0])
    assert (registration.aligned - same[0, 0]).abs().mean() < 0.05
    again = register_template(template[0, 0], same[0, 0])  # the same map every call, to the last bit (one thread)
    assert torch.equal(again.aligned, registration.aligned) and torch.equal(again.to_template, registration.to_template)
    assert sitk.ProcessObject.GetGlobalDefaultNumberOfThreads() == threads  # SimpleITK's default given back
    assert (template_contrast(other, register_templates(other, template)) - same).abs().mean() < 0.03
    plain, adapted, guarded = (
        OneShotInferer(),
        OneShotInferer(contrast_adaptation=True),
        OneShotInferer(registration_tolerance=2.0),
    )
    for inferer in (plain, adapted, guarded):
        inferer.set_template(template, POINTS_2D)
    found = plain(same, net)
    torch.testing.assert_close(adapted(other, net), found, atol=1.0, rtol=0)
    carried = carried_points([registration], POINTS_2D)
    assert (carried - found).norm(dim=-1).max() < 1.0
    astray = (plain(other, net) - found).norm(dim=-1) > 2.0
    assert astray.sum() >= 3  # across contrasts the plain matches go astray ...
    assert (guarded(other, net) - found).norm(dim=-1).max() < 1.0  # ... and fall back to the registration's
    alone = OneShotInferer(registration_tolerance=0.0)  # the registration's landmarks alone
    alone.set_template(template, POINTS_2D)
    torch.testing.assert_close(alone(other, net), carried_points(register_templates(other, template), POINTS_2D))
    with pytest.raises(ValueError, match="registration_tolerance must be >= 0"):
        OneShotInferer(registration_tolerance=-1.0)


def test_registration_failure_falls_back_to_the_centroid_shift(scene, monkeypatch, caplog):
    """When SimpleITK's optimiser raises, the template is only shifted by the foregrounds' centroids, with a
    warning that says so (a shifted input is still met)."""
    import SimpleITK as sitk  # noqa: N813
    from bundle.inferers.contrast import register_template

    def fail(self, fixed, moving):
        raise RuntimeError("too few samples")

    monkeypatch.setattr(sitk.ImageRegistrationMethod, "Execute", fail)
    template = crop(tissues(scene[0], (0.1, 0.4, 0.7, 1.0)), (16, 16), (128, 128))[0, 0]
    shifted = torch.roll(template, shifts=(3, -4), dims=(0, 1))
    with caplog.at_level("WARNING", logger="bundle.inferers.contrast"):
        aligned = register_template(template, shifted).aligned
    assert "registration failed, the template is shifted by the centroids: too few samples" in caplog.text
    torch.testing.assert_close(aligned, shifted, atol=1e-4, rtol=0)
