"""What the planner knows of a vision-language model's images before loading them (plain data,
no torch): a sample's size carrying its images' vision-tower patches (`VisionSize`), and the
vision tower as the cost model sees it (`VisionTower`). `dcparallel.spec` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass


class VisionSize(int):
    """A vision-language sample's size: its language-model tokens (text and image placeholder
    tokens; an int, like a text size) carrying `patches`, the vision-tower patches of each
    image or video in it, what the tower's cost grows with. Equal only to the same tokens and
    the same patches, so caches keyed by size never mix two samples' vision costs."""

    patches: tuple[int, ...]

    def __new__(cls, tokens: int, patches: tuple[int, ...]) -> VisionSize:
        if not patches or any(isinstance(p, bool) or int(p) != p or int(p) <= 0 for p in patches):
            raise ValueError(
                f"a vision sample has one positive integer patch count per image or video; got {tuple(patches)!r}"
            )
        self = super().__new__(cls, tokens)
        self.patches = tuple(int(p) for p in patches)
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and int(self) == int(other) and getattr(other, "patches", ()) == self.patches

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((int(self), self.patches))

    def __reduce__(self) -> tuple:
        return VisionSize, (int(self), self.patches)

    def __repr__(self) -> str:
        return f"VisionSize({int(self)}, {self.patches})"


@dataclass(frozen=True, kw_only=True)
class VisionTower:
    """A vision encoder (ViT) as the cost model sees it: `num_layers` blocks of `layer_params`
    weights each, every patch multiplying all of them; `full_layers` of the blocks attend over
    a whole image, the others within windows of `window` patches (0: every block attends over
    the whole image). `trainable` False: the tower runs forward only and keeps no activations."""

    num_layers: int
    hidden: int
    layer_params: int
    full_layers: int
    window: int = 0
    #: weights outside the blocks (patch embedding, merger / projector into the language model)
    extra_params: int = 0
    trainable: bool = True
    #: how the model's processor grids an image (Qwen2-VL family): `patch`-pixel patches,
    #: `merge` x `merge` of them per language token, the pixel count clamped to these bounds
    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384

    def __post_init__(self) -> None:
        if not 0 <= self.full_layers <= self.num_layers or self.window < 0:
            raise ValueError(
                f"a vision tower has 0..num_layers={self.num_layers} full-attention blocks and a "
                f"window >= 0; got full_layers={self.full_layers}, window={self.window}"
            )
        if self.full_layers < self.num_layers and self.window == 0:
            raise ValueError(
                f"{self.num_layers - self.full_layers} windowed blocks need window > 0 (patches "
                f"per window), or set full_layers = num_layers"
            )

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.extra_params

    def pairs(self, patches: int) -> int:
        """Query x key pairs of one image's (or video's) patches, summed over the blocks."""
        win = min(self.window, patches)
        return self.full_layers * patches * patches + (self.num_layers - self.full_layers) * patches * win
