"""Vision-language chat datasets: a JSONL file in the common chat-with-images layout, one
conversation a line, its lengths known before any image is decoded.

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/cat.png"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": "A cat."}]}

A message's ``content`` is a string or a list of entries: ``{"type": "text", "text": ...}`` or
``{"type": "image", "image": path}`` (relative to the data file; optional ``"width"`` and
``"height"`` in pixels spare reading the file's header). Images belong to user / system turns;
an image in an assistant turn, and a video entry, are bad samples named with their line
(dcparallel does not decode videos for `dcparallel train`).

Reading the file (`vlm_dataset`) renders each conversation with the tokenizer's chat
template, finds the assistant tokens exactly as `text_data.chat_tokens` does (the loss counts
only those), takes each image's patch grid from its size by the image processor's own resize
rule (`vision_sizes.record_items`: the header, never the pixels) and expands each image's one
placeholder token to the grid's tokens (patches / merge², the rule of transformers' Qwen-VL
processors). A sample's size is its expanded token count carrying its images' tower patches
(`sample_size`, a `VisionSize`): the epoch is planned before any image is decoded, with both
towers priced. Images are taken in the order of their entries in the messages, as the
processor takes them, and the template must render one placeholder per image entry (else the
sample is bad).

Items (`VlmDataset.__getitem__`, run in the loader's DataLoader workers where it has some)
decode the sample's images and run the image processor: ``{"input_ids", "labels",
"pixel_values", "image_grid_thw"}`` as `vision_collate.collate_vision` takes them; a decoded
image whose grid differs from its header's is an error naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcparallel.data.readers import BadData, read_rows
from dcparallel.data.text_data import BadSample, chat_tokens, masked_labels
from dcparallel.data.vision_sizes import record_items
from dcparallel.loss import IGNORE_INDEX
from dcparallel.vision_spec import VisionSize

ENTRY_KEYS = ("image", "width", "height")


@dataclass(frozen=True)
class VlmSample:
    """One conversation, tokenized with its placeholders expanded, and its images."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    """next-token targets aligned with the inputs: assistant tokens only, else IGNORE_INDEX"""
    images: tuple[str, ...]
    """the image files, in placeholder order"""
    grids: tuple[tuple[int, int, int], ...]
    """each image's (t, h, w) patch grid, from its size"""


def _image_entries(messages: Any, field: str) -> list[dict]:
    """The conversation's image entries in order, after checking its layout (`BadSample`)."""
    if not isinstance(messages, list) or not messages:
        raise BadSample(f"'{field}' must be a non-empty list of {{'role', 'content'}} messages, not {messages!r:.60}")
    images = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadSample(f"message {j} of '{field}' is not a {{'role', 'content'}} mapping: {m!r:.60}")
        content = m["content"]
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not content:
            raise BadSample(f"message {j} ({m['role']}): content must be a string or a non-empty list of entries")
        for e in content:
            kind = e.get("type") if isinstance(e, dict) else None
            if kind == "text" and isinstance(e.get("text"), str):
                continue
            if kind == "video":
                raise BadSample(
                    f"message {j} ({m['role']}) holds a video entry; dcparallel train reads images "
                    f"only: give the video's frames as images, or leave the sample out"
                )
            if kind != "image" or not isinstance(e.get("image"), str):
                raise BadSample(
                    f"message {j} ({m['role']}): entry {e!r:.60} is neither {{'type': 'text', 'text': "
                    f"...}} nor {{'type': 'image', 'image': 'path'}}"
                )
            if m["role"] == "assistant":
                raise BadSample(
                    f"message {j} (assistant) holds an image; the loss trains assistant tokens, so "
                    f"images belong to user or system turns"
                )
            images.append({k: e[k] for k in ENTRY_KEYS if k in e})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadSample("the conversation has no assistant message: nothing to learn")
    return images


def encode_vlm(
    value: dict,
    field: str,
    tokenizer: Any,
    image_processor: Any,
    image_token_id: int,
    root: Path,
    max_tokens: int | None = None,
) -> VlmSample:
    """One record as a `VlmSample` (module docstring), or `BadSample` saying why it cannot be
    trained on. No image is decoded: grids come from the entries' sizes or the files' headers."""
    if field not in value or value[field] is None:
        raise BadSample(f"no '{field}' field (fields: {sorted(value)}; another field is named by [data] field)")
    entries = _image_entries(value[field], field)
    missing = [e["image"] for e in entries if not (root / e["image"]).is_file()]
    if missing:
        raise BadSample(f"image file(s) {missing} not found (paths are relative to the data file, {root})")
    try:
        items = record_items(entries, image_processor, root=root)
    except OSError as exc:
        raise BadSample(f"cannot read an image's header: {exc}") from None
    ids, mask = chat_tokens(tokenizer, value[field])
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(items):
        raise BadSample(
            f"the chat template rendered {len(at)} image placeholder token(s) (id {image_token_id}) for "
            f"{len(items)} image entries; each image entry needs exactly one"
        )
    out_ids: list[int] = []
    out_mask: list[bool] = []
    for i, (t, a) in enumerate(zip(ids, mask, strict=True)):
        n = items[at.index(i)].tokens if t == image_token_id else 1
        out_ids += [t] * n
        out_mask += [a and t != image_token_id] * n
    if max_tokens is not None and len(out_ids) > max_tokens:
        raise BadSample(
            f"{len(out_ids)} tokens (text and image placeholders) > max_tokens = {max_tokens}; a chat "
            f"with images is not cut (an image's placeholders would be): raise max_tokens or shrink it"
        )
    labels = masked_labels(out_ids[1:], out_mask[1:])
    if all(x == IGNORE_INDEX for x in labels):
        raise BadSample("no assistant token after the first: nothing to learn")
    return VlmSample(
        tuple(out_ids), tuple(labels), tuple(str(root / e["image"]) for e in entries), tuple(it.grid for it in items)
    )


class VlmDataset:
    """Map-style dataset of a chat-with-images file's good rows; items as the module says."""

    def __init__(self, samples: Sequence[VlmSample], wheres: Sequence[str], image_processor: Any):
        self.samples, self.wheres, self.image_processor = list(samples), list(wheres), image_processor

    def __len__(self) -> int:
        return len(self.samples)

    def where(self, i: int) -> str:
        return self.wheres[i]

    def __getitem__(self, i: int) -> dict:
        import torch
        from PIL import Image

        s = self.samples[i]
        item = {
            "input_ids": torch.tensor(s.input_ids, dtype=torch.long),
            "labels": torch.tensor(s.labels, dtype=torch.long),
        }
        if not s.images:
            return item
        pictures = []
        for path in s.images:
            with Image.open(path) as im:
                pictures.append(im.convert("RGB"))
        out = self.image_processor(images=pictures, return_tensors="pt")
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        if grids != list(s.grids):
            bad = next(j for j, (a, b) in enumerate(zip(grids, s.grids, strict=True)) if a != b)
            raise ValueError(
                f"{self.wheres[i]}: image {s.images[bad]} decodes to the patch grid {grids[bad]}, but its "
                f"size in the record or header gave {s.grids[bad]}; fix its width / height"
            )
        return item | {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def vlm_dataset(
    path: str | Path,
    tokenizer: Any,
    image_processor: Any,
    *,
    image_token_id: int,
    field: str | None = None,
    max_tokens: int | None = None,
    skip_bad: bool = False,
) -> tuple[VlmDataset, list[int]]:
    """The dataset of a chat-with-images file (JSONL, or any format `read_rows` reads) and
    every sample's size (`sample_size`: text and image placeholder tokens, and each image's
    patches), from metadata only. Bad samples
    raise one error naming each (file:line), or are dropped and logged with ``skip_bad``."""
    p = Path(path)
    field = field or "messages"
    rows = read_rows(p)
    if not rows:
        raise ValueError(f"{p} holds no samples")
    if not any(field in r.value for r in rows):
        raise ValueError(
            f"{p}: no row has the field '{field}' (the first row's fields: {sorted(rows[0].value)}); "
            f'name the field: [data] field = "..."'
        )
    bad = BadData(str(p), skip_bad)
    good: list[tuple[str, VlmSample]] = []
    for row in rows:
        try:
            good.append(
                (
                    row.where,
                    encode_vlm(row.value, field, tokenizer, image_processor, image_token_id, p.parent, max_tokens),
                )
            )
        except BadSample as exc:
            bad.add(row.where, str(exc))
    bad.finish(len(rows))
    if not good:
        raise ValueError(f"{p}: every one of its {len(rows)} samples is bad")
    ds = VlmDataset([s for _, s in good], [w for w, _ in good], image_processor)
    return ds, [sample_size(s) for _, s in good]


def sample_size(s: VlmSample) -> int | VisionSize:
    """The planner's size of a sample: its token count, carrying each image's tower patches
    (t x h x w of its grid) when it has images (`VisionSize`), so the cost model prices both
    towers; a text-only chat is its token count."""
    if not s.grids:
        return len(s.input_ids)
    return VisionSize(len(s.input_ids), tuple(t * h * w for t, h, w in s.grids))
