"""`dcparallel train` on a vision-language model: a local pretrained transformers folder whose
config has a ``vision_config`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the classes
`adapters.vlm_families` trains exactly), fine-tuned on a chat-with-images JSONL
(`data.vlm_data`).

The folder's processor is read as its parts, each with ``from_pretrained``: the tokenizer
(with the chat template the processor saved beside it) and the image processor. transformers'
``AutoProcessor`` of the Qwen-VL classes also builds a video processor, which needs
torchvision; the parts need neither it nor videos, and the export writes them back with
``save_pretrained`` beside the processor's own files (`VlmProcessor.save_pretrained`), so
``AutoProcessor.from_pretrained(export)`` loads where torchvision is installed.

Refused with the fix: LoRA on a vision-language model, a fixed ``shard_size`` > 1 (the
model would be built on the meta device and loaded shard by shard, which is not tested with a
vision tower), ``[data] format = "text"`` and an image processor whose resize rule
`data.vision_sizes` does not know (it must give each image's grid before decoding).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dcparallel.apps.train_config import Config

#: the processor's files besides the tokenizer's and the image processor's, copied verbatim
PROCESSOR_FILES = (
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


@dataclass
class VlmProcessor:
    """The parts of a vision-language folder's processor that `dcparallel train` uses."""

    tokenizer: Any
    image_processor: Any
    source: Path
    """the folder they were read from"""

    def save_pretrained(self, path: str | Path) -> None:
        """The tokenizer, the image processor and the source folder's other processor files."""
        path = Path(path)
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        for name in PROCESSOR_FILES:
            if (self.source / name).is_file() and not (path / name).exists():
                shutil.copyfile(self.source / name, path / name)


def check_vlm_config(cfg: Config, where: str = "config") -> None:
    """What `dcparallel train` does not do with a vision-language model, refused with the fix."""
    if cfg.lora.rank:
        raise ValueError(
            f"{where}: [lora] rank = {cfg.lora.rank} with the vision-language model "
            f"{cfg.model.pretrained}: LoRA is not tested with a vision tower in dcparallel train; "
            f"fine-tune the whole model (remove [lora]) or freeze the tower ([model] freeze_vision = "
            f"true)"
        )
    s = cfg.train.shard_size
    if isinstance(s, int) and s > 1:
        raise ValueError(
            f"{where}: [train] shard_size = {s} with the vision-language model {cfg.model.pretrained}: "
            f"parameter sharding is not tested with a vision tower; use shard_size = 1"
        )
    if cfg.data.format == "text":
        raise ValueError(
            f'{where}: [data] format = "text" with the vision-language model {cfg.model.pretrained}; it '
            f'trains on chats with images: format = "chat" (or leave format out)'
        )


def load_processor(folder: str | Path) -> VlmProcessor:
    """The folder's tokenizer (with its chat template) and image processor."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    try:
        known = all(getattr(image_processor, k) for k in ("patch_size", "merge_size")) and all(
            image_processor.size[k] for k in ("shortest_edge", "longest_edge")
        )
    except (AttributeError, KeyError, TypeError):
        known = False
    if not known:
        raise ValueError(
            f"{folder}: the image processor {type(image_processor).__name__} has no Qwen-VL resize rule "
            f"(patch_size, merge_size, size shortest_edge / longest_edge), so images cannot be sized "
            f"before decoding; dcparallel train takes Qwen2-VL / Qwen2.5-VL / Qwen3-VL folders"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{folder}: the tokenizer has no chat template; save the processor with its chat_template")
    return VlmProcessor(tokenizer, image_processor, Path(folder))


def load_vlm(cfg: Config, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, VlmProcessor]:
    """The pretrained vision-language model on ``device`` in ``dtype``, and its processor."""
    from transformers import AutoModelForImageTextToText

    check_vlm_config(cfg)
    processor = load_processor(cfg.model.pretrained)
    model = AutoModelForImageTextToText.from_pretrained(
        cfg.model.pretrained, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device), processor


def image_token_id(folder: str | Path) -> int:
    """The model's image placeholder token, from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    token = getattr(config, "image_token_id", None)
    if token is None:
        raise ValueError(f"{folder}: its config has no image_token_id; dcparallel train takes Qwen-VL folders")
    return int(token)


def read_vlm_data(cfg: Config, processor: VlmProcessor) -> tuple[Any, list[int]]:
    """The chat-with-images dataset of [data] path and its samples' token counts."""
    from dcparallel.data.vlm_data import vlm_dataset

    d = cfg.data
    return vlm_dataset(
        d.path,
        processor.tokenizer,
        processor.image_processor,
        image_token_id=image_token_id(cfg.model.pretrained),
        field=d.field or None,
        max_tokens=d.max_tokens or None,
        skip_bad=d.skip_bad,
    )
