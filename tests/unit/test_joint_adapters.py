"""The joint-attention adapters at world 1 (HunyuanVideo, CogVideoX, Mochi): the installed
attention processors give the unmodified model's output (bitwise; Mochi to fp32 rounding),
the planner's spec counts every parameter, and what dcparallel cannot drive is refused
naming the class, the missing piece and the fix. Distributed parity: tests/dist/test_dist_joint.py."""

from __future__ import annotations

import copy

import pytest
import torch

from dcparallel.adapters import find_adapter
from dcparallel.runtime.ulysses import UlyssesAttention
from tests.joint_models import JOINT_KINDS, TEXT_TOKENS, build, make_data

pytest.importorskip("diffusers")


@pytest.mark.parametrize("kind", JOINT_KINDS)
def test_processors_give_the_unmodified_output_and_the_spec_counts_every_parameter(kind):
    from tests.joint_models import _velocity

    model = build(kind)
    ours = copy.deepcopy(model)
    adapter = find_adapter(ours, context_tokens=TEXT_TOKENS)
    adapter.install_attention(UlyssesAttention())
    assert adapter.spec.num_params == sum(p.numel() for p in model.parameters())
    assert adapter.spec.num_layers == len(adapter.blocks) == (4 if kind == "hunyuan" else 2)
    if kind == "mochi":  # its processor is set by attribute (MochiAttention has no set_processor)
        assert type(ours.transformer_blocks[0].attn1.processor).__name__ == "UlyssesMochiAttention"
    assert adapter.recompute_modes == ("none", "attn", "mlp", "full")
    data = make_data(kind, 3, seed=5)
    for sid in range(3):
        x, t = data.docs[sid][None], torch.tensor(0.4)
        ref = _velocity(model, kind, x, t, data.items[sid])
        out = _velocity(ours, kind, x, t, data.items[sid])
        # Mochi: diffusers attends over each sample's real caption tokens only, dcparallel masks
        # the others (the same result up to fp32 rounding); the other families: bitwise
        tol = 1e-6 * float(ref.abs().max()) if kind == "mochi" else 0.0
        assert float((out - ref).abs().max()) <= tol, (kind, sid, float((out - ref).abs().max()))


def test_arguments_for_another_family_are_refused_by_name():
    with pytest.raises(ValueError, match=r"HunyuanVideoTransformer3DModel.*\['text_dim'\].*context_tokens"):
        find_adapter(build("hunyuan"), text_dim=16)
    model = build("cogvideox")
    assert find_adapter(model, layers=list(model.transformer_blocks)).blocks == list(model.transformer_blocks)
    with pytest.raises(ValueError, match=r"CogVideoXTransformer3DModel.*leave layers= out"):
        find_adapter(model, layers=list(model.transformer_blocks)[:1])


def test_image_to_video_variants_are_refused_with_the_fix():
    from diffusers import CogVideoXTransformer3DModel, HunyuanVideoTransformer3DModel

    hv = HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        text_embed_dim=8,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
        image_condition_type="token_replace",
    )
    with pytest.raises(ValueError, match=r"HunyuanVideoTransformer3DModel.*token_replace.*image_condition_type=None"):
        find_adapter(hv)
    cv = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=8,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=8,
        num_layers=1,
        sample_width=8,
        sample_height=8,
        max_text_seq_length=4,
        use_rotary_positional_embeddings=True,
    )
    with pytest.raises(ValueError, match=r"CogVideoXTransformer3DModel.*in_channels=8.*loss_fn= and sample_fn="):
        find_adapter(cv)


def test_a_diffusers_model_without_a_cp_plan_or_joint_layout_is_refused():
    from diffusers import LatteTransformer3DModel

    model = LatteTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        caption_channels=8,
        cross_attention_dim=16,
        video_length=2,
    )
    assert getattr(model, "_cp_plan", None) is None
    with pytest.raises(ValueError) as err:
        find_adapter(model, context_tokens=8)
    msg = str(err.value)
    assert "LatteTransformer3DModel" in msg and "no context-parallel plan (_cp_plan" in msg
    assert "HunyuanVideoTransformer3DModel" in msg
    assert "adapter=dcparallel.adapters.ModelAdapter" in msg


def test_collate_stacks_conditioning_and_names_what_is_missing_or_mixed():
    from dcparallel.plan.types import MicroBatch
    from dcparallel.spec import Layout

    model = build("hunyuan")
    collate = find_adapter(model, context_tokens=TEXT_TOKENS).collate
    data = make_data("hunyuan", 6, seed=3)
    same = [s for s in range(6) if data.shape_of[s] == data.shape_of[0]]
    batch = collate({s: data.items[s] for s in same}, MicroBatch(tuple(same), Layout(2, len(same))), (0, 1), 1)
    f, h, w = data.shape_of[0]
    assert batch.seq_len == f * (h // 2) * (w // 2) and batch.padded_len % 2 == 0 and not batch.sharded
    assert batch.extras["encoder_attention_mask"].shape == (len(same), TEXT_TOKENS)
    assert set(batch.extras) == {"encoder_hidden_states", "pooled_projections", "encoder_attention_mask", "guidance"}
    other = next(s for s in range(6) if data.shape_of[s] != data.shape_of[0])
    with pytest.raises(ValueError, match="latents of one shape"):
        collate({s: data.items[s] for s in (0, other)}, MicroBatch((0, other), Layout(1, 2)), (0,), 0)
    missing = {0: {k: v for k, v in data.items[0].items() if k != "pooled_projections"}}
    with pytest.raises(ValueError, match=r"HunyuanVideoTransformer3DModel sample 0 .*pooled_projections"):
        collate(missing, MicroBatch((0,), Layout(1, 1)), (0,), 0)
