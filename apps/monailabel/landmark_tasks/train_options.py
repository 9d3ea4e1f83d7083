"""The train task's request values, checked before the task is queued, and the saved labels each network needs."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from bundle.configs import config_files
from bundle.data.datalist import is_finite_number
from bundle.settings import check_crop_size, check_image_size


def _number(value: Any, kind: str, integer: bool = False, low: float = -math.inf, low_open: bool = False) -> float:
    """``value`` when it is a finite JSON number (an integer when ``integer``) at least ``low`` (above it when
    ``low_open``), else ValueError saying it must be ``kind``: booleans, strings, NaN and infinities are refused."""
    if not is_finite_number(value):
        raise ValueError(kind)
    if (integer and value != int(value)) or value < low or (low_open and value == low):
        raise ValueError(kind)
    return value


def _positive_int(value: Any) -> int:
    return int(_number(value, "a positive integer", integer=True, low=1))


def _seed(value: Any) -> int:
    seed = int(_number(value, "an integer from 0 to 2**32 - 1", integer=True, low=0))
    if seed >= 2**32:
        raise ValueError("an integer from 0 to 2**32 - 1")
    return seed


def _positive_float(value: Any) -> float:
    return float(_number(value, "a positive number", low=0, low_open=True))


def _margin(value: Any) -> float:
    return float(_number(value, "a non-negative number of mm (how much better the new model must score)", low=0))


def _size(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("a list of positive integers, one per spatial axis")
    try:
        return [_positive_int(v) for v in value]
    except ValueError:
        raise ValueError("a list of positive integers, one per spatial axis") from None


NETWORKS = ("contrastive", "detector")
PUBLISH = ("if_better", "always")
DETECTOR_HOLDOUT = 0.25  # default fraction of the labelled images held out of the detector's training, to score on
# default number of held-out images below which a new detector is not published: the 5-label step of the annotation
# loop published a detector that won on its one held-out image and lost on 30 others (docs/results.md)
DETECTOR_MIN_HELD_OUT = 3
MIN_DETECTOR_LABELS = 2


def _choice(choices: tuple[str, ...], meaning: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{' or '.join(repr(c) for c in choices)} ({meaning})")
        return value

    return parse


def _fraction(value: Any) -> float:
    fraction = float(_number(value, "a fraction between 0 and 1 (exclusive)", low=0, low_open=True))
    if fraction >= 1:
        raise ValueError("a fraction between 0 and 1 (exclusive)")
    return fraction


# request key -> parser; the bundle keys go to `monai.bundle run training` as --key value
BUNDLE_OPTIONS = {
    "epochs": _positive_int,
    "epoch_length": _positive_int,
    "batch_size": _positive_int,
    "learning_rate": _positive_float,
    "max_minutes": _positive_float,
    "image_size": _size,
    "crop_size": _size,
    "num_queries": _positive_int,
    "seed": _seed,
}
APP_OPTIONS = {
    "min_improvement": _margin,
    "network": _choice(NETWORKS, "the stage-1 network or the stage-2 heatmap detector"),
    "holdout": _fraction,
    "min_held_out": _positive_int,
    "publish": _choice(PUBLISH, "publish when better, or whatever its score"),
}


# MONAI Label's own trainers' names for two of the options
ALIASES = {"max_epochs": "epochs", "train_batch_size": "batch_size"}
# request keys that MONAI Label itself adds or that its clients send for every app; not options of this task
SERVER_KEYS = frozenset({"model", "client_id", "gpus", "multi_gpu", "local_rank"})


def validate_options(
    request: dict,
    defaults: dict | None = None,
    spatial_dims: int = 2,
    strict: bool = False,
    *,
    network_config: Mapping[str, Any],
) -> dict[str, Any]:
    """The training options of ``request`` (over ``defaults``), each checked; a bad one raises ValueError naming it.
    ``network_config``: the train config's ``crop_size``, ``image_size`` and ``batch_size``, which a request leaves
    unset (:attr:`landmark_tasks.context.BundleContext.network_config`).

    MONAI Label's names ``max_epochs`` and ``train_batch_size`` stand for ``epochs`` and ``batch_size``.
    ``strict`` (a client's request, checked before it is queued): a key that is neither an option nor one of
    MONAI Label's own (``SERVER_KEYS``) is refused instead of being ignored; in the training process the
    request also carries what the server adds, so other keys are ignored there.
    """
    request = dict(request)
    for alias, key in ALIASES.items():
        if request.get(alias) is None:
            continue
        if request.get(key) is not None and request[key] != request[alias]:
            raise ValueError(
                f"train request: {alias!r} ({request[alias]!r:.20}) and {key!r} ({request[key]!r:.20}) "
                f"disagree; {alias!r} is MONAI Label's name for {key!r}, give one of them"
            )
        request[key] = request.pop(alias)
    options_known = {**BUNDLE_OPTIONS, **APP_OPTIONS}
    if strict:
        unknown = sorted(k for k in request if k not in options_known and k not in SERVER_KEYS)
        if unknown:
            raise ValueError(
                f"train request: unknown option {unknown[0]!r}; the options are {sorted([*options_known, *ALIASES])}"
            )
    options = dict(defaults or {})
    for key, parse in options_known.items():
        if key not in request or request[key] is None:
            continue
        try:
            options[key] = parse(request[key])
        except ValueError as e:
            raise ValueError(f"train request: {key!r} must be {e}, got {request[key]!r:.60}") from None
        if key in ("image_size", "crop_size"):
            try:  # the bundle's check of a grid: one value per axis, each divisible by the encoder's stride
                check_image_size(options[key], spatial_dims, key=repr(key))
            except ValueError as e:
                raise ValueError(f"train request: {e}") from None
    if options.get("network", "contrastive") == "contrastive":
        check_training_crop(options, spatial_dims, network_config)
    return options


def check_training_crop(options: dict, spatial_dims: int, network_config: Mapping[str, Any]) -> None:
    """The stage-1 training's crops as the bundle takes them (``check_crop_size``: within ``image_size``, large
    enough for the batch's BatchNorm), from the request's ``crop_size``, ``image_size`` and ``batch_size``, else
    the bundle's train config's (``network_config``); ValueError naming the values and which are the config's."""
    keys = ("crop_size", "image_size", "batch_size")
    defaulted = [k for k in keys if options.get(k) is None]
    values = {k: network_config[k] if k in defaulted else options[k] for k in keys}
    try:
        check_crop_size(values["crop_size"], values["image_size"], spatial_dims, values["batch_size"])
    except ValueError as e:
        config = config_files("train", spatial_dims)[-1]
        given = f" ({', '.join(f'{k} {values[k]}' for k in defaulted)}: {config}'s)" if defaulted else ""
        raise ValueError(f"train request: 'crop_size' refused: {e}{given}") from None


def check_labelled(n_labelled: int, needed: int, what: str, why: str) -> None:
    """Refuse a training (``what``) with fewer than ``needed`` labelled images (ValueError naming the count and
    ``why`` they are needed)."""
    if n_labelled < needed:
        raise ValueError(
            f"train request: {what} needs at least {needed} labelled images ({why}); the datastore has {n_labelled} "
            f"labelled image{'' if n_labelled == 1 else 's'} (save labels with tag 'final')"
        )


def check_detector_labels(n_labelled: int) -> None:
    """The detector trains on labelled images and is scored on others held out."""
    check_labelled(n_labelled, MIN_DETECTOR_LABELS, "the detector", "one to train on, one held out to score on")


def check_contrastive_labels(n_labelled: int, builtin_templates: bool) -> None:
    """With the built-in templates, the stage-1 network is fine-tuned only with 2 labelled images or more: the
    built-in features belong to the shipped weights, so new weights can only be scored, and served, from the
    datastore's labelled images (each predicted from the others)."""
    if builtin_templates:
        check_labelled(
            n_labelled,
            2,
            "with the built-in templates, fine-tuning",
            "new weights are scored on them, each from the others; the built-in template features belong to the "
            "shipped weights",
        )
