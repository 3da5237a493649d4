"""Vision-language models of transformers (image-text-to-text): the language model under
Ulysses as any causal LM (`adapters.hf`), the vision tower inside the micro-batch's SP group
(`adapters.vlm_vision`). Trained exactly: the classes of `adapters.vlm_families` (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, InternVL, Idefics3, SmolVLM, Gemma 3, LLaVA-OneVision). Every other class with a vision tower is
refused with what is missing (`REFUSED`, or the generic reason).

One micro-batch (`vlm_loss`): the packed row's token embeddings of this rank's shard; the
images and videos encoded by the group's ranks (each item whole on one rank, dealt by patch
count in the collate, `data.vision_collate`) and their embeddings placed at the shard's
placeholder tokens; the positions computed on the whole row, then cut like the tokens
(Qwen's 3-D M-RoPE by the model's own ``get_rope_index`` per document); the language model
called with ``inputs_embeds`` and those positions; the loss only on the targets the labels
mark (the chat template's trained tokens).

``freeze_vision=True`` freezes the vision tower but its projectors (`Family.projectors`): the
tower still runs forward, its parameters get no gradient and stay out of the optimizer.

The spec of a grid-based tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) holds its `VisionTower`
(`adapters.vlm_tower`, trainable unless ``freeze_vision``), so the cost models price a
`VisionSize` sample's images; InternVL's, Idefics3's, SmolVLM's, Gemma 3's and LLaVA-OneVision's
specs have none (their tiles have one patch count).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters.base import ModelAdapter, random_tokens
from dcparallel.adapters.hf import attention_installer, causal_lm_spec, check_given_heads
from dcparallel.adapters.hf_structure import resolve
from dcparallel.adapters.vlm_families import FAMILIES, Family
from dcparallel.adapters.vlm_tower import with_tower
from dcparallel.adapters.vlm_vision import check_placeholders, group_embeddings, place
from dcparallel.data.batch import Batch
from dcparallel.data.vision_collate import collate_vision

_NO_ADAPTER = "dcparallel has no adapter for its vision inputs yet"
_FIX = (
    "train Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration, "
    "InternVLForConditionalGeneration, Idefics3ForConditionalGeneration, Gemma3ForConditionalGeneration, "
    "LlavaOnevisionForConditionalGeneration or "
    "SmolVLMForConditionalGeneration, or pass adapter=dcparallel.adapters.ModelAdapter(...) with a "
    "loss_fn that encodes its images and a parity test against the unmodified model"
)

#: vision-language classes refused: what their layout needs that dcparallel does not implement
REFUSED: dict[str, str] = {
    "MllamaForConditionalGeneration": "its cross-attention layers attend from the text to the image states "
    "(cross_attention_states); dcparallel's attention is causal self-attention over "
    "the sharded text and has no cross-attention to a second stream",
    "Qwen3VLMoeForConditionalGeneration": "its mixture-of-experts decoder under DeepStack has not been "
    "parity-tested with its vision tower (the dense "
    "Qwen3VLForConditionalGeneration trains)",
}


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def matches(model: nn.Module) -> bool:
    """A transformers model with a vision tower (its config has a ``vision_config``)."""
    return (
        type(model).__module__.startswith("transformers.")
        and getattr(getattr(model, "config", None), "vision_config", None) is not None
    )


def _refuse(model: nn.Module) -> ValueError:
    who = type(model).__name__
    why = REFUSED.get(
        who,
        f"{_NO_ADAPTER} (a vision tower whose outputs, positions and masks dcparallel has not "
        f"placed on sequence shards with a parity test)",
    )
    return ValueError(f"dcparallel cannot train the vision-language model {who}: {why}. To train it, {_FIX}")


def vlm_loss(model: nn.Module, batch: Batch, ctx: Any, *, family: Family, attn: dict[str, Any]) -> Tensor:
    """One micro-batch of a vision-language model (see the module docstring): the summed loss."""
    state = attn["fn"].state() if "fn" in attn else None
    group = state.group if state is not None else None
    cfg = model.config
    embeds = model.get_input_embeddings()(batch.inputs)  # (1, shard_len, D)
    mask = levels = None
    ex = batch.extras
    kinds = family.kinds(cfg)
    tokens = family.tokens(cfg, ex["vision_grid"]) if len(ex["vision_grid"]) else []
    check_placeholders(batch, tokens, kinds)
    if tokens:
        extra = sorted(set(ex["vision_kind"].tolist()) - set(kinds))
        if extra:
            raise ValueError(
                f"samples {batch.sample_ids} hold {'videos' if 2 in extra else 'vision items'} but "
                f"{type(model).__name__} takes only {sorted(kinds)} (1 image, 2 video); leave "
                f"pixel_values_videos out of its samples"
            )
        d = embeds.shape[-1]
        trainable = any(
            p.requires_grad for path in (family.tower, *family.projectors) for p in _get(model, path).parameters()
        )
        whole = group_embeddings(
            batch,
            group,
            lambda px, g: family.encode(model, px, g),
            tokens,
            d * (1 + family.levels(cfg)),
            embeds.dtype,
            trainable,
        )
        rows, mask = place(batch, whole.to(embeds.dtype), tokens, kinds)
        embeds = torch.where(mask[None, :, None], rows[None, :, :d], embeds)
        levels = [rows[mask][:, d * (i + 1) : d * (i + 2)] for i in range(family.levels(cfg))] or None
        mask = mask[None]
    more = {"batch": batch} if family.needs_batch else {}
    return ctx.lm_loss(family.logits(model, embeds, family.positions(model, batch), mask, levels, **more))


def text_samples(vocab: int, placeholders: list[int]):
    """The profiler's synthetic samples: random token ids, none of them a placeholder (a
    placeholder without its image is refused)."""
    draw = random_tokens(vocab)
    free = next(i for i in range(vocab) if i not in placeholders)

    def sample(size: Any, index: int) -> Tensor:
        ids = draw(size, index)
        return torch.where(torch.isin(ids, torch.tensor(placeholders)), free, ids)

    return sample


def _freeze(tower: nn.Module, projectors: list[nn.Module]) -> None:
    keep = {id(p) for m in projectors for p in m.parameters()}
    for p in tower.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


def adapter(
    model: nn.Module,
    *,
    layers=None,
    num_heads=None,
    num_kv_heads=None,
    loss_fn=None,
    sample_fn=None,
    name: str | None = None,
    freeze_vision: bool = False,
    **unused: Any,
) -> ModelAdapter:
    """``freeze_vision``: the vision tower frozen, its projector trainable."""
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        raise _refuse(model)
    if unused:
        raise ValueError(f"unexpected arguments for a vision-language model: {sorted(unused)}")
    text = _get(model, family.text)
    cfg = text.config
    blocks, attn_of, mlp_of = resolve(text, layers, None, None)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    check_given_heads(num_heads, num_kv_heads, heads, kv, config="text config", source=f"model.{family.text}.config")
    if freeze_vision:  # before the spec: its frozen_params (no gradient, no optimizer state) count the tower
        _freeze(_get(model, family.tower), [_get(model, path) for path in family.projectors])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    spec = causal_lm_spec(model, blocks, cfg, attn_of, mlp_of, name=name, heads=heads, kv=kv, head_dim=head_dim)
    spec = with_tower(spec, model, trainable=not freeze_vision)  # the Qwen-VL towers, priced per image
    placeholders = list(family.kinds(model.config).values())
    install_text = attention_installer(text, blocks, attn_of)
    attn: dict[str, Any] = {}

    def install(fn: Any) -> None:
        install_text(fn)
        attn["fn"] = fn

    def default_loss(m: nn.Module, batch: Batch, ctx: Any) -> Tensor:
        return vlm_loss(m, batch, ctx, family=family, attn=attn)

    return ModelAdapter(
        name=spec.name,
        kind="text",
        blocks=blocks,
        num_heads=heads,
        num_kv_heads=kv,
        install_attention=install,
        spec=spec,
        attn_modules=attn_of,
        mlp_modules=mlp_of,
        loss_fn=loss_fn or default_loss,
        sample=sample_fn or text_samples(cfg.vocab_size, placeholders),
        collate=collate_vision,
    )
