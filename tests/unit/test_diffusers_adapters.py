"""diffusers transformers without a process group: what each family's adapter reads, the
synthetic items it profiles with (the conditioning each model needs), `prepare` at world 1,
and the refusals of models dcparallel cannot drive (class, missing piece, fix). Parity with
the unmodified models over SP groups: tests/dist/test_dist_adapters.py."""

from __future__ import annotations

import pytest
import torch

from dcparallel.adapters import find_adapter, protocol_adapter
from dcparallel.api import DataCentricParallel
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from dcparallel.spec import Layout, Recompute
from tests.adapter_models import TinyGQA, build, item, make_data, reference
from tests.support import rel_err, train_steps

pytest.importorskip("diffusers")

#: per kind: a latent size, its token count, the keys of a dataset item
ITEMS = {
    "wan-i2v": ((3, 4, 6), 18, {"latents", "encoder_hidden_states", "encoder_hidden_states_image"}),
    "wan22-i2v": ((3, 4, 6), 18, {"latents", "encoder_hidden_states", "condition"}),
    "skyreels": ((3, 4, 6), 18, {"latents", "encoder_hidden_states", "fps"}),
    "vace": ((3, 4, 6), 18, {"latents", "encoder_hidden_states", "control_hidden_states"}),
    "helios": ((3, 4, 6), 18, {"latents", "encoder_hidden_states"}),
    "ltx": ((2, 3, 5), 30, {"latents", "encoder_hidden_states"}),
    "flux": ((1, 6, 10), 15, {"latents", "encoder_hidden_states", "pooled_projections"}),
    "flux2": ((1, 6, 10), 15, {"latents", "encoder_hidden_states"}),
    "flux2-cond": ((1, 6, 10), 15, {"latents", "encoder_hidden_states", "condition"}),
    "qwenimage": ((1, 6, 10), 15, {"latents", "encoder_hidden_states"}),
}
#: parameters the default loss cannot reach: the last block's text output feeds nothing (the
#: models return the image only); Flux.1's last single block shares its parameters with the image
UNREACHED = {"flux": "single_transformer_blocks.1.", "qwenimage": "transformer_blocks.1."}


@pytest.mark.parametrize("kind", sorted(ITEMS))
def test_family_adapters_profile_with_the_conditioning_each_model_needs(kind):
    """The adapter's synthetic items carry what the model needs (image embeddings, condition
    channels, pooled text): collated and run through the default loss in a micro-batch of
    two, they train every parameter the model uses."""
    size, tokens, keys = ITEMS[kind]
    model = build(kind)
    dc = Engine(model)
    a = dc.adapter
    assert a.kind == "video" and a.num_heads == 4 and a.spec.tokens(size) == tokens
    assert a.spec.num_params == sum(p.numel() for p in model.parameters())
    items = {i: a.sample(size, i) for i in range(2)}
    assert set(items[0]) == keys
    if kind in ("wan22-i2v", "flux2-cond"):  # latents: the 4 target channels; condition: the other 4 input channels
        assert items[0]["latents"].shape[0] == 4 and items[0]["condition"].shape[0] == 4
    batch = a.collate(items, MicroBatch((0, 1), Layout(1, 2, Recompute(1, 1))), (0,), 0)
    assert batch.seq_len == tokens and set(batch.extras) == keys - {"latents"}
    with dc.micro_batch(batch) as ctx:
        ctx.backward(a.loss_fn(model, batch, ctx))
    assert dc.sync_gradients() > 0
    unused = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert all(kind in UNREACHED and n.startswith(UNREACHED[kind]) for n in unused), unused


@pytest.mark.parametrize("kind", ["flux2", "flux2-cond", "qwenimage"])
def test_image_families_match_the_unmodified_model_at_world_1(kind):
    """Micro-batches of several same-shape images through the default loss: loss and every
    gradient equal the unmodified model called as its pipeline calls it, one image at a time
    (with condition channels: the model predicts only the target's channels). SP groups:
    tests/dist/test_dist_adapters.py."""
    data = make_data(kind, 7, 3)
    model = build(kind)
    dc = Engine(model)
    by_shape: dict = {}
    for sid, shape in data.shape_of.items():
        by_shape.setdefault(shape, []).append(sid)
    for sids in by_shape.values():
        batch = dc.adapter.collate(
            {s: item(data, s) for s in sids}, MicroBatch(tuple(sids), Layout(1, len(sids), Recompute(1, 0))), (0,), 0
        )
        with dc.micro_batch(batch) as ctx:
            ctx.backward(dc.adapter.loss_fn(model, batch, ctx))
    loss = dc.sync_gradients()
    ref_loss, ref_grads = reference(build(kind), data, range(7))
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert max(rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters()) <= 1e-5


@pytest.mark.parametrize("kind", ["wan22-i2v", "ltx", "flux"])
def test_prepare_profiles_and_trains_diffusers_families_at_world_1(kind, tmp_path):
    model = build(kind)
    shapes = {
        "flux": [(1, 6, 10), (1, 10, 6), (1, 8, 8), (1, 4, 4)],
        "ltx": [(2, 3, 5), (1, 5, 5), (2, 3, 3), (1, 3, 3)],
        "wan22-i2v": [(2, 4, 6), (1, 4, 4), (3, 4, 4), (1, 6, 6)],
    }[kind]
    shapes = shapes * 3
    dc = DataCentricParallel(model, memory_bytes=2**30, context_tokens=5)
    data = [dc.adapter.sample(s, i) for i, s in enumerate(shapes)]
    with pytest.raises(ValueError, match=r"profiler_config names \['repeat'\], which are not ProfilerConfig fields"):
        dc.prepare(data, lengths=shapes, samples_per_step=6, profiler_config={"repeat": 1})
    # fields over prepare's default (capped at the longest sample and the memory budget)
    loader = dc.prepare(
        data,
        lengths=shapes,
        samples_per_step=6,
        profile_path=str(tmp_path / "p.json"),
        profiler_config={"repeats": 1, "max_repeats": 1, "min_time_s": 0.0, "max_mbs": 2},
    )
    losses = [loss for _, loss in train_steps(dc, model, loader, dc.optimizer(lr=1e-3))]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert dc.profile.entries


def test_diffusers_models_without_a_plan_are_refused_naming_class_missing_piece_and_fix():
    from diffusers import LatteTransformer3DModel

    model = LatteTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        caption_channels=16,
        cross_attention_dim=16,
    )
    with pytest.raises(
        ValueError,
        match=r"LatteTransformer3DModel: it has no context-parallel plan \(_cp_plan"
        r".*adapter=dcparallel.adapters.ModelAdapter.*WanTransformer3DModel",
    ):
        find_adapter(model)


def test_wan_look_alikes_refuse_what_the_plan_does_not_cut():
    """SkyReels-V2's block-causal attention is refused, naming the class, the missing piece
    and the fix."""
    from diffusers import SkyReelsV2Transformer3DModel

    causal = SkyReelsV2Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=1,
        rope_max_seq_len=32,
        num_frame_per_block=2,
    )
    with pytest.raises(
        ValueError,
        match=r"SkyReelsV2Transformer3DModel with num_frame_per_block=2 attends "
        r"block-causally.*train it with num_frame_per_block=1",
    ):
        find_adapter(causal)


def test_diffusers_models_with_a_plan_but_no_processor_are_refused():
    from diffusers import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        hidden_size=16,
        num_layers=1,
        num_refiner_layers=1,
        ffn_dim=32,
        in_channels=4,
        audio_in_channels=4,
        text_dim=16,
        freq_dim=16,
        time_embed_hidden_dim=16,
        time_embed_dim=8,
        rope_freq_dim=4,
    )
    with pytest.raises(
        ValueError,
        match=r"MiniMaxH3Transformer3DModel yet: it has a context-parallel plan.*no "
        r"parity-tested attention processor.*MiniMaxH3AttnProcessor",
    ):
        DataCentricParallel(model)


def test_ltx2_is_refused_naming_the_audio_stream_it_cannot_shard():
    from diffusers import LTX2VideoTransformer3DModel

    model = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    )
    with pytest.raises(
        ValueError,
        match=r"LTX2VideoTransformer3DModel yet: its _cp_plan shards only the video tokens"
        r".*video_to_audio_attn.*audio_proj_out.*To train it, pass adapter="
        r"dcparallel.adapters.ModelAdapter",
    ):
        DataCentricParallel(model)


def test_image_families_refuse_what_they_do_not_train_by_name():
    """Flux 2's reference-image KV cache, latents that carry the condition channels too,
    Qwen-Image's edit / layered configurations and its ControlNet residuals: refused, naming
    the keyword or setting and the fix."""
    from diffusers import QwenImageTransformer2DModel

    model = build("flux2")
    dc = Engine(model)
    batch = dc.adapter.collate({0: dc.adapter.sample((1, 4, 6), 0)}, MicroBatch((0,), Layout(1, 1)), (0,), 0)
    x = torch.randn(1, 6, 16)
    with pytest.raises(ValueError, match=r"kv_cache_mode='extract', num_ref_tokens=2: the reference-image KV cache"):
        with dc.micro_batch(batch):
            model(
                x,
                encoder_hidden_states=torch.randn(1, 3, 16),
                timestep=torch.ones(1),
                img_ids=torch.zeros(1, 6, 4),
                txt_ids=torch.zeros(1, 3, 4),
                guidance=torch.ones(1),
                kv_cache_mode="extract",
                num_ref_tokens=2,
            )
    model = build("flux2-cond")  # latents carrying every input channel: the target's are asked for by name
    dc = Engine(model)
    wrong = dict(dc.adapter.sample((1, 4, 6), 0))
    wrong["latents"] = torch.cat([wrong["latents"], wrong.pop("condition")])
    batch = dc.adapter.collate({0: wrong}, MicroBatch((0,), Layout(1, 1)), (0,), 0)
    with pytest.raises(
        ValueError,
        match=r"predicts 4 latent channels, but the items' latents have 8: give 'latents' "
        r"the target's channels only and the other 4 input channels as 'condition'",
    ):
        with dc.micro_batch(batch) as ctx:
            dc.adapter.loss_fn(model, batch, ctx)
    cfg = dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    )
    for setting in ("zero_cond_t", "use_layer3d_rope"):
        with pytest.raises(ValueError, match=rf"QwenImageTransformer2DModel with {setting}=True: .*pass your own"):
            find_adapter(QwenImageTransformer2DModel(**cfg, **{setting: True}))
    model = build("qwenimage")
    dc = Engine(model)
    batch = dc.adapter.collate({0: dc.adapter.sample((1, 4, 6), 0)}, MicroBatch((0,), Layout(1, 1)), (0,), 0)
    with pytest.raises(
        ValueError,
        match=r"got controlnet_block_samples: dcparallel's Qwen-Image adapter does not "
        r"shard ControlNet residuals",
    ):
        with dc.micro_batch(batch):
            model(
                x,
                encoder_hidden_states=torch.randn(1, 3, 16),
                timestep=torch.ones(1),
                img_shapes=[[(1, 2, 3)]],
                controlnet_block_samples=[torch.zeros(1, 6, 32)],
            )


def test_family_arguments_never_reach_another_family_as_a_type_error():
    with pytest.raises(
        ValueError,
        match=r"TinyGQA follows dcparallel's model protocol, which takes no "
        r"context_tokens= \(an argument of diffusers",
    ):
        protocol_adapter(TinyGQA(), num_heads=4, num_kv_heads=2, context_tokens=8)
    with pytest.raises(ValueError, match=r"context_tokens="):
        DataCentricParallel(TinyGQA(), num_heads=4, num_kv_heads=2, context_tokens=8)
    with pytest.raises(
        ValueError,
        match=r"LTXVideoTransformer3DModel does not take \['image_tokens'\]; its adapter "
        r"takes context_tokens, rope_interpolation_scale",
    ):
        find_adapter(build("ltx"), image_tokens=3)
    with pytest.raises(ValueError, match=r"FluxTransformer2DModel does not take \['rope_interpolation_scale'\]"):
        find_adapter(build("flux"), rope_interpolation_scale=(1, 1, 1))


def test_image_to_video_wan_needs_512_text_tokens_and_both_image_settings():
    with pytest.raises(
        ValueError,
        match=r"context_tokens=8: diffusers' Wan image-to-video attention takes the last "
        r"512 text tokens",
    ):
        find_adapter(build("wan-i2v"), context_tokens=8)
    from diffusers import WanTransformer3DModel

    half = WanTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=1,
        image_dim=12,
    )
    with pytest.raises(ValueError, match=r"image_dim=12 and added_kv_proj_dim=None: image-to-video needs both"):
        find_adapter(half)


def test_a_processor_other_than_diffusers_default_is_refused_not_replaced():
    """An IP-adapter's processor adds image-prompt attention: swapping in dcparallel's
    processor would drop it silently, so the model is refused and left as it was."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    model = build("flux")
    model.transformer_blocks[0].attn.set_processor(FluxIPAdapterAttnProcessor(32, 32))
    with pytest.raises(
        ValueError,
        match=r"FluxTransformer2DModel's attention modules use FluxIPAdapterAttnProcessor, "
        r"not diffusers' FluxAttnProcessor.*set_default_attn_processor",
    ):
        Engine(model)
    assert {type(p).__name__ for p in model.attn_processors.values()} == {
        "FluxIPAdapterAttnProcessor",
        "FluxAttnProcessor",
    }


def test_an_item_key_the_default_loss_does_not_use_is_refused_not_dropped():
    """A dataset column (say image latents for a text-to-video Wan) reaches `batch.extras`;
    the default loss passes only what the model takes, so it refuses the rest by name."""
    model = build("wan")
    dc = Engine(model, adapter=find_adapter(model, context_tokens=5))
    item = dict(dc.adapter.sample((2, 4, 4), 0))
    item["image_latents"] = torch.randn(4, 1, 4, 4)
    batch = dc.adapter.collate({0: item}, MicroBatch((0,), Layout(1, 1)), (0,), 0)
    assert set(batch.extras) == {"encoder_hidden_states", "image_latents"}
    with pytest.raises(ValueError, match=r"carry \['image_latents'\].*pass a loss_fn"):
        with dc.micro_batch(batch) as ctx:
            dc.adapter.loss_fn(model, batch, ctx)
    del item["image_latents"]  # without it the same micro-batch trains
    batch = dc.adapter.collate({0: item}, MicroBatch((0,), Layout(1, 1)), (0,), 0)
    with dc.micro_batch(batch) as ctx:
        ctx.backward(dc.adapter.loss_fn(model, batch, ctx))
