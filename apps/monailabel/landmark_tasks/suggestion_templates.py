"""The templates of a suggestion: the saved labels, the bundle's own, the built-in features, pseudo-templates."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

import torch
from bundle.io_utils import write_json_atomic
from bundle.pipeline.choice import SHIPPED_TEMPLATE
from bundle.template_file import load_template
from bundle.templates.resolution import resolve_templates

from .background import check_stopping, stoppable
from .cache_keys import file_key, labels_key
from .uploads import ImageError

logger = logging.getLogger(__name__)
ITEM_KEYS = ("image", "landmarks", "spacing", "id")  # what of a datastore item a template needs (not its label file)


class SuggestionTemplates:
    """Where the templates of a suggestion come from, as :class:`landmark_tasks.context.BundleContext` chooses them
    (a part of it: it reads the context's ``parser``, ``datalist``, ``device``, ``preprocessing``, ``network``,
    ``private_network``, ``prepare``, ``is_published``, ``pseudo_choice``, ``pseudo``, ``templates_cache`` and
    ``builtin_template_path``, under its lock)."""

    def _check_builtin(self, checkpoint: Path) -> dict:
        """The built-in template features, refused (ValueError) for weights other than those that computed them."""
        try:
            return load_template(self.builtin_template_path, checkpoint)
        except ValueError:
            published = (
                " (fine-tuned by the train task; remove the app's model/model.pt to serve the shipped weights again)"
                if self.is_published(checkpoint)
                else ""
            )
            remedy = (
                "or label images of the datastore (they become the templates)"
                if published
                else "(these weights need their own templates' images)"
            )
            raise ValueError(
                f"the built-in templates ({SHIPPED_TEMPLATE}) hold features of the shipped weights, not of "
                f"{checkpoint.name}{published}: give the templates' images (--conf datalist) {remedy}"
            ) from None

    def builtin_template(self, checkpoint: str | Path) -> dict | None:
        """The built-in template features when they fit ``checkpoint`` (no ``--conf datalist``, the shipped weights),
        else None."""
        if self.builtin_template_path is None:
            return None
        with self._lock:
            key = file_key(checkpoint)
            if self._builtin is None or self._builtin[0] != key:
                try:
                    self._builtin = (key, self._check_builtin(Path(checkpoint)))
                except ValueError:
                    self._builtin = (key, None)
            return self._builtin[1]

    def templates(self, labelled: Sequence[dict], exclude: str | None = None) -> list[dict]:
        """The template images of a suggestion, each with its ``source``: the labelled datastore items but the image
        ``exclude`` (an id; an image is never its own template) as ``"datastore"``, else the bundle datalist's
        templates as ``"bundle"`` (they stand in until an image is labelled). The built-in features, which stay
        while the shipped weights are served, join them in :meth:`template_inferer`."""
        items = [dict(it, source="datastore") for it in labelled if it.get("id") != exclude]
        return items or [dict(it, source="bundle") for it in self.bundle_templates()]

    def suggestion_templates(
        self,
        labelled: Sequence[dict],
        unlabelled: Sequence[dict],
        checkpoint: str | Path,
        exclude: str | None = None,
        wait: bool = False,
        builtin: bool = True,
        network: torch.nn.Module | None = None,
    ) -> list[dict]:
        """The templates of a suggestion with ``checkpoint``'s weights: :meth:`templates` (the saved labels but the
        image ``exclude``, else the bundle's), and while the saved labels are few and no built-in template joins them
        (``builtin``: they join where they fit the weights), their :meth:`pseudo_templates` (``wait``: computed now
        when not ready, as scoring needs them, with ``network`` when given). A labelled image's own suggestion gets
        none: they are made from all the saved labels, its own among them."""
        items = self.templates(labelled, exclude)
        own_label = any(it.get("id") == exclude for it in labelled) if exclude is not None else False
        if items and items[0]["source"] == "datastore" and not own_label:
            if self._pseudo_apply(labelled, unlabelled, checkpoint, builtin):
                pseudo = self.pseudo_templates(labelled, unlabelled, checkpoint, wait, network)
                items += [it for it in pseudo if it["id"] != exclude]
        return items

    def _pseudo_apply(
        self, labelled: Sequence[dict], unlabelled: Sequence[dict], checkpoint: str | Path, builtin: bool = True
    ) -> bool:
        """Whether pseudo-templates join ``labelled``: ``pseudo_templates`` > 0, some saved labels but no more than
        ``pseudo_max_labelled``, some unlabelled image, and no built-in template joining the saved labels
        (``builtin`` False, or none fitting ``checkpoint``)."""
        limit = self.pseudo_choice["pseudo_max_labelled"]
        return bool(
            labelled
            and unlabelled
            and self.pseudo_choice["pseudo_templates"] > 0
            and (limit is None or len(labelled) <= limit)
            and not (builtin and self.builtin_template(checkpoint) is not None)
        )

    def pseudo_templates(
        self,
        labelled: Sequence[dict],
        unlabelled: Sequence[dict],
        checkpoint: str | Path,
        wait: bool = False,
        network: torch.nn.Module | None = None,
    ) -> list[dict]:
        """Pseudo-templates of the saved labels, as the evaluating command adds them: the first ``pseudo_candidates``
        unlabelled datastore images (sorted ids) labelled by matching from ``labelled``, the ``pseudo_templates``
        most reliable kept (:func:`bundle.templates.resolution.resolve_templates` with the evaluation config's keys),
        each with ``source`` ``"pseudo"``.

        They take many network passes, so unless ``wait`` they are computed in the background (:attr:`pseudo`) once
        per weights, labels and candidates (a failure is logged and gives none for that set): [] until they are
        ready. ``wait``: computed now with ``network`` (holding ``checkpoint``'s weights; default: the context's
        network), errors raised.
        """
        candidates = list(unlabelled)[: int(self.pseudo_choice["pseudo_candidates"])]
        plain = [[{k: it[k] for k in ITEM_KEYS if k in it} for it in part] for part in (labelled, candidates)]
        if wait:
            with self.network(checkpoint, network) as held:
                return self._compute_pseudo(*plain, held)
        key = (file_key(checkpoint), labels_key(labelled), tuple(it["id"] for it in candidates))
        last = self.pseudo.get(key, *plain, Path(checkpoint))
        return last[1] if last is not None and last[0] == key else []

    def _background_pseudo(self, labelled: list[dict], candidates: list[dict], checkpoint: Path) -> list[dict]:
        """:meth:`pseudo_templates` in the background, on a :meth:`private_network` (the requests keep the shared
        one)."""
        return self._compute_pseudo(labelled, candidates, self.private_network(checkpoint))

    def _compute_pseudo(self, labelled: list[dict], candidates: list[dict], network: torch.nn.Module) -> list[dict]:
        """The pseudo-templates of ``labelled`` among ``candidates`` (an unreadable one is skipped, named)."""
        readable = []
        for item in candidates:
            check_stopping()
            try:
                self.prepare(item, item.get("id"))
                readable.append(item)
            except ImageError as e:
                logger.warning(f"pseudo-template candidate skipped: {e}")
        datalist = {"templates": labelled, "training": readable}
        items = resolve_templates(
            datalist, network.eval(), stoppable(self.preprocessing), self.device, **self.pseudo_choice
        )
        pseudo = [dict(it, source="pseudo") for it in items if it.get("pseudo_label")]
        logger.info(f"pseudo-templates of {len(labelled)} saved label(s): {[it['id'] for it in pseudo]}")
        return pseudo

    # ---- the bundle's templates ----------------------------------------------------------------------
    def bundle_templates(self) -> list[dict]:
        """The bundle's templates (``evaluate#templates`` of the configured datalist), resolved on first use.

        When the datalist names no template, ``evaluate#templates`` chooses one among its labelled training
        items by matching (slow on large datalists): that happens once, and the result is kept in
        ``model/bundle_templates.json`` (keyed by the datalist's path and mtime and the template choice) so that
        other processes of the app (the training task runs in a child process) read it instead of searching again;
        one that cannot be written (a full disk) is skipped with a warning.
        """
        with self._lock:
            if self._bundle_templates is not None:
                return self._bundle_templates
            if self.datalist is None:  # built-in templates: features, no images (builtin_inferer)
                self._bundle_templates = []
                return self._bundle_templates
            key = {
                "datalist": str(self.datalist),
                "mtime_ns": os.stat(self.datalist).st_mtime_ns,
                "choice": self.pseudo_choice,  # the rule and pseudo-templates (conf pseudo_templates)
            }
            if self.templates_cache.is_file():
                try:
                    cached = json.loads(self.templates_cache.read_text(encoding="utf-8"))
                    if cached.get("key") == key and cached.get("templates"):
                        self._bundle_templates = cached["templates"]
                        return self._bundle_templates
                except (OSError, ValueError):
                    pass
            with self.network() as network:  # the template choice runs the served network: the shared one
                self.parser["network"] = network
                templates = [
                    dict(t, image=str(Path(t["image"]).resolve()))
                    for t in self.parser.get_parsed_content("evaluate#templates")
                ]
            templates = json.loads(json.dumps(templates, default=float))  # plain JSON types
            try:
                write_json_atomic(self.templates_cache, {"key": key, "templates": templates})
            except OSError as e:  # a cache: a full or read-only disk costs the other processes a search, not a reply
                logger.warning(
                    f"{self.templates_cache} not written ({os.strerror(e.errno) if e.errno else e}): the "
                    "bundle's templates are kept in this process only"
                )
            self._bundle_templates = templates
            logger.info(f"bundle templates resolved: {[t['image'] for t in templates]}")
            return templates
