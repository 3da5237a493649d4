"""A local vision-language model folder and a chat-with-images JSONL for `dcparallel train`,
built offline: a word-level tokenizer with the Qwen-VL special tokens and a chat template that
renders image entries as one placeholder each, Qwen2-VL's image processor (its PIL backend,
no torchvision), a tiny Qwen2.5-VL built from a config, and images drawn with PIL at three
sizes (a colored square on a gray ground: the answer is the square's color)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SPECIALS = [
    "<unk>",
    "<pad>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 220)}
WORDS = sorted(set(COLORS) | set("what color is this and say please system user assistant".split()))
#: the image sizes (width, height): patch grids (1, 8, 8), (1, 8, 12), (1, 12, 16), i.e. 16, 24
#: and 48 placeholder tokens after the 2 x 2 merge
SIZES = [(16, 16), (24, 16), (32, 24)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=2, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 16, "longest_edge": 64 * 64}
    )


def save_processor(path: Path) -> Path:
    """The tokenizer (with the chat template) and the image processor saved to ``path``."""
    tokenizer().save_pretrained(path)
    image_processor().save_pretrained(path)
    return path


def qwen25_vl_dir(path: Path, seed: int = 0) -> Path:
    """A tiny fp32 Qwen2.5-VL (2 decoder layers, a 2-block tower with window and full
    attention) and its processor saved to ``path``."""
    import transformers

    tok = tokenizer()
    ids = {
        name: tok.convert_tokens_to_ids(t)
        for name, t in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    text = dict(
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
    )
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=24,
        num_heads=2,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=32,
        in_channels=3,
        initializer_range=0.1,
        window_size=8,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").float()
    model.save_pretrained(path)
    return save_processor(path)


def draw(path: Path, size: tuple[int, int], color: str) -> None:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", size, (128, 128, 128))
    w, h = size
    ImageDraw.Draw(im).rectangle([w // 4, h // 4, 3 * w // 4, 3 * h // 4], fill=COLORS[color])
    im.save(path)


def chats(root: Path, n: int, seed: int = 0) -> list[dict]:
    """``n`` chats over images drawn into ``root/img``: one image ("what color is this" ->
    its color), two images (-> both colors), or none ("say ..." -> the words reversed)."""
    rng = random.Random(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 3:
            words = [rng.choice(sorted(COLORS)) for _ in range(rng.randint(2, 4))]
            msgs = [
                {"role": "user", "content": "say " + " ".join(words)},
                {"role": "assistant", "content": " ".join(reversed(words))},
            ]
            out.append({"messages": msgs})
            continue
        colors = [rng.choice(sorted(COLORS)) for _ in range(2 if kind == 2 else 1)]
        content = []
        for j, c in enumerate(colors):
            name = f"img/{i}_{j}.png"
            draw(root / name, SIZES[(i + j) % len(SIZES)], c)
            content.append({"type": "image", "image": name})
        content.append({"type": "text", "text": "what color is this"})
        msgs = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": " and ".join(colors)}]},
        ]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
