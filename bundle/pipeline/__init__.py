"""Which pipeline predicts (template matching or a heatmap detector) and the detector's data: its training items
(pseudo-labelled or human-labelled), its record and its grid."""

from bundle import lazy_submodules
from bundle.pipeline.choice import (
    DEFAULT_DETECTORS,
    ENOUGH_LABELS,
    PIPELINE_CHOICES,
    SHIPPED_TEMPLATE,
    SHIPPED_WEIGHTS,
    STARTING_DETECTORS,
    assess_detector,
    builtin_templates,
    check_pipeline_choice,
    choose_detector,
    default_detectors,
    detector_admitted,
    labelled_at_hand,
    starting_detector,
)
from bundle.pipeline.detector_data import (
    detector_info,
    detector_record,
    detector_templates,
    labelled_items,
    load_detector,
    pseudo_label_templates,
    pseudo_labelled_items,
    read_pseudo_labels,
    recorded_detector,
    write_detector_info,
)

__all__ = [
    "DEFAULT_DETECTORS",
    "ENOUGH_LABELS",
    "PIPELINE_CHOICES",
    "SHIPPED_TEMPLATE",
    "SHIPPED_WEIGHTS",
    "STARTING_DETECTORS",
    "assess_detector",
    "builtin_templates",
    "check_pipeline_choice",
    "choose_detector",
    "default_detectors",
    "detector_admitted",
    "detector_info",
    "detector_record",
    "detector_templates",
    "labelled_at_hand",
    "labelled_items",
    "load_detector",
    "pseudo_label_templates",
    "pseudo_labelled_items",
    "read_pseudo_labels",
    "recorded_detector",
    "starting_detector",
    "write_detector_info",
]

__getattr__ = lazy_submodules(__name__)
