"""Dense encoders (light 2D/3D, VGG19) and the two-encoder contrastive model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from bundle.networks.contrastive import ContrastiveLandmarkNet, build_encoder
from bundle.networks.encoders import DenseUNetEncoder
from bundle.networks.vgg import VGG19_CONFIG, VGG19DenseEncoder

SMALL = dict(embed_dim=8, channels=(4, 8, 8, 16, 16))


def check_outputs(
    outputs: list[torch.Tensor], batch: int, size: tuple[int, ...], strides: tuple[int, ...], embed_dim: int
) -> None:
    assert len(outputs) == len(strides)
    for out, stride in zip(outputs, strides):
        assert out.shape == (batch, embed_dim, *(s // stride for s in size))
        torch.testing.assert_close(out.norm(dim=1), torch.ones_like(out[:, 0]))


@pytest.mark.parametrize("spatial_dims, size", [(2, (32, 48)), (3, (16, 32, 16))])
def test_light_encoder_shapes_strides_and_unit_norm(spatial_dims: int, size: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    encoder = DenseUNetEncoder(spatial_dims, **SMALL)
    assert (encoder.strides, encoder.embed_dim, encoder.spatial_dims) == ((16, 8, 4, 2), 8, spatial_dims)
    check_outputs(encoder(torch.randn(2, 1, *size)), 2, size, (16, 8, 4, 2), 8)

    finer = DenseUNetEncoder(spatial_dims, in_channels=2, embed_dim=4, strides=(4, 1), channels=(4, 4, 8))
    check_outputs(finer(torch.randn(1, 2, *(s // 4 for s in size))), 1, tuple(s // 4 for s in size), (4, 1), 4)


def test_bad_sizes_and_strides_raise() -> None:
    encoder = DenseUNetEncoder(2, **SMALL)
    with pytest.raises(ValueError, match=r"[(\[]32, 40[)\]].*40.*16"):
        encoder(torch.randn(1, 1, 32, 40))
    with pytest.raises(ValueError, match="spatial"):
        encoder(torch.randn(1, 1, 32, 32, 32))
    with pytest.raises(ValueError, match="stride 32"):
        DenseUNetEncoder(2, strides=(32, 16), **SMALL)
    with pytest.raises(ValueError, match="coarse to fine"):
        DenseUNetEncoder(2, strides=(2, 4), **SMALL)
    with pytest.raises(ValueError, match="stride 3"):
        DenseUNetEncoder(2, strides=(3,), **SMALL)


def test_encoder_features_depend_on_position() -> None:
    """Dense features must distinguish pixels: a local change moves nearby features more than far ones."""
    torch.manual_seed(0)
    encoder = DenseUNetEncoder(2, **SMALL).eval()
    image = torch.rand(1, 1, 64, 64)
    changed = image.clone()
    changed[0, 0, 4:8, 4:8] += 1.0
    with torch.no_grad():
        fine_a, fine_b = encoder(image)[-1], encoder(changed)[-1]  # stride 2
    diff = (fine_a - fine_b).norm(dim=1)[0]
    assert diff[2:4, 2:4].mean() > 10 * diff[24:, 24:].mean()


def test_model_has_two_encoders_with_separate_weights() -> None:
    torch.manual_seed(0)
    net = ContrastiveLandmarkNet(spatial_dims=2, **SMALL)
    assert net.image_encoder is not net.crop_encoder
    image_params = dict(net.image_encoder.named_parameters())
    crop_params = dict(net.crop_encoder.named_parameters())
    assert image_params.keys() == crop_params.keys()
    assert not {p.data_ptr() for p in image_params.values()} & {p.data_ptr() for p in crop_params.values()}
    assert len(list(net.parameters())) == 2 * len(image_params)

    x = torch.rand(2, 1, 32, 32)
    net.eval()
    with torch.no_grad():
        image_out, crop_out = net(x), net.encode_crops(x)
        reference = net.image_encoder(x)
        assert all(torch.equal(a, b) for a, b in zip(image_out, reference))
        assert not torch.allclose(image_out[-1], crop_out[-1])
        nn.init.zeros_(net.crop_encoder.decoder.heads["1"].conv.weight)
        assert all(torch.equal(a, b) for a, b in zip(net(x), image_out))  # editing one leaves the other alone
    assert (net.strides, net.embed_dim, net.spatial_dims) == ((16, 8, 4, 2), 8, 2)


def test_model_3d_and_backbone_errors(tmp_path: Path) -> None:
    net = ContrastiveLandmarkNet(spatial_dims=3, embed_dim=8, strides=(8, 4), channels=(4, 8, 8, 8))
    check_outputs(net.encode_crops(torch.randn(1, 1, 16, 16, 24)), 1, (16, 16, 24), (8, 4), 8)
    with pytest.raises(ValueError, match="2D only"):
        ContrastiveLandmarkNet(spatial_dims=3, backbone="vgg19")
    with pytest.raises(ValueError, match="'resnet'"):
        build_encoder("resnet")
    with pytest.raises(ValueError, match="only supported by the 'vgg19'"):
        build_encoder("light", pretrained_path=tmp_path / "w.pt")


def fake_vgg19_state_dict(in_channels: int = 3) -> dict[str, torch.Tensor]:
    """Random tensors in torchvision's layout: features.N.weight/bias for each conv, plus a classifier."""
    generator = torch.Generator().manual_seed(3)
    state, index, width = {}, 0, in_channels
    for item in VGG19_CONFIG:
        if item == "M":
            index += 1
            continue
        std = (2.0 / (9 * width)) ** 0.5  # He scale keeps activations finite through 16 layers
        state[f"features.{index}.weight"] = torch.randn(item, width, 3, 3, generator=generator) * std
        state[f"features.{index}.bias"] = torch.randn(item, generator=generator) * 0.01
        index, width = index + 2, item
    state["classifier.0.weight"] = torch.randn(4, 8, generator=generator)
    return state


def test_vgg19_loads_torchvision_layout(tmp_path: Path) -> None:
    state = fake_vgg19_state_dict()
    path = tmp_path / "vgg19.pth"
    torch.save(state, path)
    encoder = VGG19DenseEncoder(pretrained_path=path, embed_dim=8)
    conv_indices = [i for i, m in enumerate(encoder.features) if isinstance(m, nn.Conv2d)]
    assert conv_indices == [0, 2, 5, 7, 10, 12, 14, 16, 19, 21, 23, 25, 28, 30, 32, 34]
    torch.testing.assert_close(encoder.features[0].weight, state["features.0.weight"].sum(1, keepdim=True))
    for i in conv_indices[1:]:
        assert torch.equal(encoder.features[i].weight, state[f"features.{i}.weight"])
        assert torch.equal(encoder.features[i].bias, state[f"features.{i}.bias"])

    # the grey first conv answers a grey image as the RGB one answers its three-channel copy
    grey = torch.rand(1, 1, 8, 8)
    rgb_conv = nn.Conv2d(3, 64, 3, padding=1)
    rgb_conv.load_state_dict({"weight": state["features.0.weight"], "bias": state["features.0.bias"]})
    with torch.no_grad():
        expected = rgb_conv(grey.expand(-1, 3, -1, -1))
        torch.testing.assert_close(encoder.features[0](grey), expected, rtol=1e-4, atol=1e-4)
        outputs = encoder(torch.rand(1, 1, 32, 48))
    check_outputs(outputs, 1, (32, 48), (16, 8, 4, 2), 8)

    net = ContrastiveLandmarkNet(backbone="vgg19", pretrained_path=path, embed_dim=8, strides=(16, 4))
    for encoder in (net.image_encoder, net.crop_encoder):
        assert torch.equal(encoder.features[34].weight, state["features.34.weight"])


def test_vgg19_rejects_broken_weights(tmp_path: Path) -> None:
    state = fake_vgg19_state_dict()
    missing = dict(state)
    del missing["features.21.weight"]
    torch.save(missing, tmp_path / "missing.pth")
    with pytest.raises(KeyError, match=r"missing\.pth.*features\.21\.weight"):
        VGG19DenseEncoder(pretrained_path=tmp_path / "missing.pth")

    wrong = dict(state)
    wrong["features.10.weight"] = torch.randn(256, 64, 3, 3)
    torch.save(wrong, tmp_path / "wrong.pth")
    with pytest.raises(ValueError, match=r"wrong\.pth.*features\.10\.weight.*\(256, 64, 3, 3\)"):
        VGG19DenseEncoder(pretrained_path=tmp_path / "wrong.pth")

    with pytest.raises(FileNotFoundError, match="absent.pth"):
        VGG19DenseEncoder(pretrained_path=tmp_path / "absent.pth")
    with pytest.raises(ValueError, match="2D only"):
        VGG19DenseEncoder(spatial_dims=3)
