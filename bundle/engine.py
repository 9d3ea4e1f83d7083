"""Ignite/MONAI engine pieces: the contrastive training step and evaluation helpers.

``ContrastiveIterationUpdate`` is the ``iteration_update`` of MONAI's ``SupervisedTrainer`` for the
paper's pixel-wise contrastive learning (two encoders, multi-scale InfoNCE, Sec. 3.1): the whole image
goes through the image encoder, the augmented crop through the crop encoder, and the loss compares the
crop's query features with the image's. The rest glues checkpoints and templates to the evaluator.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Mapping

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.handlers import CheckpointLoader, CheckpointSaver
from monai.utils.enums import CommonKeys as Keys

from bundle.io_utils import atomic_path
from bundle.oneshot import apply_homogeneous

TRAIN_KEYS = ("image", "crop", "query", "crop_query")


class ContrastiveIterationUpdate:
    """One optimisation step on a batch of view pairs (keys ``image``, ``crop``, ``query``, ``crop_query``).

    Uses the trainer's network (``forward`` = image encoder, ``encode_crops`` = crop encoder), loss
    function, optimizer, ``amp`` flag and grad scaler; fires MONAI's iteration events so that handlers
    that listen to them keep working.

    CPU speed (both leave the results unchanged up to floating-point rounding; neither acts on a GPU):

    * ``channels_last``: the network's weights and the batch in channels-last memory order (oneDNN's
      preferred layout for convolutions); 2D only (measured there), not under DistributedDataParallel.
    * ``num_threads``: intra-op threads during the step. None leaves torch's setting alone; an int sets it;
      ``"auto"`` times the step with 1, 2, 4, ... up to torch's thread count at construction on the first
      iterations (``trials`` steps each, the fastest kept) and again every ``retune_every`` iterations: on
      a machine whose cores are shared with other processes, fewer threads than cores can be several
      times faster (OpenMP threads wait for each other at every operation), on an idle one they are not.
      The chosen count stays set for the process (the data pipeline and validation run with it too).
    """

    def __init__(self, channels_last: bool = False, num_threads: int | str | None = None, trials: int = 1, retune_every: int = 200) -> None:
        if not (num_threads is None or num_threads == "auto" or (isinstance(num_threads, int) and num_threads >= 1)):
            raise ValueError(f"num_threads must be None, 'auto' or a positive integer, got {num_threads!r}")
        if trials < 1 or retune_every < 1:
            raise ValueError(f"trials and retune_every must be >= 1, got {trials}, {retune_every}")
        self.channels_last = bool(channels_last)
        self.num_threads, self.trials, self.retune_every = num_threads, int(trials), int(retune_every)
        most = torch.get_num_threads()
        self.candidates = sorted({min(2**k, most) for k in range(most.bit_length() + 1)}) if num_threads == "auto" else []
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
        network = engine.network
        on_cpu = torch.device(device).type == "cpu"
        threads = self._threads_for_this_step() if on_cpu else None
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        if self.channels_last and on_cpu and image.ndim == 4 and not isinstance(network, torch.nn.parallel.DistributedDataParallel):
            network.to(memory_format=torch.channels_last)  # a no-op once converted
            image, crop = image.contiguous(memory_format=torch.channels_last), crop.contiguous(memory_format=torch.channels_last)
        start = time.perf_counter()
        network.train()
        engine.optimizer.zero_grad(set_to_none=engine.optim_set_to_none)

        def forward() -> torch.Tensor:
            image_features = network(image)
            crop_features = network.encode_crops(crop)
            engine.fire_event(IterationEvents.FORWARD_COMPLETED)
            loss = engine.loss_function(
                image_features, crop_features, query, crop_query, tuple(image.shape[2:]), tuple(crop.shape[2:])
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


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and what is wrong with it."""


def read_checkpoint(path: str | Path, device: torch.device | str = "cpu", what: str = "checkpoint") -> dict:
    """The dict a checkpoint file holds, read with ``torch.load(weights_only=True)``.

    A missing file raises ``FileNotFoundError``; an empty (0-byte), truncated or foreign file, or one that
    holds something else than a dict, raises :class:`CheckpointError`; both name the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} (train first, or pass --ckpt_path)")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{what} {path} is empty (0 bytes): a write that was interrupted, or not a checkpoint")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # EOFError, zip-archive RuntimeError, UnpicklingError, ...
        raise CheckpointError(
            f"{what} {path} ({size} bytes) is not a readable PyTorch checkpoint (truncated, or not written by "
            f"torch.save): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{what} {path} holds a {type(state).__name__}, not a dict (a state dict, or a dict with one under 'model')"
        )
    return dict(state)


def read_state_dict(path: str | Path, device: torch.device | str = "cpu", what: str = "checkpoint") -> dict:
    """The state dict (names -> tensors) of a checkpoint file: the file's dict, or the dict under its ``model``.

    A missing, empty, truncated or foreign file (:func:`read_checkpoint`), or one that holds no state dict,
    raises an error that names the file.
    """
    state = read_checkpoint(path, device, what)
    if isinstance(state.get("model"), Mapping):
        state = dict(state["model"])
    foreign = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if foreign:
        raise CheckpointError(
            f"{what} {path} is not a state dict (names -> tensors): entries {[repr(k) for k in foreign[:5]]} "
            f"of its {len(state)} are not named tensors"
        )
    return state


def load_weights(network: torch.nn.Module, path: str | Path, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Load a checkpoint (a state dict, or a dict holding one under ``model``) into ``network`` and return it.

    Checkpoints load with ``torch.load(weights_only=True)`` (:func:`read_state_dict`); a missing, empty,
    truncated or foreign file, a file that is no state dict, and mismatched keys raise errors that name the file.
    """
    path = Path(path)
    state = read_state_dict(path, device)
    try:
        network.load_state_dict(state)
    except RuntimeError as e:
        raise RuntimeError(f"checkpoint {path} does not fit the configured network: {e}") from e
    return network.to(device)


def grid_landmarks(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Landmarks ``(L, D)`` (float32) in grid positions of an item that the evaluation pipeline (ending with
    ``LandmarkTargetsd``) prepared, and its grid-to-physical matrix (float64)."""
    matrix = torch.as_tensor(data["grid_to_physical"], dtype=torch.float64)
    return apply_homogeneous(matrix, data["label"], inverse=True).to(torch.float32), matrix


def prepare_template(item: dict, preprocessing) -> tuple[torch.Tensor, torch.Tensor]:
    """The template's network-grid image ``(1, 1, *S)`` and its landmarks ``(L, D)`` in grid positions.

    ``preprocessing`` is the evaluation pipeline (it must end with ``LandmarkTargetsd``).
    """
    if not item.get("landmarks"):
        raise ValueError(f"the template {item.get('image')} carries no 'landmarks'")
    data = preprocessing(dict(item))
    return torch.as_tensor(data["image"]).unsqueeze(0), grid_landmarks(data)[0]


def labelled_training_items(datalist: dict) -> list[dict]:
    """The datalist's training items that carry at least one landmark (the template candidates)."""
    return [it for it in datalist.get("training", []) if it.get("landmarks") and any(p is not None for p in it["landmarks"])]


def template_items(datalist: dict) -> list[dict]:
    """The datalist's own templates: its ``templates`` list, then its ``template`` item unless listed already."""
    listed = [dict(it) for it in datalist.get("templates") or []]
    single = datalist.get("template")
    if single is not None and all(it["image"] != single["image"] for it in listed):
        listed.append(dict(single))
    return listed


def default_template(datalist: dict) -> dict:
    """The datalist's first labelled training item (the template when the datalist names none)."""
    labelled = labelled_training_items(datalist)
    if not labelled:
        raise ValueError("the datalist has no 'template' or 'templates' and no training item with 'landmarks' to serve as one")
    return dict(labelled[0])


def default_templates(datalist: dict) -> list[dict]:
    """The datalist's templates (:func:`template_items`), else its first labelled training item (validation)."""
    return template_items(datalist) or [default_template(datalist)]


def with_templates(inferer, items: list[dict], preprocessing, device: torch.device | str):
    """Give ``inferer`` (a ``bundle.oneshot.OneShotInferer``) the template ``items`` and return it."""
    prepared = [prepare_template(item, preprocessing) for item in items]
    inferer.set_templates([image.to(device) for image, _ in prepared], [points.to(device) for _, points in prepared])
    return inferer


TEMPLATE_RULES = ("landmarks", "features")


def resolve_template(
    datalist: dict, network: torch.nn.Module, preprocessing, device: torch.device | str, max_images: int = 32,
    rule: str = "landmarks",
) -> dict:
    """The evaluation template: the datalist's ``template``, else one chosen among its labelled training items.

    ``rule``: ``"landmarks"`` picks the item whose landmarks, matched one-shot into each other candidate,
    land closest to that candidate's own landmarks
    (:func:`bundle.template_selection.select_template_by_landmarks`); ``"features"`` reads no landmark and
    picks the candidate whose features match the other training images best
    (:func:`bundle.template_selection.select_template`, Quan et al. CVPR 2022), the choice of which image
    to annotate. At most ``max_images`` training images (the labelled ones first) take part, to bound the cost.
    """
    from bundle.template_selection import select_template, select_template_by_landmarks

    if rule not in TEMPLATE_RULES:
        raise ValueError(f"template rule must be one of {TEMPLATE_RULES}, got {rule!r}")
    labelled = labelled_training_items(datalist)
    if datalist.get("template") is not None:
        return dict(datalist["template"])
    if len(labelled) < 2:
        return default_template(datalist)
    unlabelled = [it for it in datalist["training"] if it not in labelled]
    pool = (labelled if rule == "landmarks" else labelled + unlabelled)[: max(max_images, 2)]
    candidates = [i for i, it in enumerate(pool) if it in labelled]
    prepared = [preprocessing(dict(it)) for it in pool]
    images = [torch.as_tensor(d["image"]).to(device) for d in prepared]
    network.eval()
    with torch.no_grad():
        if rule == "landmarks":
            points, matrices = zip(*(grid_landmarks(d) for d in prepared))
            index, scores = select_template_by_landmarks(network, images, points, matrices)
            how = f"mean one-shot error {scores[index]:.2f} mm over the other {len(pool) - 1} candidates"
        else:
            index, scores = select_template(network, images, candidates=candidates)
            how = f"score {scores[candidates.index(index)]:.3f}, no landmark read"
    logging.getLogger(__name__).info(
        "template chosen among %d labelled training items (rule %r): %s (%s)", len(candidates), rule, pool[index]["image"], how
    )
    return dict(pool[index])


def pseudo_template_pool(datalist: dict, templates: list[dict]) -> list[dict]:
    """Training items that may become pseudo-templates, their landmarks dropped: not a template and not an
    image of the validation or test split (those are never used to label the test images)."""
    held_out = {it["image"] for split in ("validation", "test") for it in datalist.get(split) or []}
    taken = held_out | {it["image"] for it in templates}
    return [{k: v for k, v in it.items() if k != "landmarks"} for it in datalist.get("training", []) if it["image"] not in taken]


def resolve_templates(
    datalist: dict, network: torch.nn.Module, preprocessing, device: torch.device | str, rule: str = "landmarks",
    max_images: int = 32, pseudo_candidates: int = 0, pseudo_templates: int = 0, cycle_tolerance: float = 2.0,
    combine: str = "geometric_median",
) -> list[dict]:
    """The evaluation templates: the datalist's ``templates`` / ``template`` (k-shot), else one chosen by
    :func:`resolve_template`; then, when ``pseudo_templates`` > 0, that many pseudo-templates.

    Pseudo-templates: the first ``pseudo_candidates`` images of :func:`pseudo_template_pool` are labelled by
    matching from the templates (combined by ``combine``) and the ``pseudo_templates`` most reliable ones by
    forward-backward cycle error are added, each without its landmarks whose cycle error exceeds
    ``cycle_tolerance`` grid pixels (:func:`bundle.pseudo_labels.select_pseudo_templates`).
    """
    from bundle.oneshot import OneShotInferer
    from bundle.pseudo_labels import pseudo_label, select_pseudo_templates

    if pseudo_templates < 0 or pseudo_candidates < 0:
        raise ValueError(f"pseudo_candidates and pseudo_templates must be >= 0, got {pseudo_candidates}, {pseudo_templates}")
    templates = template_items(datalist) or [resolve_template(datalist, network, preprocessing, device, max_images, rule)]
    if pseudo_templates == 0:
        return templates
    pool = pseudo_template_pool(datalist, templates)[:pseudo_candidates]
    if len(pool) < pseudo_templates:
        logging.getLogger(__name__).warning(
            "pseudo_templates=%d but only %d training images outside the templates and the validation/test splits "
            "(pseudo_candidates=%d): all of them are labelled and kept", pseudo_templates, len(pool), pseudo_candidates,
        )
    if not pool:
        return templates
    inferer = with_templates(OneShotInferer(template_combine=combine), templates, preprocessing, device)
    labelled = pseudo_label(network, inferer, pool, preprocessing, device)
    return templates + select_pseudo_templates(labelled, min(pseudo_templates, len(pool)), cycle_tolerance)


def save_atomically(checkpoint: Mapping, path: str | Path, save=torch.save) -> None:
    """``save(checkpoint, tmp)`` to a unique hidden temporary beside ``path`` (``.<name>.<pid>.<random>.tmp``,
    never ``*.pt``), then ``os.replace`` onto ``path`` (:func:`bundle.io_utils.atomic_path`): a killed write
    leaves the previous checkpoint whole, and its leftover temporary is removed by the next save."""
    with atomic_path(path, keep_suffix=False) as tmp:
        save(checkpoint, tmp)


class AtomicCheckpointSaver(CheckpointSaver):
    """MONAI's ``CheckpointSaver`` whose files are written atomically (temporary file, then rename).

    MONAI turns ignite's atomic writes off; this writes every checkpoint (final, key metric, interval)
    through :func:`save_atomically`. ``state_dict``/``load_state_dict`` carry the key-metric ranking so
    that a resumed run keeps the best ``model.pt`` of the run before it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for checkpoint in (self._final_checkpoint, self._key_metric_checkpoint, self._interval_checkpoint):
            if checkpoint is not None:
                checkpoint.save_handler._save_func = save_atomically

    def state_dict(self) -> dict:
        return {} if self._key_metric_checkpoint is None else self._key_metric_checkpoint.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self._key_metric_checkpoint is not None and state_dict:
            self._key_metric_checkpoint.load_state_dict(state_dict)


class LastCheckpointSaver:
    """Every ``interval`` epochs, the state of every object of ``save_dict`` in one file, written atomically.

    ``save_dict`` maps names to objects with ``state_dict()`` (network, optimizer, LR scheduler, savers);
    the engine it is attached to is added under ``engine_key`` (the config cannot name the trainer in a
    handler of that trainer); a wrapped (DDP) network is saved unwrapped. Only rank 0 writes. The file
    loads with ``torch.load(weights_only=True)`` and resumes training through MONAI's ``CheckpointLoader``.
    """

    def __init__(self, path: str | Path, save_dict: dict[str, Any], interval: int = 1, engine_key: str | None = "trainer") -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        missing = [k for k, v in save_dict.items() if not hasattr(v, "state_dict")]
        if missing:
            raise TypeError(f"save_dict entries {missing} have no state_dict()")
        self.path = Path(path)
        self.save_dict = dict(save_dict)
        self.interval = interval
        self.engine_key = engine_key

    def attach(self, engine: Engine) -> None:
        """Save every ``interval`` epochs; the engine itself is saved under ``engine_key`` (unless None)."""
        if self.engine_key is not None:
            self.save_dict[self.engine_key] = engine
        engine.add_event_handler(Events.EPOCH_COMPLETED(every=self.interval), self)

    def __call__(self, engine: Engine) -> None:
        if idist.get_rank() != 0:
            return
        state = {}
        for name, obj in self.save_dict.items():
            if isinstance(obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
                obj = obj.module
            state[name] = obj.state_dict()
        save_atomically(state, self.path)


class ResumeCheckpointLoader(CheckpointLoader):
    """MONAI's ``CheckpointLoader`` that also restores the engine it is attached to (under ``engine_key``).

    The trainer's epoch and iteration come back with the network, optimizer and scheduler, so a resumed
    run goes on from the epoch after the last one saved.
    """

    def __init__(self, load_path: str, load_dict: dict[str, Any], engine_key: str = "trainer", **kwargs: Any) -> None:
        super().__init__(load_path=load_path, load_dict=dict(load_dict), **kwargs)
        self.engine_key = engine_key

    def attach(self, engine: Engine) -> None:
        self.load_dict[self.engine_key] = engine
        super().attach(engine)

    def __call__(self, engine: Engine) -> None:
        checkpoint = read_checkpoint(self.load_path, self.map_location or "cpu", "resume checkpoint")
        missing = [k for k in self.load_dict if k not in checkpoint]
        if missing:
            raise CheckpointError(
                f"resume checkpoint {self.load_path} lacks {missing} (it holds {sorted(map(str, checkpoint))}): "
                "resume from the last.pt that training writes, not from a weights file such as model.pt"
            )
        super().__call__(engine)


def resume_handlers(resume: str | None, load_dict: dict[str, Any], device: torch.device | str = "cpu") -> list:
    """``[ResumeCheckpointLoader]`` for the checkpoint ``resume`` (see :func:`resume_path`), or ``[]`` when None."""
    return [] if resume is None else [ResumeCheckpointLoader(load_path=resume, load_dict=load_dict, map_location=device)]


def resume_path(ckpt_dir: str | Path, resume: bool | str, filename: str = "last.pt") -> str | None:
    """The checkpoint to resume from: ``resume`` itself when it is a path, ``ckpt_dir/filename`` when it is true.

    ``resume: true`` with no such file starts afresh (nothing to resume, e.g. the first run); a path that
    does not exist is an error.
    """
    if isinstance(resume, str) and resume.lower() not in ("true", "false", ""):
        if not Path(resume).is_file():
            raise FileNotFoundError(f"resume checkpoint not found: {resume}")
        return resume
    if resume is True or (isinstance(resume, str) and resume.lower() == "true"):
        path = Path(ckpt_dir) / filename
        return str(path) if path.is_file() else None
    return None


class ContrastiveDDP(torch.nn.parallel.DistributedDataParallel):
    """``DistributedDataParallel`` for the two-encoder network: ``forward`` (image encoder) and ``encode_crops``.

    Both encoders take part in every loss, so every parameter gets its gradient in each backward pass
    and DDP averages them across processes as usual.
    """

    def encode_crops(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.module.encode_crops(x)
