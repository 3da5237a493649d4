"""Vision-language models without a process group: the dealing of images to an SP group's
ranks, the collate's vision items (tiles with their pixel masks), why the parity test's
positions and placement matter (M-RoPE positions change the loss, so a model called with
per-document positions could not pass), single-process exactness with packed chats, and the
refusal of every other vision-language class with its reason (built on the meta device: no
weights)."""

from __future__ import annotations

import pytest
import torch

from dcparallel.adapters import find_adapter
from dcparallel.data.vision_collate import collate_vision, deal_by_patches
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from dcparallel.spec import Layout, Recompute
from tests import vlm_families
from tests.support import rel_err

transformers = pytest.importorskip("transformers")


def test_deal_by_patches_balances_largest_first():
    assert deal_by_patches([96, 16, 48, 16, 16], 2) == [0, 1, 1, 1, 1]
    assert deal_by_patches([10, 10, 10, 10], 4) == [0, 1, 2, 3]
    assert deal_by_patches([5, 7], 1) == [0, 0]
    assert deal_by_patches([], 4) == []


def test_collate_gives_each_rank_only_its_items_patches():
    data = vlm_families.make_data(9, seed=3)
    sids = tuple(i for i, s in enumerate(data.samples) if "image_grid_thw" in s or "video_grid_thw" in s)[:3]
    mb = MicroBatch(sids, Layout(2, 1, Recompute.none()))
    batches = [collate_vision({s: vlm_families.item(data, s) for s in sids}, mb, (0, 1), r) for r in (0, 1)]
    ex = batches[0].extras
    patches = ex["vision_grid"].prod(-1).tolist()
    assert ex["vision_owner"].tolist() == deal_by_patches(patches, 2)
    for r, b in enumerate(batches):
        mine = sum(p for p, o in zip(patches, ex["vision_owner"].tolist(), strict=True) if o == r)
        assert b.extras["pixels"].shape == (mine, vlm_families.PATCH_WIDTH)
        assert torch.equal(b.extras["row_ids"], ex["row_ids"])
    assert ex["row_ids"].shape == (1, batches[0].seq_len)
    videos = ex["vision_kind"] == 2
    assert ex["vision_seconds"].view(torch.float64)[videos].tolist() == [0.5] * int(videos.sum())


def test_mrope_positions_change_the_loss():
    """Without this the parity test could pass with the multimodal positions dropped."""
    data = vlm_families.make_data(9, seed=3)
    model = vlm_families.build()
    s = next(s for s in data.samples if "video_grid_thw" in s)
    ids = s["input_ids"][None]
    kw = {
        k: s[k]
        for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
        if k in s
    }
    types = (ids == vlm_families.IMAGE).int() + 2 * (ids == vlm_families.VIDEO).int()
    with torch.no_grad():
        mrope = model(input_ids=ids, mm_token_type_ids=types, use_cache=False, **kw).logits
        plain = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False, **kw).logits
    assert rel_err(plain, mrope) > 1e-2


def test_deepstack_features_change_the_loss():
    """Without this the Qwen3-VL parity test could pass with the DeepStack features dropped."""
    data = vlm_families.make_data(9, seed=3, kind="qwen3-vl")
    model = vlm_families.build("qwen3-vl")
    with_levels, _ = vlm_families.reference(model, data, range(9))
    with torch.no_grad():
        for p in model.model.visual.deepstack_merger_list.parameters():
            p.zero_()
    without, _ = vlm_families.reference(model, data, range(9))
    assert abs(with_levels - without) > 1e-3 * abs(without), (with_levels, without)


@pytest.mark.parametrize("kind", vlm_families.KINDS)
def test_packed_chats_match_one_chat_at_a_time(kind):
    """SP 1, one process: the packed micro-batches of the mix (documents with images, videos
    and none) give the unmodified model's loss and gradients, vision tower included."""
    data = vlm_families.make_data(9, seed=3, kind=kind)
    ref_loss, ref = vlm_families.reference(vlm_families.build(kind), data, range(9))
    model = vlm_families.build(kind)
    dc = Engine(model)
    for sids in ((0, 1, 2), (3, 4), (5, 6, 7, 8)):
        b = dc.adapter.collate(
            {s: vlm_families.item(data, s) for s in sids}, MicroBatch(sids, Layout(1, 1, Recompute.none())), (0,), 0
        )
        with dc.micro_batch(b) as ctx:
            ctx.backward(dc.adapter.loss_fn(model, b, ctx))
    loss = dc.sync_gradients()
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    total = torch.cat([g.flatten() for g in ref.values()]).norm()
    for n, p in model.named_parameters():  # a gradient zero in exact arithmetic (a key bias): against the total
        err = rel_err(p.grad, ref[n]) if ref[n].norm() > 1e-6 * total else float((p.grad - ref[n]).norm() / total)
        assert err <= 1e-5, n


@pytest.mark.parametrize("kind", vlm_families.KINDS)
def test_freeze_vision_leaves_the_projectors_trainable(kind):
    model = vlm_families.build(kind)
    find_adapter(model, freeze_vision=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        n for n, p in vlm_families.build(kind, freeze_vision=True).named_parameters() if p.requires_grad
    }
    assert not any(
        p.requires_grad
        for n, p in vlm_families.tower(model).named_parameters()
        if n.startswith(("blocks.", "encoder."))
    )
    assert any(("merger." in n or "multi_modal_projector." in n or "connector." in n) for n in trainable)
    text = getattr(model.model, "language_model", None) or model.model.text_model
    assert all(p.requires_grad for p in text.parameters())


REFUSED = {
    "MllamaForConditionalGeneration": "cross-attention layers",
    "Qwen3VLMoeForConditionalGeneration": "mixture-of-experts",
    "LlavaForConditionalGeneration": "no adapter for its vision inputs",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_vision_language_classes_are_refused_with_the_reason(name):
    cls = getattr(transformers, name)
    with torch.device("meta"):
        model = cls._from_config(cls.config_class())
    with pytest.raises(ValueError) as err:
        find_adapter(model)
    msg = str(err.value)
    assert name in msg and REFUSED[name] in msg and "SmolVLMForConditionalGeneration, or pass adapter=" in msg, msg


def test_a_video_for_a_model_without_videos_is_refused():
    """InternVL takes images only: a sample with a video is refused, not trained without it."""
    video = next(s for s in vlm_families.make_data(9, seed=3).samples if "video_grid_thw" in s)
    model = vlm_families.build("internvl")
    dc = Engine(model)
    b = dc.adapter.collate({0: video}, MicroBatch((0,), Layout(1, 1, Recompute.none())), (0,), 0)
    with pytest.raises(ValueError, match="leave pixel_values_videos out"), dc.micro_batch(b) as ctx:
        dc.adapter.loss_fn(model, b, ctx)


def test_a_video_for_llava_onevision_is_refused():
    """LLaVA-OneVision's videos are not parity-tested: a sample with one is refused in the collate."""
    sample = next(s for s in vlm_families.make_data(9, seed=3, kind="llava-ov").samples if "image_sizes" in s)
    sample = sample | {"pixel_values_videos": torch.zeros(1, 2, 3, 8, 8)}
    adapter = find_adapter(vlm_families.build("llava-ov"))
    with pytest.raises(ValueError, match="holds a video .*LLaVA-OneVision.*leave videos out"):
        adapter.collate({0: sample}, MicroBatch((0,), Layout(1, 1, Recompute.none())), (0,), 0)


def test_collate_keeps_each_tiles_pixel_mask_and_drops_padding_tiles():
    """Idefics3 / SmolVLM: each tile an item, its row its pixels then its pixel mask (the padded
    columns zero); the all-zero tile the processor pads with is no image and no item."""
    data = vlm_families.make_data(9, seed=3, kind="idefics3")
    sid, s = next(
        (i, s)
        for i, s in enumerate(data.samples)
        if s.get("pixel_values", torch.zeros(0)).dim() == 5 and not s["pixel_values"][0, -1].any()
    )
    pix, mask = s["pixel_values"][0], s["pixel_attention_mask"][0]
    b = collate_vision({sid: s}, MicroBatch((sid,), Layout(1, 1, Recompute.none())), (0,), 0)
    tile = 3 * vlm_families.TILE**2
    assert len(b.extras["vision_grid"]) == pix.shape[0] - 1 == int((s["input_ids"] == vlm_families.IMAGE).sum()) // 4
    assert torch.equal(b.extras["pixels"][:, :tile], pix[:-1].flatten(1))
    assert torch.equal(b.extras["pixels"][:, tile:], mask[:-1].flatten(1).float())
    assert (mask[:-1] == 0).any()  # a padded tile among them


def test_placeholders_without_their_image_are_refused():
    """A chat whose placeholder tokens do not match its images (here: none given) is refused,
    not trained with the placeholders as text; the profiler's synthetic samples hold none."""
    data = vlm_families.make_data(9, seed=3)
    s = next(s for s in data.samples if "image_grid_thw" in s)
    model = vlm_families.build()
    dc = Engine(model)
    b = dc.adapter.collate(
        {0: {"input_ids": s["input_ids"]}}, MicroBatch((0,), Layout(1, 1, Recompute.none())), (0,), 0
    )
    with pytest.raises(ValueError, match="placeholder tokens"), dc.micro_batch(b) as ctx:
        dc.adapter.loss_fn(model, b, ctx)
    synthetic = torch.cat([dc.adapter.sample(500, i) for i in range(4)])
    assert not torch.isin(synthetic, torch.tensor([vlm_families.IMAGE, vlm_families.VIDEO])).any()
