"""Vision-language models built from tiny configs (never downloaded) and chats made for the
parity tests: text-only samples, single images of three resolutions, several images in one
sample, a short video; each sample's trained tokens a span of its answer (as a chat template
marks the assistant's turn), never a placeholder token.

The unmodified reference runs transformers' eager attention one sample at a time, the model
computing its own M-RoPE positions from ``mm_token_type_ids`` and the grids."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from dcparallel.loss import IGNORE_INDEX
from dcparallel.spec import VisionSize

KINDS = ("qwen2.5-vl", "qwen2-vl", "qwen3-vl", "internvl", "idefics3", "smolvlm", "gemma3", "llava-ov")
#: the families whose images are fixed-size tiles; Idefics3 and SmolVLM with a pixel mask per tile;
#: Gemma 3's images each one tile of its own block
TILED, MASKED = ("internvl", "idefics3", "smolvlm", "gemma3"), ("idefics3", "smolvlm")
VOCAB = 96
IMAGE, VIDEO, START, END = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
#: (t, h, w) patch grids: images of three resolutions (4, 12 and 24 tokens after the 2 x 2
#: merge; windows of 2 x 2 merged tokens, so the 6 x 8 and 8 x 12 images have several) and a
#: video of two temporal steps (four frames at temporal patch 2)
IMAGE_GRIDS = [(1, 4, 4), (1, 6, 8), (1, 8, 12)]
VIDEO_GRID = (2, 4, 6)
PATCH_WIDTH = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
#: InternVL: square tiles of TILE pixels; an image of n tiles (the processor's dynamic tiling
#: gives 1 to many per resolution) has 4 n placeholder tokens
TILE = 8
TILES = [1, 2, 5]
#: LLaVA-OneVision: the original (H, W) of the image of each resolution of the layout; tiles of
#: TILE pixels, grid pinpoints 8 x 16, 16 x 8 and 16 x 16 (3, 3 and 5 tiles with the base view)
ANYRES_SIZES = [(6, 13), (15, 7), (14, 16)]


def build(kind: str = "qwen2.5-vl", seed: int = 0, *, freeze_vision: bool = False) -> nn.Module:
    """A tiny fp32 model of ``kind`` with eager attention in both towers: 2 decoder layers (GQA
    4/2, M-RoPE sections 1/1/2), a 2-block vision tower. Qwen2.5-VL: window attention, then
    full attention; Qwen3-VL: interleaved M-RoPE, learned position embeddings interpolated to
    each grid, one DeepStack level (after the first vision block, added after the first decoder
    layer). ``freeze_vision``: the tower frozen but its projectors (as the adapter freezes it)."""
    import transformers

    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
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
    )
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if kind == "qwen2.5-vl":
        vision |= dict(window_size=8, fullatt_block_indexes=[1], tokens_per_second=2)
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, bos_token_id=0, eos_token_id=1, pad_token_id=0, **tokens
        )
        cls, projectors = transformers.Qwen2_5_VLForConditionalGeneration, ("merger.",)
    elif kind == "qwen2-vl":  # the tower's width is embed_dim, its output hidden_size
        vision = {k: v for k, v in vision.items() if k not in ("hidden_size", "intermediate_size", "out_hidden_size")}
        vision |= dict(embed_dim=16, hidden_size=32, mlp_ratio=2)
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        cls, projectors = transformers.Qwen2VLForConditionalGeneration, ("merger.",)
    elif kind == "qwen3-vl":
        text |= dict(head_dim=8)
        text["rope_parameters"] |= {"mrope_interleaved": True}
        vision |= dict(num_position_embeddings=16, deepstack_visual_indexes=[0])
        cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        cls, projectors = transformers.Qwen3VLForConditionalGeneration, ("merger.", "deepstack_merger_list.")
    elif kind == "internvl":  # tiles of 8 x 8 pixels, patches of 2: 16 patches, 4 tokens after the shuffle
        text = {k: v for k, v in text.items() if k != "rope_parameters"} | dict(model_type="qwen2")
        vision = dict(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            image_size=TILE,
            patch_size=2,
            initializer_range=0.1,
            layer_scale_init_value=0.5,
        )
        cfg = transformers.InternVLConfig(
            text_config=text, vision_config=vision, image_token_id=IMAGE, image_seq_length=4
        )
        cls, projectors = transformers.InternVLForConditionalGeneration, ()
    elif kind in MASKED:  # the same tiles; a Llama decoder, the pixel-shuffle connector (scale 2) outside the tower
        text = {k: v for k, v in text.items() if k != "rope_parameters"} | dict(model_type="llama")
        vision = dict(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            image_size=TILE,
            patch_size=2,
            initializer_range=0.1,
        )
        config = transformers.Idefics3Config if kind == "idefics3" else transformers.SmolVLMConfig
        cfg = config(text_config=text, vision_config=vision, image_token_id=IMAGE, scale_factor=2)
        cls = getattr(transformers, config.__name__.replace("Config", "ForConditionalGeneration"))
        projectors = ()
    elif kind == "gemma3":  # sliding window 3 < an image's 4 tokens: the window cuts into image blocks
        text = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=512,
            initializer_range=0.1,
        )
        vision = dict(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            image_size=TILE,
            patch_size=2,
            vision_use_head=False,
        )  # as Gemma 3's checkpoints
        cfg = transformers.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=IMAGE,
            boi_token_index=START,
            eoi_token_index=END,
            initializer_range=0.1,
        )
        cls, projectors = transformers.Gemma3ForConditionalGeneration, ()
    elif kind == "llava-ov":  # SigLIP over 8 x 8 tiles (16 features each), a Qwen2 decoder
        text = {k: v for k, v in text.items() if k != "rope_parameters"} | dict(model_type="qwen2")
        vision = dict(
            model_type="siglip_vision_model",
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            image_size=TILE,
            patch_size=2,
            vision_use_head=False,
        )
        cfg = transformers.LlavaOnevisionConfig(
            text_config=text,
            vision_config=vision,
            image_token_index=IMAGE,
            video_token_index=VIDEO,
            vision_feature_layer=-1,
            image_grid_pinpoints=[[8, 16], [16, 8], [16, 16]],
        )
        cls, projectors = transformers.LlavaOnevisionForConditionalGeneration, ()
    else:
        raise ValueError(f"unknown family {kind!r}; one of {KINDS}")
    model = cls._from_config(cfg, attn_implementation="eager").float()
    if freeze_vision:
        for name, p in tower(model).named_parameters():
            p.requires_grad_(name.startswith(projectors))
    return model


def tower(model: nn.Module) -> nn.Module:
    """The vision tower (InternVL's projector and Idefics3's connector are outside it)."""
    for name in ("visual", "vision_tower", "vision_model"):  # Gemma 3's projector is outside its tower
        if hasattr(model.model, name):
            return getattr(model.model, name)
    raise ValueError(f"{type(model).__name__} has no vision tower")


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, VOCAB - 4) for _ in range(n)]


def _video_tokens(rng: random.Random, grid: tuple, timestamps: bool) -> list[int]:
    """A video's placeholders: one block, or (Qwen3-VL) one block per temporal step, each
    after its timestamp's text tokens."""
    per_step = [START] + [VIDEO] * (grid[1] * grid[2] // 4) + [END]
    if not timestamps:
        return [START] + [VIDEO] * (grid[0] * grid[1] * grid[2] // 4) + [END]
    return [t for _ in range(grid[0]) for t in _text(rng, 2) + per_step]


def _sample(rng: random.Random, images: list[tuple], video: tuple | None, timestamps: bool) -> dict:
    ids, pix, vpix = _text(rng, rng.randint(2, 6)), [], []
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for grid in images:
        ids += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END] + _text(rng, rng.randint(1, 4))
        pix.append(torch.randn(grid[0] * grid[1] * grid[2], PATCH_WIDTH, generator=g))
    if video is not None:
        ids += _video_tokens(rng, video, timestamps) + _text(rng, 2)
        vpix.append(torch.randn(video[0] * video[1] * video[2], PATCH_WIDTH, generator=g))
    prompt = len(ids)
    ids += _text(rng, rng.randint(3, 9))  # the answer: its tokens are the targets
    labels = [IGNORE_INDEX] * len(ids)
    for i in range(prompt - 1, len(ids) - 1):
        labels[i] = ids[i + 1]
    out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
    if images:
        out |= {"pixel_values": torch.cat(pix), "image_grid_thw": torch.tensor(images)}
    if video is not None:
        out |= {"pixel_values_videos": torch.cat(vpix), "video_grid_thw": torch.tensor([video])}
        if not timestamps:
            out["second_per_grid_ts"] = torch.tensor([0.5])
    return out


def _tiled_sample(
    rng: random.Random,
    images: list[tuple],
    video: tuple | None,
    timestamps: bool,
    masked: bool = False,
    single: bool = False,
) -> dict:
    """InternVL: image i of the layout as TILES[its resolution's index] tiles (no videos).
    ``masked`` (Idefics3, SmolVLM; with the processor's batch dim of 1): a ``pixel_attention_mask``
    too, each image's last tile (its global view, resized) padded on the right by 2 to 4 pixel
    columns (zero pixels, zero mask), and after several images an all-zero padding tile that
    has no placeholders (the model drops it). ``single`` (Gemma 3): each image one tile, its 4
    placeholders in their own block, whatever the resolution of the layout."""
    ids, pix, masks = _text(rng, rng.randint(2, 6)), [], []
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for grid in images:
        n = 1 if single else TILES[IMAGE_GRIDS.index(tuple(grid))]
        ids += [START] + [IMAGE] * (4 * n) + [END] + _text(rng, rng.randint(1, 4))
        tiles, mask = torch.randn(n, 3, TILE, TILE, generator=g), torch.ones(n, TILE, TILE, dtype=torch.long)
        if masked:
            mask[-1, :, TILE - rng.randint(2, 4) :] = 0
        pix.append(tiles * mask[:, None])
        masks.append(mask)
    if masked and len(images) > 1:
        pix.append(torch.zeros(1, 3, TILE, TILE))
        masks.append(torch.zeros(1, TILE, TILE, dtype=torch.long))
    prompt = len(ids)
    ids += _text(rng, rng.randint(3, 9))
    labels = [IGNORE_INDEX] * (prompt - 1) + ids[prompt:] + [IGNORE_INDEX]
    out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
    if images:
        out["pixel_values"] = torch.cat(pix)
    if images and masked:
        out["pixel_values"], out["pixel_attention_mask"] = out["pixel_values"][None], torch.cat(masks)[None]
    return out


def _anyres_sample(rng: random.Random, images: list[tuple], video: tuple | None, timestamps: bool) -> dict:
    """LLaVA-OneVision: image i of the layout at ANYRES_SIZES[its resolution's index], its tiles
    padded (zeros) to the sample's most; a sample of two images carries ``batch_num_images``
    (the model then encodes their base views only, as its processor asks), one of three does
    not (each image tiled). Its placeholder count is what ``pack_image_features`` gives."""
    from dcparallel.adapters.vlm_llava import _used_tiles, llava_tokens

    cfg = _llava_config()
    sizes = [ANYRES_SIZES[IMAGE_GRIDS.index(tuple(grid))] for grid in images]
    base = len(images) == 2
    grids = torch.tensor([[1 if base else 2, h, w] for h, w in sizes]).reshape(-1, 3)
    tiles = [_used_tiles(cfg, g) for g in grids.tolist()]
    ids, pix = _text(rng, rng.randint(2, 6)), torch.zeros(len(images), max(tiles, default=1), 3, TILE, TILE)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for i, n in enumerate(llava_tokens(cfg, grids) if images else []):
        ids += [IMAGE] * n + _text(rng, rng.randint(1, 4))
        pix[i, : tiles[i]] = torch.randn(tiles[i], 3, TILE, TILE, generator=g)
    prompt = len(ids)
    ids += _text(rng, rng.randint(3, 9))
    labels = [IGNORE_INDEX] * (prompt - 1) + ids[prompt:] + [IGNORE_INDEX]
    out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
    if images:
        out |= {"pixel_values": pix, "image_sizes": torch.tensor(sizes)}
    if base:
        out["batch_num_images"] = torch.tensor([2])
    return out


def make_data(num_samples: int, seed: int, kind: str = "qwen2.5-vl") -> SimpleNamespace:
    """The mix, shuffled by ``seed``: text-only, each image resolution alone, two and three
    images in one sample, a video (with an image before it), repeated to ``num_samples``."""
    rng = random.Random(seed)
    layouts = [
        ([], None),
        ([IMAGE_GRIDS[0]], None),
        ([IMAGE_GRIDS[1]], None),
        ([IMAGE_GRIDS[2]], None),
        ([IMAGE_GRIDS[0], IMAGE_GRIDS[2]], None),
        ([], VIDEO_GRID),
        (IMAGE_GRIDS, None),
        ([IMAGE_GRIDS[1]], VIDEO_GRID),
        ([], None),
    ]
    rng.shuffle(layouts)
    if kind == "llava-ov":  # images only
        layouts = [(im, None) for im, _ in layouts]
    samples = [
        _anyres_sample(rng, *layouts[i % len(layouts)], False)
        if kind == "llava-ov"
        else _tiled_sample(rng, *layouts[i % len(layouts)], False, kind in MASKED, kind == "gemma3")
        if kind in TILED
        else _sample(rng, *layouts[i % len(layouts)], timestamps=kind == "qwen3-vl")
        for i in range(num_samples)
    ]
    if kind != "qwen2.5-vl":  # only Qwen2.5-VL's positions take seconds per temporal step
        for s in samples:
            s.pop("second_per_grid_ts", None)
    # random_plan packs text-kind samples (micro-batches of 1-3 documents)
    return SimpleNamespace(kind="hf-vlm", samples=samples, docs=[s["input_ids"] for s in samples])


def size(sample: dict) -> int | VisionSize:
    """The planner's size of a sample: its tokens carrying each image's and video's tower
    patches (`VisionSize`, as `data.vlm_data` gives a chat's), its tokens without any."""
    grids = [g for k in ("image_grid_thw", "video_grid_thw") if k in sample for g in sample[k].tolist()]
    n = len(sample["input_ids"])
    return VisionSize(n, tuple(t * h * w for t, h, w in grids)) if grids else n


def item(data: SimpleNamespace, sid: int) -> dict:
    return data.samples[sid]


def reference(model: nn.Module, data: SimpleNamespace, sample_ids) -> tuple[float, dict]:
    """Mean loss over every target of the samples, one sample at a time through the unmodified
    model, and the gradients of its trainable parameters."""
    model.zero_grad(set_to_none=True)
    losses, count = [], 0
    for sid in sample_ids:
        s = data.samples[sid]
        ids = s["input_ids"][None]
        kw = {
            k: s[k]
            for k in (
                "pixel_values",
                "image_grid_thw",
                "pixel_values_videos",
                "video_grid_thw",
                "second_per_grid_ts",
                "pixel_attention_mask",
                "image_sizes",
                "batch_num_images",
            )
            if k in s
        }
        if "Qwen" in type(model).__name__:  # the model computes its M-RoPE positions from these
            kw["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        if "Gemma3" in type(model).__name__:  # its image tokens' bidirectional mask
            kw["token_type_ids"] = (ids == IMAGE).long()
        logits = model(input_ids=ids, use_cache=False, **kw).logits
        losses.append(F.cross_entropy(logits[0].float(), s["labels"], ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((s["labels"] != IGNORE_INDEX).sum())
    loss = torch.stack(losses).sum() / count
    loss.backward()
    # a parameter the forward never reads (LLaVA-OneVision's tower's post_layernorm: its features are
    # the last hidden state before it) has a zero gradient
    return float(loss.detach()), {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _llava_config():
    """The tiny LLaVA-OneVision's config (built once: the samples' placeholder counts)."""
    global _LLAVA
    if _LLAVA is None:
        _LLAVA = build("llava-ov").config
    return _LLAVA


_LLAVA = None
