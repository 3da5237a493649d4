"""Sizes of vision-language samples from metadata, before any image is decoded: each image's
patch grid from its width and height (given in the record, or read from the file's header:
PIL opens an image lazily and reads only its header until the pixels are asked for), by the
model's image processor's own resize rule; from the grids a sample's vision tokens (its
length for the planner: text tokens + vision tokens) and its vision cost (patches).

The resize rule is the Qwen2-VL family's (Qwen2-VL, Qwen2.5-VL: ``smart_resize`` to a
multiple of patch x merge pixels, the pixel count clamped to the processor's
``shortest_edge`` / ``longest_edge``), called from transformers, never re-implemented.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VisionItem:
    """One image's (or video's) patch grid and what follows from it."""

    grid: tuple[int, int, int]
    """(t, h, w) patches, as the processor's ``image_grid_thw`` row"""
    merge: int
    """patches merged per side into one language token"""

    @property
    def patches(self) -> int:
        """The vision tower's tokens: its cost grows with these."""
        t, h, w = self.grid
        return t * h * w

    @property
    def tokens(self) -> int:
        """The language model's placeholder tokens."""
        return self.patches // (self.merge * self.merge)


def header_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of an image file from its header; the pixels are not decoded."""
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def image_item(width: int, height: int, image_processor: Any) -> VisionItem:
    """The grid ``image_processor`` (a Qwen2-VL-family image processor) gives an image of
    ``width`` x ``height`` pixels."""
    # the PIL processor module: it needs no torchvision (the same rule as the torchvision one)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ps, merge = int(image_processor.patch_size), int(image_processor.merge_size)
    size = image_processor.size
    h, w = smart_resize(int(height), int(width), factor=ps * merge, min_pixels=size["shortest_edge"],
                        max_pixels=size["longest_edge"])
    return VisionItem((1, h // ps, w // ps), merge)


def record_items(entries: Sequence[Mapping[str, Any]], image_processor: Any,
                 root: str | Path = ".") -> list[VisionItem]:
    """The vision items of one record's image entries, each ``{"width": ..., "height": ...}``
    (pixels) or ``{"image": path}`` (relative to ``root``, read from the header) or
    ``{"grid": [t, h, w]}`` (patches, as the processor gave them: videos)."""
    merge = int(image_processor.merge_size)
    out = []
    for i, e in enumerate(entries):
        if "grid" in e:
            t, h, w = (int(x) for x in e["grid"])
            out.append(VisionItem((t, h, w), merge))
        elif "width" in e and "height" in e:
            out.append(image_item(e["width"], e["height"], image_processor))
        elif "image" in e:
            out.append(image_item(*header_size(Path(root) / e["image"]), image_processor))
        else:
            raise ValueError(f"vision entry {i} {dict(e)!r} has no size: give 'width' and 'height' (pixels), 'image' "
                             f"(a path relative to the data file) or 'grid' ([t, h, w] patches)")
    return out


def sample_length(text_tokens: int, items: Sequence[VisionItem]) -> int:
    """The planner's length of a sample: its text tokens and its images' placeholder tokens."""
    return int(text_tokens) + sum(it.tokens for it in items)
