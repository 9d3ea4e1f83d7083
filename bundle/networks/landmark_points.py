"""The model zoo's export network: image -> landmark positions, with template features built in.

:class:`LandmarkPointsNet` is the ``network_def`` of ``configs/inference.yaml``: the contrastive network followed
by the bundle's one matching core (:class:`bundle.networks.matching.TemplateMatcher`, as the Python path
:class:`bundle.inferers.oneshot.TemplateFeatureInferer` uses it) against a template feature file
(:mod:`bundle.template_file`), TorchScript-scriptable; :func:`bundle.kshot.geometric_median` combines its
templates' predictions.

Axis order at its boundary: a 2D image comes in as a plain PyTorch / PIL / NumPy user holds it,
``(B, 1, rows, columns)``, and each landmark goes out as ``(x, y)`` = (column, row) on that grid, the
datalist's convention. Inside, the bundle works on MONAI's ``[x, y]`` grid (its readers index a 2D image
(column, row)), so :meth:`LandmarkPointsNet.forward` transposes the two image axes on the way in, and nowhere
else. A 3D volume is ``(B, 1, X, Y, Z)`` as MONAI and nibabel index it, unchanged.
"""

import os
from typing import Any, List, Mapping, Union

import torch
from bundle.kshot import geometric_median, vote_weights
from bundle.networks.matching import TemplateMatcher
from bundle.template_file import check_template, load_template

__all__ = ["LandmarkPointsNet"]


class LandmarkPointsNet(torch.nn.Module):
    """Export network: image ``(B, 1, rows, columns)`` (3D: ``(B, 1, X, Y, Z)``) -> landmark positions ``(B, L, D)``
    (float32) on the input grid, 2D ``(x, y)`` = (column, row).

    The contrastive network, then each built-in template's landmarks found by the matcher (multi-scale cosine
    similarity, sub-pixel refinement; :class:`bundle.networks.matching.TemplateMatcher` with the inferring
    command's settings) and the K templates' positions combined on the grid as ``inferring`` does by default (the
    geometric median of votes weighted by their match scores, :func:`bundle.kshot.vote_weights`). It scripts
    (``torch.jit.script``). Its state dict is the wrapped network's, so the bundle's ``model.pt`` loads into it
    unchanged (strict); the template features are non-persistent buffers (they travel inside a TorchScript export).
    An image on another grid than the template features' is refused.

    Args:
        network: the contrastive network (:class:`bundle.networks.contrastive.ContrastiveLandmarkNet`), of the
            template features' strides.
        template: a template feature dict, or the path of its file (:mod:`bundle.template_file`; a relative path
            missing from the working directory is taken in the bundle's folder).
    """

    grid_size: List[int]

    def __init__(self, network: torch.nn.Module, template: Union[Mapping[str, Any], str, os.PathLike]) -> None:
        super().__init__()
        if isinstance(template, (str, os.PathLike)):
            template = load_template(template)
        template = check_template(template)
        queries = template["queries"]
        strides = [int(s) for s in getattr(network, "strides", template["strides"])]
        if strides != [int(s) for s in template["strides"]]:
            raise ValueError(f"the template features are of strides {template['strides']}, the network's are {strides}")
        self.network = network
        self.landmark_names = list(template["landmark_names"])
        self.num_templates = int(queries.shape[0])
        self.num_landmarks = int(queries.shape[1])
        valid = ~torch.isnan(queries).any(dim=-1).any(dim=-1)
        # the landmarks the templates give, one row each (K x L flattened), matched in one matcher call
        self.register_buffer("queries", queries[valid], persistent=False)
        self.register_buffer("valid", valid.reshape(-1), persistent=False)
        self.grid_size = [int(s) for s in template.get("grid_size") or []]  # MONAI's [x, y] order in 2D
        self.matcher = TemplateMatcher()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.network.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        return self.network.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Landmark positions of image ``x`` (see the class doc for the axis order)."""
        if x.dim() == 4:  # (B, 1, rows, columns) -> MONAI's (B, 1, columns, rows): peaks come out (column, row)
            x = x.transpose(2, 3)
        grid = [int(s) for s in x.shape[2:]]
        if len(self.grid_size) > 0 and grid != self.grid_size:
            raise ValueError("the image's grid is not the template features' (network_data_format's spatial_shape)")
        features = [f.float() for f in self.network(x)]
        b, k, n, d = x.shape[0], self.num_templates, self.num_landmarks, len(grid)
        found, scores = self.matcher([q.unsqueeze(0).expand(b, -1, -1) for q in self.queries.unbind(1)], features, grid)
        peaks = torch.full([b, k * n, d], float("nan"), dtype=torch.float64, device=x.device)
        votes = torch.zeros([b, k * n], dtype=torch.float64, device=x.device)
        peaks[:, self.valid] = found
        votes[:, self.valid] = scores.double()
        peaks = peaks.reshape(b, k, n, d).transpose(0, 1)
        return geometric_median(peaks, vote_weights(votes.reshape(b, k, n).transpose(0, 1), peaks)).to(torch.float32)
