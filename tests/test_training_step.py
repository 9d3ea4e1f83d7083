"""The training step's CPU options (bundle.engines.contrastive.ContrastiveIterationUpdate: channels_last,
num_threads, tuned by bundle.engines.cpu_threads.CPUThreadTuner)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from bundle.engines.contrastive import ContrastiveIterationUpdate
from bundle.losses.infonce import MultiScaleInfoNCELoss
from bundle.networks.contrastive import ContrastiveLandmarkNet
from monai.inferers import SimpleInferer


def _engine(network: torch.nn.Module, loss_function) -> SimpleNamespace:
    return SimpleNamespace(
        state=SimpleNamespace(device=torch.device("cpu"), output=None),
        non_blocking=False,
        network=network,
        optimizer=torch.optim.Adam(network.parameters(), lr=1e-3),
        loss_function=loss_function,
        optim_set_to_none=True,
        inferer=SimpleInferer(),
        amp=False,
        scaler=None,
        fire_event=lambda event: None,
    )


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "image": torch.rand(2, 1, 32, 32, generator=g),
        "crop": torch.rand(2, 1, 16, 16, generator=g),
        "query": 4 + 24 * torch.rand(2, 4, 2, generator=g),
        "crop_query": 4 + 8 * torch.rand(2, 4, 2, generator=g),
    }


def test_channels_last_and_thread_tuning_give_the_same_losses_and_try_each_count():
    threads_outside = torch.get_num_threads()
    torch.set_num_threads(3)  # candidates 1, 2, 3 whatever the machine
    threads_before = 3
    torch.manual_seed(0)
    net = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
    used = []

    def loss_function(*args):
        used.append(torch.get_num_threads())
        return MultiScaleInfoNCELoss(0.1, 3)(*args)

    try:
        old, new = _engine(copy.deepcopy(net), loss_function), _engine(copy.deepcopy(net), loss_function)
        fast = ContrastiveIterationUpdate(channels_last=True, num_threads="auto", retune_every=4)
        assert fast.threads.candidates == [1, 2, 3]
        n = len(fast.threads.candidates)
        losses_old, losses_new, per_call, chosen_from = [], [], [], None
        for k in range(6):
            torch.set_num_threads(threads_before)
            losses_old.append(float(ContrastiveIterationUpdate()(old, _batch(k))["loss"]))
            used.clear()
            losses_new.append(float(fast(new, _batch(k))["loss"]))
            per_call.append(used[0])
            if k == 1 + n:  # the call that picks the fastest; call 1 + retune_every starts a new tuning
                chosen_from = dict(fast.threads.timings)
        torch.testing.assert_close(torch.tensor(losses_new), torch.tensor(losses_old), rtol=1e-4, atol=0)
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in new.network.parameters() if w.ndim == 4)
        # call 0: warm-up with torch's count; then one trial per count; then the fastest; retuned after retune_every
        assert per_call[0] == threads_before and per_call[1 : 1 + n] == fast.threads.candidates
        assert sorted(chosen_from) == fast.threads.candidates
        chosen = fast.threads.threads_chosen
        assert chosen == min(chosen_from, key=chosen_from.get) and per_call[1 + n] == chosen
        assert per_call[5] == fast.threads.candidates[0]  # call 5 = 1 + retune_every: the tuning starts again
    finally:
        torch.set_num_threads(threads_outside)


def test_channels_last_in_3d_gives_the_same_losses():
    """Volumes take the 3D channels-last order (channels_last_3d): the same losses as the contiguous step."""
    torch.manual_seed(0)
    net = ContrastiveLandmarkNet(spatial_dims=3, channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
    old, new = _engine(copy.deepcopy(net), MultiScaleInfoNCELoss(0.1, 3)), _engine(net, MultiScaleInfoNCELoss(0.1, 3))
    fast = ContrastiveIterationUpdate(channels_last=True)
    losses_old, losses_new = [], []
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        batch = {
            "image": torch.rand(2, 1, 16, 16, 16, generator=g),
            "crop": torch.rand(2, 1, 8, 8, 8, generator=g),
            "query": 2 + 12 * torch.rand(2, 4, 3, generator=g),
            "crop_query": 2 + 4 * torch.rand(2, 4, 3, generator=g),
        }
        losses_old.append(float(ContrastiveIterationUpdate()(old, batch)["loss"]))
        losses_new.append(float(fast(new, batch)["loss"]))
    torch.testing.assert_close(torch.tensor(losses_new), torch.tensor(losses_old), rtol=1e-4, atol=0)
    weights = [w for w in new.network.parameters() if w.ndim == 5]  # a one-channel input's kernels pass either way
    assert all(w.is_contiguous(memory_format=torch.channels_last_3d) for w in weights)
    assert not all(w.is_contiguous() for w in weights)


def test_fixed_threads_and_bad_settings():
    threads_before = torch.get_num_threads()
    try:
        net = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
        ContrastiveIterationUpdate(num_threads=1)(_engine(net, MultiScaleInfoNCELoss(0.1, 3)), _batch(0))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads_before)
    for bad in ("many", 0, 1.5):
        with pytest.raises(ValueError, match="cpu_threads must be null, 'auto' or a positive integer"):
            ContrastiveIterationUpdate(num_threads=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_the_step_before_the_weights_change(bad):
    net = ContrastiveLandmarkNet(channels=(4, 8, 8), strides=(4, 2), embed_dim=8)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}

    def loss_function(*args):
        return MultiScaleInfoNCELoss(0.1, 3)(*args) * bad

    engine = _engine(net, loss_function)
    engine.state.iteration = 14
    with pytest.raises(FloatingPointError, match="non-finite training loss .* at iteration 14"):
        ContrastiveIterationUpdate()(engine, _batch(0))
    for name, p in net.named_parameters():  # no optimiser step (BatchNorm's running statistics may move)
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
