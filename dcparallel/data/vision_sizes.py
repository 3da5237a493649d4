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

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dcparallel.spec import Size, VisionSize, VisionTower


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
    h, w = smart_resize(
        int(height), int(width), factor=ps * merge, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
    )
    return VisionItem((1, h // ps, w // ps), merge)


def record_items(
    entries: Sequence[Mapping[str, Any]], image_processor: Any, root: str | Path = "."
) -> list[VisionItem]:
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
            raise ValueError(
                f"vision entry {i} {dict(e)!r} has no size: give 'width' and 'height' (pixels), 'image' "
                f"(a path relative to the data file) or 'grid' ([t, h, w] patches)"
            )
    return out


def sample_length(text_tokens: int, items: Sequence[VisionItem]) -> int:
    """The planner's length of a sample: its text tokens and its images' placeholder tokens."""
    return int(text_tokens) + sum(it.tokens for it in items)


def tower_processor(tower: VisionTower) -> SimpleNamespace:
    """The image-processor fields `image_item` reads, from a `VisionTower`'s grid rule (a
    preset without a model folder: `simulate --model qwen2.5-vl-7b`)."""
    return SimpleNamespace(
        patch_size=tower.patch,
        merge_size=tower.merge,
        size={"shortest_edge": tower.min_pixels, "longest_edge": tower.max_pixels},
    )


def read_vision_lengths(path: str | Path, tower: VisionTower) -> list[Size]:
    """A vision-language lengths file (JSONL): one sample a line, ``{"text": tokens, "vision":
    [entry, ...]}``, each entry as `record_items` reads it (``{"width": w, "height": h}`` pixels,
    ``{"image": path}`` or ``{"grid": [t, h, w]}`` patches, e.g. a video). A sample with
    entries is a `VisionSize` (text + placeholder tokens, each entry's patches), one without
    a text size (its tokens)."""
    p = Path(path)
    proc, out = tower_processor(tower), []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            text = rec["text"]
            if isinstance(text, bool) or not isinstance(text, int) or text < 0:
                raise ValueError(f"'text' is a token count >= 0, got {text!r}")
            items = record_items(rec.get("vision", []), proc, root=p.parent)
            size = sample_length(text, items)
            if size <= 0:
                raise ValueError("the sample has no tokens")
            out.append(VisionSize(size, tuple(it.patches for it in items)) if items else size)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f'{p}:{lineno}: {exc!s}; a line is {{"text": tokens, "vision": [{{"width": w, '
                f'"height": h}} | {{"image": path}} | {{"grid": [t, h, w]}}, ...]}}'
            ) from None
    if not out:
        raise ValueError(f"lengths file {p} holds no samples; one JSON object a line")
    return out
