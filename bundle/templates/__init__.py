"""Templates of one-shot (k-shot) detection: their choice, pseudo-templates and pseudo-labels,
and the template features of inference."""

from bundle import lazy_submodules
from bundle.templates.features import (
    compute_template,
    default_template_cache,
    resolve_template_features,
    template_cache_key,
    template_source_names,
)
from bundle.templates.pseudo_labels import pseudo_label, reliability, reliable_landmarks, select_pseudo_templates
from bundle.templates.resolution import (
    check_rule,
    default_template,
    default_templates,
    held_out_images,
    labelled_training_items,
    prepare_template,
    pseudo_template_pool,
    resolve_template,
    resolve_templates,
    template_items,
    with_templates,
    without_test_images,
)
from bundle.templates.selection import (
    grid_points,
    landmark_transfer_errors,
    select_template,
    select_template_by_landmarks,
)

__all__ = [
    "check_rule",
    "compute_template",
    "default_template",
    "default_template_cache",
    "default_templates",
    "grid_points",
    "held_out_images",
    "labelled_training_items",
    "landmark_transfer_errors",
    "prepare_template",
    "pseudo_label",
    "pseudo_template_pool",
    "reliability",
    "reliable_landmarks",
    "resolve_template",
    "resolve_template_features",
    "resolve_templates",
    "select_pseudo_templates",
    "select_template",
    "select_template_by_landmarks",
    "template_cache_key",
    "template_items",
    "template_source_names",
    "with_templates",
    "without_test_images",
]

__getattr__ = lazy_submodules(__name__)
