"""The contrastive training step: the ``iteration_update`` of MONAI's ``SupervisedTrainer``.

``ContrastiveIterationUpdate`` implements the paper's pixel-wise contrastive learning (two encoders,
multi-scale InfoNCE, Sec. 3.1): the whole image goes through the image encoder, the augmented crop through
the crop encoder, and the loss compares the crop's query features with the image's. ``mixing="unmix"`` is
the paper's Un-mix comparison (:func:`bundle.losses.mixing.unmix_crops`, :func:`bundle.losses.mixing.unmix_loss`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from bundle.losses.mixing import unmix_crops, unmix_draw, unmix_loss
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.utils.enums import CommonKeys as Keys

TRAIN_KEYS = ("image", "crop", "query", "crop_query")


class ContrastiveIterationUpdate:
    """One optimisation step on a batch of view pairs (keys ``image``, ``crop``, ``query``, ``crop_query``).

    Uses the trainer's network (``forward`` = image encoder, ``encode_crops`` = crop encoder), each run through
    the trainer's ``inferer`` (the config's ``train#inferer``), loss function, optimizer, ``amp`` flag and grad
    scaler; fires MONAI's iteration events so that handlers that listen to them keep working.

    CPU speed (both leave the results unchanged up to floating-point rounding; neither acts on a GPU):

    * ``channels_last``: the network's weights and the batch in channels-last memory order (oneDNN's
      preferred layout for convolutions; ``channels_last_3d`` for volumes), not under DistributedDataParallel.
    * ``num_threads``: intra-op threads during the step. None leaves torch's setting alone; an int sets it;
      ``"auto"`` times the step with 1, 2, 4, ... up to torch's thread count at construction on the first
      iterations (``trials`` steps each, the fastest kept) and again every ``retune_every`` iterations: on
      a machine whose cores are shared with other processes, fewer threads than cores can be several
      times faster (OpenMP threads wait for each other at every operation), on an idle one they are not.
      The chosen count stays set for the process (the data pipeline and validation run with it too).

    ``mixing``: ``"none"`` or ``"unmix"`` (Un-mix, Shen et al. AAAI 2022): each step draws a mixture
    (:func:`bundle.losses.mixing.unmix_draw`: global mixup with probability ``unmix_global_prob``, else a CutMix box;
    ``lam ~ Beta(unmix_alpha, unmix_alpha)``) from torch's global RNG, mixes the crops with the batch's reverse
    and adds the mixed crops' loss ``lam L_own + (1 - lam) L_partner`` to the plain crops' loss (Un-mix keeps
    both branches). The feature-space methods are the loss's ``mixing``.
    """

    def __init__(
        self,
        channels_last: bool = False,
        num_threads: int | str | None = None,
        trials: int = 1,
        retune_every: int = 200,
        mixing: str = "none",
        unmix_alpha: float = 1.0,
        unmix_global_prob: float = 0.5,
    ) -> None:
        if not (num_threads is None or num_threads == "auto" or (isinstance(num_threads, int) and num_threads >= 1)):
            raise ValueError(f"num_threads must be None, 'auto' or a positive integer, got {num_threads!r}")
        if trials < 1 or retune_every < 1:
            raise ValueError(f"trials and retune_every must be >= 1, got {trials}, {retune_every}")
        if mixing not in ("none", "unmix"):
            raise ValueError(f"mixing must be 'none' or 'unmix' (mochi / zhu are the loss's), got {mixing!r}")
        if not unmix_alpha > 0:
            raise ValueError(f"unmix_alpha must be positive, got {unmix_alpha}")
        if not 0.0 <= unmix_global_prob <= 1.0:
            raise ValueError(f"unmix_global_prob must be a probability in [0, 1], got {unmix_global_prob}")
        self.mixing, self.unmix_alpha, self.unmix_global_prob = mixing, float(unmix_alpha), float(unmix_global_prob)
        self.channels_last = bool(channels_last)
        self.num_threads, self.trials, self.retune_every = num_threads, int(trials), int(retune_every)
        most = torch.get_num_threads()
        auto = num_threads == "auto"
        self.candidates = sorted({min(2**k, most) for k in range(most.bit_length() + 1)}) if auto else []
        self.threads_chosen: int | None = num_threads if isinstance(num_threads, int) else None
        self.timings: dict[int, float] = {}  # seconds per thread count in the current (or last) tuning
        self._calls = 0
        self._trial = False

    def _threads_for_this_step(self) -> int | None:
        """The thread count of this call: a fixed one, the warm-up (first call, untimed, torch's count), a
        trial of the tuning phase, or the one chosen; sets ``self._trial``."""
        self._trial = False
        if self.num_threads != "auto":
            return self.threads_chosen
        if self._calls == 0:
            return self.candidates[-1]
        phase = (self._calls - 1) % self.retune_every
        n_trials = len(self.candidates) * self.trials
        if phase < n_trials:
            if phase == 0:
                self.timings = {}
            self._trial = True
            return self.candidates[phase // self.trials]
        if phase == n_trials or self.threads_chosen is None:
            self.threads_chosen = min(self.timings, key=self.timings.get)
        return self.threads_chosen

    def __call__(self, engine: SupervisedTrainer, batchdata: dict[str, Any]) -> dict:
        missing = [k for k in TRAIN_KEYS if k not in batchdata]
        if missing:
            raise KeyError(f"training batch lacks {missing}: the view-pair sampler must produce {list(TRAIN_KEYS)}")
        device, nb = engine.state.device, engine.non_blocking
        image, crop, query, crop_query = (torch.as_tensor(batchdata[k]).to(device, non_blocking=nb) for k in TRAIN_KEYS)
        unmix = unmix_draw(crop.shape[2:], self.unmix_alpha, self.unmix_global_prob) if self.mixing == "unmix" else None
        network = engine.network
        on_cpu = torch.device(device).type == "cpu"
        threads = self._threads_for_this_step() if on_cpu else None
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        ddp = isinstance(network, torch.nn.parallel.DistributedDataParallel)
        if self.channels_last and on_cpu and not ddp:
            layout = torch.channels_last if image.ndim == 4 else torch.channels_last_3d
            network.to(memory_format=layout)  # a no-op once converted
            image = image.contiguous(memory_format=layout)
            crop = crop.contiguous(memory_format=layout)
        start = time.perf_counter()
        network.train()
        engine.optimizer.zero_grad(set_to_none=engine.optim_set_to_none)

        def forward() -> torch.Tensor:
            image_features = engine.inferer(image, network)
            crop_features = engine.inferer(crop, network.encode_crops)
            engine.fire_event(IterationEvents.FORWARD_COMPLETED)
            sizes = (tuple(image.shape[2:]), tuple(crop.shape[2:]))
            loss = engine.loss_function(image_features, crop_features, query, crop_query, *sizes)
            if unmix is not None:  # Un-mix: the mixed crops' loss beside the plain one
                mixed_features = engine.inferer(unmix_crops(crop, unmix.lam, unmix.box), network.encode_crops)
                loss = loss + unmix_loss(
                    engine.loss_function, image_features, mixed_features, query, crop_query, *sizes, unmix.lam
                )
            if not torch.isfinite(loss):  # the step's one host sync: never step (or save) on a non-finite loss
                raise FloatingPointError(
                    f"non-finite training loss ({loss.item()}) at iteration {engine.state.iteration}"
                    f"{' under amp (try --amp false)' if engine.amp else ''}; lower learning_rate or check the data"
                )
            engine.state.output = {Keys.IMAGE: image, Keys.LOSS: loss}
            engine.fire_event(IterationEvents.LOSS_COMPLETED)
            return loss

        if engine.amp and engine.scaler is not None:
            with torch.autocast(device.type if isinstance(device, torch.device) else "cuda", **engine.amp_kwargs):
                loss = forward()
            engine.scaler.scale(loss).backward()
            engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
            engine.scaler.step(engine.optimizer)
            engine.scaler.update()
        else:
            loss = forward()
            loss.backward()
            engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
            engine.optimizer.step()
        engine.state.output[Keys.LOSS] = loss.detach()
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        if self.num_threads == "auto" and on_cpu:
            if self._trial:
                self.timings[threads] = min(time.perf_counter() - start, self.timings.get(threads, float("inf")))
            self._calls += 1
        return engine.state.output
