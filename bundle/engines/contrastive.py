"""The contrastive training step: the ``iteration_update`` of MONAI's ``SupervisedTrainer``.

``ContrastiveIterationUpdate`` implements the paper's pixel-wise contrastive learning (two encoders,
multi-scale InfoNCE, Sec. 3.1): the whole image goes through the image encoder, the augmented crop through
the crop encoder, and the loss compares the crop's query features with the image's.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from bundle.engines.cpu_threads import CPUThreadTuner
from bundle.settings import as_flag, check_cpu_threads
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.utils.enums import CommonKeys as Keys

TRAIN_KEYS = ("image", "crop", "query", "crop_query")


class ContrastiveIterationUpdate:
    """One optimisation step on a batch of view pairs (keys ``image``, ``crop``, ``query``, ``crop_query``), paper
    Sec. 3.1.

    Uses the trainer's network (``forward`` = image encoder, ``encode_crops`` = crop encoder), each run through
    the trainer's ``inferer`` (the config's ``train#inferer``), loss function, optimizer, ``amp`` flag and grad
    scaler; fires MONAI's iteration events so that handlers that listen to them keep working.

    Args:
        channels_last: on a CPU, the network's weights and the batch in channels-last memory order (oneDNN's
            preferred layout for convolutions; ``channels_last_3d`` for volumes), not under
            DistributedDataParallel. Results unchanged up to floating-point rounding; no effect on a GPU.
        num_threads: intra-op threads of the step on a CPU (:class:`bundle.engines.cpu_threads.CPUThreadTuner`):
            None leaves torch's setting alone, an int sets it, ``"auto"`` times the step with 1, 2, 4, ... up to
            torch's thread count at construction. The chosen count stays set for the process (the data pipeline
            and validation run with it too).
        trials: timed steps per thread count in a tuning (``"auto"``).
        retune_every: iterations between tunings (``"auto"``).
        extra_loss: an optional term added to the loss inside the forward pass (where a method that mixes the
            crops plugs in, e.g. the comparison methods of ``scripts/experiments/mixing.py``), called as
            ``extra_loss(encode_crops, loss_function, image_features, crop, query, crop_query, image_size,
            crop_size)`` with ``encode_crops`` the crop encoder run through the trainer's inferer; None: the
            paper's step.
    """

    def __init__(
        self,
        channels_last: bool = False,
        num_threads: int | str | None = None,
        trials: int = 1,
        retune_every: int = 200,
        extra_loss: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.channels_last = as_flag(channels_last, "cpu_channels_last")
        self.threads = CPUThreadTuner(check_cpu_threads(num_threads), torch.get_num_threads(), trials, retune_every)
        self.extra_loss = extra_loss

    def __call__(self, engine: SupervisedTrainer, batchdata: dict[str, Any]) -> dict:
        missing = [k for k in TRAIN_KEYS if k not in batchdata]
        if missing:
            raise KeyError(f"training batch lacks {missing}: the view-pair sampler must produce {list(TRAIN_KEYS)}")
        device, nb = engine.state.device, engine.non_blocking
        image, crop, query, crop_query = (torch.as_tensor(batchdata[k]).to(device, non_blocking=nb) for k in TRAIN_KEYS)
        network = engine.network
        on_cpu = torch.device(device).type == "cpu"
        threads = self.threads.threads_for_step() if on_cpu else None
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

        def encode_crops(crops: torch.Tensor) -> Sequence[torch.Tensor]:
            return engine.inferer(crops, network.encode_crops)

        def forward() -> torch.Tensor:
            image_features = engine.inferer(image, network)
            crop_features = encode_crops(crop)
            engine.fire_event(IterationEvents.FORWARD_COMPLETED)
            sizes = (tuple(image.shape[2:]), tuple(crop.shape[2:]))
            loss = engine.loss_function(image_features, crop_features, query, crop_query, *sizes)
            if self.extra_loss is not None:
                loss = loss + self.extra_loss(
                    encode_crops, engine.loss_function, image_features, crop, query, crop_query, *sizes
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
        if on_cpu:
            self.threads.record(threads, time.perf_counter() - start)
        return engine.state.output
