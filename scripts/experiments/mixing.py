"""The view-mixing methods the paper compares with (Quan et al. CVPR 2023), on the pixel-wise contrastive loss.

An experiment, not the product: ``scripts/experiments/configs/comparison.yaml``, merged after
``configs/train.yaml``, declares the training key ``mixing`` (``none | unmix | mochi | zhu``) and the methods'
keys, and plugs the chosen method into the loss's ``feature_mixing`` or the training step's ``extra_loss``
(:func:`feature_mixing`, :func:`image_mixing`). ``mixing: none`` trains as the product does.
``python -m scripts.experiments.ablation run --plan comparison`` runs the comparison (docs/results.md).

Keys (comparison.yaml, default):

* ``mixing`` (``none``): ``unmix`` (image mixtures of crops, Shen et al. 2022), ``mochi`` (hard negative mixing,
  Kalantidis et al. 2020), ``zhu`` (positive extrapolation and negative interpolation, Zhu et al. 2021);
* ``unmix_alpha`` (1.0), ``unmix_global_prob`` (0.5): Un-mix's Beta parameter of the mixing weight, and its
  probability of a global mixup rather than a CutMix box;
* ``mochi_hardest``, ``mochi_synthetic``, ``mochi_query_synthetic`` (1/16, 1/16, 1/128): MoCHi's N, s and s' as
  fractions of a query's negatives;
* ``zhu_pos_alpha``, ``zhu_neg_alpha`` (2.0, 1.6): Zhu et al.'s Beta parameters of extrapolation and interpolation.

Feature pixels are the instances: for one query q (a crop-encoder pixel feature) the keys are the positive k+
and the negatives n_i of :class:`bundle.losses.infonce.MultiScaleInfoNCELoss` (a local window of cells at the fine
scales, every cell at the coarsest). The feature-space methods take a scale's ``query (B, Q, C)``, key vectors
``keys (B, Q, K, C)``, cosine ``logits (B, Q, K)`` (``-inf`` = a cell left out) and the positive's column
``target (B, Q)`` and return new logits and target (the loss's ``feature_mixing``):

* :class:`HardNegativeMixing`: MoCHi (Kalantidis et al., NeurIPS 2020);
* :class:`FeatureTransformation`: positive extrapolation and negative interpolation (Zhu et al., ICCV 2021).

Un-mix (Shen et al., AAAI 2022) mixes in image space: :func:`unmix_draw` chooses a mixture,
:func:`unmix_crops` applies it before the crop encoder and :func:`unmix_loss` weights the loss;
:class:`UnmixLoss` is the three as the training step's ``extra_loss``. Random draws use torch's global RNG
(``set_determinism`` seeds it).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F


def beta_sample(alpha: float, shape: Sequence[int] = (), device: torch.device | str | None = None) -> torch.Tensor:
    """Beta(alpha, alpha) draws of ``shape`` from torch's global RNG."""
    a = torch.full(tuple(shape), float(alpha), device=device)
    return torch.distributions.Beta(a, a).sample()


def _fraction(value: float, name: str) -> float:
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a fraction of the negatives in [0, 1], got {value}")
    return float(value)


def _positive(value: float, name: str) -> float:
    if not float(value) > 0.0:
        raise ValueError(f"{name} must be positive, got {value}")
    return float(value)


def _gather_keys(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``keys (B, Q, K, C)`` at ``columns (B, Q, M)`` -> ``(B, Q, M, C)``."""
    return torch.gather(keys, 2, columns[..., None].expand(-1, -1, -1, keys.shape[-1]))


class Synthetic(NamedTuple):
    """MoCHi's synthetic negatives of each query and how each was made.

    ``vectors (B, Q, S, C)`` unit vectors; ``usable (B, Q, S)`` False where a mixed key was a left-out cell;
    ``first`` / ``second (B, Q, S)`` key columns mixed (``first`` = -1: the query); ``share (B, Q, S)`` the
    weight of ``first``.
    """

    vectors: torch.Tensor
    usable: torch.Tensor
    first: torch.Tensor
    second: torch.Tensor
    share: torch.Tensor


class HardNegativeMixing:
    """MoCHi: synthetic hard negatives mixed from each query's hardest negatives (Kalantidis et al., "Hard negative
    mixing for contrastive learning", NeurIPS 2020, Sec. 4), added to the softmax as negatives only.

    For each query the ``N`` negatives of highest cosine form the hard set; ``s`` points
    ``h = normalise(a n_i + (1 - a) n_j)``, ``a ~ U(0, 1)``, ``n_i, n_j`` drawn from it, and ``s'``
    points ``h' = normalise(b q + (1 - b) n_j)``, ``b ~ U(0, 0.5)``. The synthetic points carry no
    gradient (as MoCo's queue negatives), the query's logits with them do. ``N, s, s'`` are given as
    fractions of the query's negatives (``K - 1``), rounded up: the paper's default MoCHi (1024, 1024, 128)
    with its ImageNet-100 queue of 16384 negatives gives 1/16, 1/16 and 1/128.
    """

    def __init__(self, hardest: float = 1 / 16, synthetic: float = 1 / 16, query_synthetic: float = 1 / 128) -> None:
        self.hardest = _fraction(hardest, "mochi_hardest")
        if self.hardest == 0.0:
            raise ValueError("mochi_hardest must be positive: the synthetic negatives are mixed from the hardest")
        self.synthetic = _fraction(synthetic, "mochi_synthetic")
        self.query_synthetic = _fraction(query_synthetic, "mochi_query_synthetic")

    def counts(self, num_negatives: int) -> tuple[int, int, int]:
        """``(N, s, s')`` for a key set of ``num_negatives`` negatives."""
        return tuple(math.ceil(f * num_negatives) for f in (self.hardest, self.synthetic, self.query_synthetic))

    def hard_set(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The columns ``(B, Q, N)`` of each query's ``N`` hardest negatives (highest cosine first); left-out
        cells rank below every real negative, the positive below them all."""
        n = self.counts(logits.shape[-1] - 1)[0]
        rank = logits.detach().nan_to_num(neginf=torch.finfo(logits.dtype).min)
        return rank.scatter(-1, target[..., None], float("-inf")).topk(n, dim=-1).indices

    def synthesize(
        self, query: torch.Tensor, keys: torch.Tensor, logits: torch.Tensor, target: torch.Tensor
    ) -> Synthetic:
        """The ``s + s'`` synthetic negatives of every query: ``h`` and ``h'``."""
        b, q, k = logits.shape
        n, s, s_query = self.counts(k - 1)
        hard = self.hard_set(logits, target)
        device = logits.device
        columns = torch.gather(hard, -1, torch.randint(n, (b, q, 2 * s + s_query), device=device))
        usable = torch.isfinite(torch.gather(logits, -1, columns))
        share = torch.cat([torch.rand(b, q, s, device=device), 0.5 * torch.rand(b, q, s_query, device=device)], -1)
        mixed = _gather_keys(keys.detach(), columns)
        first = torch.cat([mixed[:, :, :s], query.detach()[:, :, None].expand(-1, -1, s_query, -1)], 2)
        second = mixed[:, :, s:]
        w = share[..., None].to(mixed.dtype)
        vectors = F.normalize(w * first + (1 - w) * second, dim=-1)
        from_query = torch.full((b, q, s_query), -1, dtype=columns.dtype, device=device)
        return Synthetic(
            vectors=vectors,
            usable=torch.cat([usable[..., :s] & usable[..., s : 2 * s], usable[..., 2 * s :]], -1),
            first=torch.cat([columns[..., :s], from_query], -1),
            second=columns[..., s:],
            share=share,
        )

    def __call__(
        self, query: torch.Tensor, keys: torch.Tensor, logits: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        syn = self.synthesize(query, keys, logits, target)
        extra = torch.einsum("bqc,bqsc->bqs", query, syn.vectors).masked_fill(~syn.usable, float("-inf"))
        return torch.cat([logits, extra.to(logits.dtype)], -1), target


class Transformed(NamedTuple):
    """Zhu et al.'s transformed features of each query: ``query (B, Q, C)``, ``positive (B, Q, C)``, ``keys
    (B, Q, K, C)`` (the positive's column holds ``positive``), ``partner (B, Q, K)`` the column each negative
    was interpolated with, ``lam`` and ``mu`` the drawn coefficients."""

    query: torch.Tensor
    positive: torch.Tensor
    keys: torch.Tensor
    partner: torch.Tensor
    lam: torch.Tensor
    mu: torch.Tensor


class FeatureTransformation:
    """Positive extrapolation and negative interpolation (Zhu et al., "Improving contrastive learning by
    visualizing feature transformation", ICCV 2021), with the authors' defaults.

    Positive extrapolation: ``q^ = lam q + (1 - lam) k+``, ``k^ = lam k+ + (1 - lam) q`` with
    ``lam = 1 + Beta(pos_alpha, pos_alpha)`` in [1, 2]: the pair is pushed apart along its line, a harder
    positive. Negative interpolation: ``n^_i = mu n_i + (1 - mu) n_pi(i)``, ``mu ~ Beta(neg_alpha,
    neg_alpha)``, ``pi`` a random permutation of the query's negatives (left-out cells excluded). One scalar
    ``lam`` and ``mu`` per call (the authors' ``dim_mask none``), no renormalisation (their default), the
    logits ``q^ . k^`` and ``q^ . n^_i``. Defaults ``pos_alpha = 2.0``, ``neg_alpha = 1.6``: the authors'
    published command (``--sep_alpha --pos_alpha 2.0 --neg_alpha 1.6 --expolation_mask``).
    """

    def __init__(self, pos_alpha: float = 2.0, neg_alpha: float = 1.6) -> None:
        self.pos_alpha = _positive(pos_alpha, "zhu_pos_alpha")
        self.neg_alpha = _positive(neg_alpha, "zhu_neg_alpha")

    def transform(
        self, query: torch.Tensor, keys: torch.Tensor, logits: torch.Tensor, target: torch.Tensor
    ) -> Transformed:
        """Extrapolate each positive pair and interpolate each negative with a permuted one."""
        device = logits.device
        lam = 1.0 + beta_sample(self.pos_alpha, device=device)
        mu = beta_sample(self.neg_alpha, device=device)
        positive = _gather_keys(keys, target[..., None])[:, :, 0]
        q_hat = lam * query + (1 - lam) * positive
        k_hat = lam * positive + (1 - lam) * query
        # a random permutation of each row's negatives: the j-th of one random order goes to the j-th of another,
        # the positive and left-out cells sorted last in both
        excluded = torch.isneginf(logits).scatter(-1, target[..., None], True)
        order = [torch.rand(logits.shape, device=device).masked_fill(excluded, 2.0).argsort(-1) for _ in range(2)]
        partner = torch.empty_like(order[0]).scatter_(-1, order[0], order[1])
        mixed = mu * keys + (1 - mu) * _gather_keys(keys, partner)
        mixed = mixed.scatter(2, target[..., None, None].expand(-1, -1, 1, keys.shape[-1]), k_hat[:, :, None])
        return Transformed(q_hat, k_hat, mixed, partner, lam, mu)

    def __call__(
        self, query: torch.Tensor, keys: torch.Tensor, logits: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.transform(query, keys, logits, target)
        new = torch.einsum("bqc,bqkc->bqk", t.query, t.keys).to(logits.dtype)
        return new.masked_fill(torch.isneginf(logits), float("-inf")), target


MIXING_METHODS = ("none", "unmix", "mochi", "zhu")  # the values of the training key ``mixing``


def _checked(mixing: str) -> str:
    if mixing not in MIXING_METHODS:
        raise ValueError(f"mixing must be one of {list(MIXING_METHODS)}, got {mixing!r}")
    return mixing


def feature_mixing(
    mixing: str,
    mochi_hardest: float = 1 / 16,
    mochi_synthetic: float = 1 / 16,
    mochi_query_synthetic: float = 1 / 128,
    zhu_pos_alpha: float = 2.0,
    zhu_neg_alpha: float = 1.6,
) -> HardNegativeMixing | FeatureTransformation | None:
    """The loss's ``feature_mixing`` for the training key ``mixing``: MoCHi or Zhu et al.'s transformation, None
    for ``none`` and ``unmix`` (an unknown value is refused, naming the key).

    Args:
        mixing: ``none``, ``unmix``, ``mochi`` or ``zhu``.
        mochi_hardest: MoCHi's N hardest negatives, a fraction of a query's negatives.
        mochi_synthetic: MoCHi's s synthetic negatives (mixed from two hard ones), a fraction.
        mochi_query_synthetic: MoCHi's s' synthetic negatives (mixed from the query and a hard one), a fraction.
        zhu_pos_alpha: Zhu et al.'s Beta parameter of positive extrapolation.
        zhu_neg_alpha: Zhu et al.'s Beta parameter of negative interpolation.
    """
    if _checked(mixing) == "mochi":
        return HardNegativeMixing(mochi_hardest, mochi_synthetic, mochi_query_synthetic)
    if mixing == "zhu":
        return FeatureTransformation(zhu_pos_alpha, zhu_neg_alpha)
    return None


class UnmixDraw(NamedTuple):
    """One Un-mix mixture: the weight ``lam`` of each crop's own pixels, and ``box`` (one slice per spatial axis)
    the region pasted from the partner crop, or None for a global mixup."""

    lam: float
    box: tuple[slice, ...] | None


def unmix_draw(crop_size: Sequence[int], alpha: float = 1.0, global_prob: float = 0.5) -> UnmixDraw:
    """Un-mix's choice of mixture for one step (Shen et al., AAAI 2022, Sec. 3; the authors run it with
    ``unmix_prob 0.5``), from torch's global RNG: ``lam ~ Beta(alpha, alpha)``; with probability ``global_prob``
    a global mixup, otherwise a region-level (CutMix) box of side ``(1 - lam)^(1/d)`` of the crop's on each of
    its ``d`` axes, centred uniformly and clipped to the crop, with ``lam`` reset to the share of the crop
    outside the box."""
    mix_globally = float(torch.rand(())) < global_prob
    lam = float(beta_sample(alpha))
    if mix_globally:
        return UnmixDraw(lam, None)
    side = (1.0 - lam) ** (1.0 / len(crop_size))
    box = []
    for n in crop_size:
        centre, half = int(torch.randint(int(n), ())), int(n * side) // 2
        box.append(slice(max(centre - half, 0), min(centre + half, int(n))))
    inside = math.prod(b.stop - b.start for b in box) / math.prod(int(n) for n in crop_size)
    return UnmixDraw(1.0 - inside, tuple(box))


def unmix_crops(crop: torch.Tensor, lam: float | torch.Tensor, box: tuple[slice, ...] | None = None) -> torch.Tensor:
    """Un-mix's image mixture (Shen et al., "Un-Mix: rethinking image mixtures for unsupervised visual
    representation learning", AAAI 2022) of each crop with the crop of the batch's reverse order: global mixup
    ``lam x_b + (1 - lam) x_{B-1-b}`` when ``box`` is None, otherwise the partner's pixels pasted in ``box``
    (region-level CutMix; ``lam`` is then the share left to ``x_b``, see :func:`unmix_draw`)."""
    if box is None:
        return lam * crop + (1 - lam) * crop.flip(0)
    mixed = crop.clone()
    region = (slice(None), slice(None), *box)
    mixed[region] = crop.flip(0)[region]
    return mixed


def unmix_loss(
    loss_function: Callable[..., torch.Tensor],
    image_features: Sequence[torch.Tensor],
    crop_features: Sequence[torch.Tensor],
    image_points: torch.Tensor,
    crop_points: torch.Tensor,
    image_size: Sequence[int],
    crop_size: Sequence[int],
    lam: float | torch.Tensor,
) -> torch.Tensor:
    """Un-mix's loss on mixed crops (Shen et al., AAAI 2022): ``lam L_own + (1 - lam) L_partner``.

    ``L_own`` pairs each mixed crop's queries with its own image's positives; ``L_partner`` the queries of the
    reverse-order partner (its crop positions and whole-image features), whose pixels are mixed in at weight
    ``1 - lam``.
    """
    own = loss_function(image_features, crop_features, image_points, crop_points, image_size, crop_size)
    partner = loss_function(
        [f.flip(0) for f in image_features],
        crop_features,
        image_points.flip(0),
        crop_points.flip(0),
        image_size,
        crop_size,
    )
    return lam * own + (1 - lam) * partner


class UnmixLoss:
    """Un-mix as the training step's ``extra_loss``: each step draws a mixture (:func:`unmix_draw`: global mixup
    with probability ``global_prob``, else a CutMix box; ``lam ~ Beta(alpha, alpha)``) from torch's global RNG,
    mixes the crops with the batch's reverse and returns the mixed crops' loss ``lam L_own + (1 - lam) L_partner``
    (:func:`unmix_loss`), which the step adds to the plain crops' loss (Un-mix keeps both branches).

    Args:
        alpha: the Beta parameter of ``lam`` (the training key ``unmix_alpha``).
        global_prob: the probability of a global mixup rather than a CutMix box (``unmix_global_prob``).
    """

    def __init__(self, alpha: float = 1.0, global_prob: float = 0.5) -> None:
        if not alpha > 0:
            raise ValueError(f"unmix_alpha must be positive, got {alpha}")
        if not 0.0 <= global_prob <= 1.0:
            raise ValueError(f"unmix_global_prob must be a probability in [0, 1], got {global_prob}")
        self.alpha, self.global_prob = float(alpha), float(global_prob)

    def __call__(
        self,
        encode_crops: Callable[[torch.Tensor], Sequence[torch.Tensor]],
        loss_function: Callable[..., torch.Tensor],
        image_features: Sequence[torch.Tensor],
        crop: torch.Tensor,
        image_points: torch.Tensor,
        crop_points: torch.Tensor,
        image_size: Sequence[int],
        crop_size: Sequence[int],
    ) -> torch.Tensor:
        draw = unmix_draw(crop.shape[2:], self.alpha, self.global_prob)
        mixed_features = encode_crops(unmix_crops(crop, draw.lam, draw.box))
        return unmix_loss(
            loss_function, image_features, mixed_features, image_points, crop_points, image_size, crop_size, draw.lam
        )


def image_mixing(mixing: str, unmix_alpha: float = 1.0, unmix_global_prob: float = 0.5) -> UnmixLoss | None:
    """The training step's ``extra_loss`` for the training key ``mixing``: :class:`UnmixLoss` for ``unmix``, None
    otherwise (an unknown value is refused, naming the key; Un-mix's keys are checked whatever the method).

    Args:
        mixing: ``none``, ``unmix``, ``mochi`` or ``zhu``.
        unmix_alpha: Un-mix's Beta parameter of the mixing weight.
        unmix_global_prob: Un-mix's probability of a global mixup rather than a CutMix box.
    """
    _checked(mixing)
    unmix = UnmixLoss(unmix_alpha, unmix_global_prob)
    return unmix if mixing == "unmix" else None
