"""The vision tower's share of a micro-batch's cost: a vision-language sample's images are
encoded by the ranks of its SP group, each image (or video) whole on one rank, dealt largest
first to the least-loaded rank (`data.vision_collate.deal_by_patches`). The group waits for
its slowest rank, which encodes about 1/sp of the patches, or the largest image whole when
that is more: per rank ``max(patches / sp, largest image's patches)``, and likewise for the
attention pairs. Scaled from the language model's calibration as `AnalyticCost` scales any
block: linear time by the weights each patch multiplies, attention time by the tower's
hidden size, kept activations by it too. The tower is not recomputed (the planner's recompute
counts are the language model's layers); a frozen tower runs forward only (a third of forward
+ backward, the usual 1 : 2 split) and keeps nothing for backward.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dcparallel.spec import ModelSpec, Size, VisionSize, VisionTower


def sample_vision(tower: VisionTower, size: Size) -> tuple[int, int, int, int]:
    """(patches, attention pairs, the largest item's patches, its pairs) of one sample; zeros
    for a sample without images."""
    if not isinstance(size, VisionSize):
        return 0, 0, 0, 0
    pairs = [tower.pairs(p) for p in size.patches]
    return sum(size.patches), sum(pairs), max(size.patches), max(pairs)


def vision_stats(model: ModelSpec, sizes: Sequence[Size]) -> np.ndarray | None:
    """`sample_vision` of each sample as an (n, 4) int64 array, or None for a model without a
    vision tower."""
    if model.vision is None:
        return None
    cache = {s: sample_vision(model.vision, s) for s in set(sizes)}
    return np.array([cache[s] for s in sizes], dtype=np.int64).reshape(len(sizes), 4)


class VisionPrice:
    """Seconds and kept bytes of the vision tower for one rank of a group."""

    def __init__(self, tower: VisionTower, lin_s_per_param_token: float, attn_s_per_pair_hidden: float,
                 act_bytes_per_token_hidden: float):
        passes = 1.0 if tower.trainable else 1.0 / 3.0
        self.s_per_patch = lin_s_per_param_token * tower.layer_params * tower.num_layers * passes
        self.s_per_pair = attn_s_per_pair_hidden * tower.hidden * passes
        self.bytes_per_patch = act_bytes_per_token_hidden * tower.hidden * tower.num_layers if tower.trainable else 0.0

    def rank_work(self, stats, sp, array: bool) -> tuple:
        """(patches, pairs) the slowest rank of an `sp` group encodes, of a micro-batch whose
        `stats` are (patches, pairs, largest item's patches, its pairs), summed."""
        p, q, mp, mq = stats
        big = np.maximum if array else max
        return big(p / sp, mp), big(q / sp, mq)

    def time(self, vp, vq):
        return vp * self.s_per_patch + vq * self.s_per_pair

    def kept_bytes(self, vp):
        return vp * self.bytes_per_patch


def class_rep(sizes: Sequence[Size], tokens: Sequence[int]) -> Size:
    """The size that sizes a class's layouts (copies of it must fit for any of its members to):
    its member of most `tokens` (the first of equals); of a class holding vision samples, a size
    no member exceeds in tokens or in its k-th largest image for any k: the most tokens, and as
    k-th largest image the largest k-th largest image of any member. Every term of a micro-batch
    (`sample_vision`'s patches, pairs and largest image) only grows with each, so such a size
    costs at least as much as any member, at every degree and count."""
    i = max(range(len(sizes)), key=tokens.__getitem__)
    if not any(isinstance(s, VisionSize) for s in sizes):
        return sizes[i]
    items: list[int] = []
    for s in sizes:
        for k, p in enumerate(sorted(getattr(s, "patches", ()), reverse=True)):
            if k == len(items):
                items.append(p)
            else:
                items[k] = max(items[k], p)
    return VisionSize(int(tokens[i]), tuple(items))
