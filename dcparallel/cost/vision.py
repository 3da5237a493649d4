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

Measured instead (`VisionTable`, from `profile.vision`): the tower's seconds and kept bytes of
one image per patch bucket, fitted by least squares with non-negative coefficients to the
same two terms, seconds per patch and per attention pair (`VisionPrice.from_table`), so a
micro-batch is priced by the same arithmetic, scalar or array, from measured coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class VisionTable:
    """The vision tower measured per image-patch bucket: one image of ``patches[i]`` patches
    took ``seconds[i]`` (forward and backward; a frozen tower: what it runs, forward and its
    projector's backward) and kept ``kept_bytes[i]`` for backward. ``trainable``: measured
    with the tower trainable."""

    patches: tuple[int, ...]
    seconds: tuple[float, ...]
    kept_bytes: tuple[float, ...]
    trainable: bool

    def __post_init__(self) -> None:
        n = len(self.patches)
        if n < 2 or len(self.seconds) != n or len(self.kept_bytes) != n or len(set(self.patches)) != n:
            raise ValueError(
                f"a vision table needs two or more distinct patch buckets, one time and one byte count "
                f"each; got patches {self.patches}, seconds {self.seconds}, bytes {self.kept_bytes}"
            )
        if min(self.patches) <= 0 or min(self.seconds) <= 0 or min(self.kept_bytes) < 0:
            raise ValueError(f"a vision table's patches and seconds are positive, its bytes >= 0; got {self}")

    def to_json(self) -> dict:
        return {
            "patches": list(self.patches),
            "seconds": list(self.seconds),
            "kept_bytes": list(self.kept_bytes),
            "trainable": self.trainable,
        }

    @staticmethod
    def from_json(d: dict) -> VisionTable:
        return VisionTable(
            tuple(int(p) for p in d["patches"]),
            tuple(float(t) for t in d["seconds"]),
            tuple(float(b) for b in d["kept_bytes"]),
            bool(d["trainable"]),
        )


def fit_nonnegative(x1: Sequence[float], x2: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(a, b) >= 0 minimizing the squared error of ``y ~ a x1 + b x2``: the unconstrained least
    squares where both are >= 0, else the better of the two one-term fits."""
    X, Y = np.column_stack([x1, x2]).astype(np.float64), np.asarray(y, dtype=np.float64)
    (a, b), *_ = np.linalg.lstsq(X, Y, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    fits = []
    for col in (0, 1):
        x = X[:, col]
        k = max(0.0, float(x @ Y / (x @ x))) if x @ x > 0 else 0.0
        fits.append((float(((Y - k * x) ** 2).sum()), col, k))
    _, col, k = min(fits)
    return (k, 0.0) if col == 0 else (0.0, k)


class VisionPrice:
    """Seconds and kept bytes of the vision tower for one rank of a group: analytic, scaled
    from the language model's calibration, or measured (`from_table`)."""

    def __init__(
        self,
        tower: VisionTower,
        lin_s_per_param_token: float,
        attn_s_per_pair_hidden: float,
        act_bytes_per_token_hidden: float,
    ):
        passes = 1.0 if tower.trainable else 1.0 / 3.0
        self.s_per_patch = lin_s_per_param_token * tower.layer_params * tower.num_layers * passes
        self.s_per_pair = attn_s_per_pair_hidden * tower.hidden * passes
        self.bytes_per_patch = act_bytes_per_token_hidden * tower.hidden * tower.num_layers if tower.trainable else 0.0
        self.bytes_per_pair = 0.0

    @classmethod
    def from_table(cls, tower: VisionTower, table: VisionTable) -> VisionPrice:
        """Coefficients fitted to a measured table: seconds and bytes per patch and per pair
        (`VisionTower.pairs` of each bucket's one image)."""
        if table.trainable != tower.trainable:

            def what(t: bool) -> str:
                return "trainable" if t else "frozen"

            raise ValueError(
                f"the vision tower was measured {what(table.trainable)} but is planned "
                f"{what(tower.trainable)}; profile it as it trains (freeze_vision as in the run)"
            )
        self = cls.__new__(cls)
        pairs = [tower.pairs(p) for p in table.patches]
        self.s_per_patch, self.s_per_pair = fit_nonnegative(table.patches, pairs, table.seconds)
        self.bytes_per_patch, self.bytes_per_pair = fit_nonnegative(table.patches, pairs, table.kept_bytes)
        return self

    def rank_work(self, stats, sp, array: bool) -> tuple:
        """(patches, pairs) the slowest rank of an `sp` group encodes, of a micro-batch whose
        `stats` are (patches, pairs, largest item's patches, its pairs), summed."""
        p, q, mp, mq = stats
        big = np.maximum if array else max
        return big(p / sp, mp), big(q / sp, mq)

    def time(self, vp, vq):
        return vp * self.s_per_patch + vq * self.s_per_pair

    def kept_bytes(self, vp, vq):
        return vp * self.bytes_per_patch + vq * self.bytes_per_pair


def vision_price(
    model: ModelSpec,
    table: VisionTable | None,
    lin_s_per_param_token: float,
    attn_s_per_pair_hidden: float,
    act_bytes_per_token_hidden: float,
) -> VisionPrice | None:
    """The tower's price of a model: measured where a table is given, else scaled from the
    calibration's constants; None for a model without a tower."""
    if model.vision is None:
        if table is not None:
            raise ValueError(
                f"a measured vision table was given, but the model {model.name!r} has no vision tower "
                f"(ModelSpec.vision); leave the table out"
            )
        return None
    if table is not None:
        return VisionPrice.from_table(model.vision, table)
    return VisionPrice(model.vision, lin_s_per_param_token, attn_s_per_pair_hidden, act_bytes_per_token_hidden)


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
