"""The model zoo's export network: image -> landmark positions, with template features built in.

:class:`LandmarkPointsNet` is the ``network_def`` of ``configs/inference.yaml``: the contrastive network followed
by one-shot matching against a template feature file (:mod:`bundle.export`), TorchScript-scriptable;
:func:`bundle.kshot.geometric_median` combines its templates' peaks.

Axis order at its boundary: a 2D image comes in as a plain PyTorch / PIL / NumPy user holds it,
``(B, 1, rows, columns)``, and each landmark goes out as ``(x, y)`` = (column, row) on that grid, the
datalist's convention. Inside, the bundle works on MONAI's ``[x, y]`` grid (its readers index a 2D image
(column, row)), so :meth:`LandmarkPointsNet.forward` transposes the two image axes on the way in, and nowhere
else. A 3D volume is ``(B, 1, X, Y, Z)`` as MONAI and nibabel index it, unchanged.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from bundle.export import check_template, load_template
from bundle.kshot import geometric_median

__all__ = ["LandmarkPointsNet"]


class LandmarkPointsNet(torch.nn.Module):
    """Export network: image ``(B, 1, rows, columns)`` (3D: ``(B, 1, X, Y, Z)``) -> landmark positions ``(B, L, D)``
    (float32) on the input grid, 2D ``(x, y)`` = (column, row).

    The contrastive network with one-shot matching against built-in template features (a template feature
    dict or file, see :mod:`bundle.export`): per template and landmark, the product over scales of
    ``(cos + 1) / 2`` between the stored feature vector and the image's features interpolated at every grid
    position (as :class:`bundle.oneshot.OneShotInferer` combines them), its integer peak, and the K
    templates' peaks combined by the geometric median. It scripts (``torch.jit.script``) and traces; the
    sub-pixel refinement stays in the Python path (:class:`bundle.export.TemplateFeatureInferer`). Its state dict is the
    wrapped network's, so the bundle's ``model.pt`` loads into it unchanged (strict); the template features
    are non-persistent buffers (they travel inside a TorchScript export).
    """

    def __init__(self, network: torch.nn.Module, template: Mapping[str, Any] | str | os.PathLike) -> None:
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
        self.register_buffer("queries", torch.nan_to_num(queries, nan=0.0), persistent=False)
        self.register_buffer("valid", valid, persistent=False)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.network.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        return self.network.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Landmark positions of image ``x`` (see the class doc for the axis order)."""
        if x.dim() == 4:  # (B, 1, rows, columns) -> MONAI's (B, 1, columns, rows): peaks come out (column, row)
            x = x.transpose(2, 3)
        features = self.network(x)
        grid = [int(s) for s in x.shape[2:]]
        mode = "bilinear" if len(grid) == 2 else "trilinear"
        b = x.shape[0]
        k, n = self.num_templates, self.num_landmarks
        score = torch.ones([1], dtype=torch.float32, device=x.device)
        for s, f in enumerate(features):
            f = f.float()
            up = F.interpolate(f, size=grid, mode=mode, align_corners=False)
            norm = up.square().sum(dim=1, keepdim=True).sqrt().clamp_min(1e-8)
            q = self.queries[:, :, s].reshape(k * n, -1).to(f.dtype)
            dots = torch.matmul(q, f.flatten(2)).reshape([b, k * n] + [int(v) for v in f.shape[2:]])
            cosine = F.interpolate(dots, size=grid, mode=mode, align_corners=False) / norm
            score = score * ((cosine + 1.0) * 0.5).clamp(0.0, 1.0)
        index = score.flatten(2).argmax(dim=-1)
        coords: list[torch.Tensor] = []
        for size in grid[::-1]:
            coords.append(index % size)
            index = torch.div(index, size, rounding_mode="floor")
        coords.reverse()
        peaks = torch.stack(coords, dim=-1).to(torch.float64).reshape(b, k, n, len(grid)).transpose(0, 1)
        missing = ~self.valid[:, None, :, None].expand(k, b, n, len(grid))
        peaks = peaks.masked_fill(missing, float("nan"))
        return geometric_median(peaks).to(torch.float32)
