"""What the diffusers adapters share: whole latents collated per micro-batch, per-sample flow
draws, synthetic items with the conditioning a model needs, the model-protocol arguments
each family accepts, `RuntimeProcessor`, the base of their attention processors (installed
by `replace_processors`), and `latent_adapter`, the assembly of an adapter whose model
shards its own tokens by its context-parallel plan.

Dataset items are mappings: ``latents`` (C, F, H, W) — or (C, H, W) for image models — plus
the conditioning the model takes, each a tensor of one shape within a micro-batch (text
embeddings ``encoder_hidden_states``, image embeddings ``encoder_hidden_states_image``,
condition channels ``condition``, a text mask ``encoder_attention_mask``, pooled text
``pooled_projections``); the collate stacks every one into ``Batch.extras`` under its own
name, whole on every rank of the group (the model shards its tokens itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters.base import ModelAdapter
from dcparallel.adapters.cp_plan import PlanHooks, read_plan
from dcparallel.data.batch import Batch
from dcparallel.data.ring_order import ring_padded_length
from dcparallel.plan.types import MicroBatch
from dcparallel.spec import ModelSpec, Size


def collate_latents(
    samples: Mapping[int, Any],
    mb: MicroBatch,
    ranks: tuple[int, ...],
    rank: int,
    *,
    tokens: Callable[[tuple[int, ...]], int],
    what: str = "video",
    required: Sequence[str] = (),
) -> Batch:
    """Stacks same-shape latents and each conditioning tensor whole on every rank of the
    group; ``tokens(latent shape without channels)`` is the model's token count; ``required``:
    conditioning every item must carry (named with ``what`` when missing)."""
    ranks = tuple(ranks)
    if rank not in ranks or mb.layout.sp != len(ranks):
        raise ValueError(f"rank {rank} / group {ranks} does not run micro-batch {mb.sample_ids} (sp={mb.layout.sp})")
    items = [samples[sid] for sid in mb.sample_ids]
    keys = _conditioning_keys(mb, items, ["latents", *required], what)
    stacked = {k: _stack(mb, [s[k] for s in items], k) for k in sorted(keys)}
    lat = stacked.pop("latents")
    grid = tuple(lat.shape[2:])
    n = tokens(grid)
    b, sp = lat.shape[0], len(ranks)
    return Batch(
        sample_ids=tuple(mb.sample_ids),
        layout=mb.layout,
        ranks=ranks,
        rank_in_group=ranks.index(rank),
        inputs=lat,
        positions=torch.zeros(b, 0, dtype=torch.long),
        labels=None,
        loss_mask=torch.ones(b, *grid, dtype=torch.bool),
        token_sample=torch.arange(b).view(-1, *([1] * len(grid))).expand(b, *grid),
        num_targets=(math.prod(grid),) * b,
        cu_seqlens=(0, n),
        seq_len=n,
        padded_len=ring_padded_length(n, sp, mb.layout.ring),
        frames=grid[0] if len(grid) == 3 else 1,
        sharded=False,
        extras=stacked,
    )


def _conditioning_keys(mb: MicroBatch, items: list[Any], needed: list[str], what: str) -> set[str]:
    """The keys every item of the micro-batch carries (not None): each item a mapping with the
    ``needed`` keys, all items the same keys."""
    for sid, s in zip(mb.sample_ids, items, strict=True):
        if not isinstance(s, Mapping) or any(s.get(k) is None for k in needed):
            got = sorted(s) if isinstance(s, Mapping) else type(s).__name__
            raise ValueError(
                f"{what} sample {sid} must be a mapping with {needed} and the model's other conditioning; got {got}"
            )
    keys = {k for k, v in items[0].items() if v is not None}
    for sid, s in zip(mb.sample_ids, items, strict=True):
        if {k for k, v in s.items() if v is not None} != keys:
            raise ValueError(
                f"samples {mb.sample_ids} of one micro-batch carry different conditioning: sample {sid} "
                f"has {sorted(k for k, v in s.items() if v is not None)}, sample {mb.sample_ids[0]} "
                f"{sorted(keys)}; give every sample the same keys"
            )
    return keys


def _stack(mb: MicroBatch, values: list[Any], key: str) -> Tensor:
    """The items' tensors under ``key`` stacked (B, ...): one shape, or refused."""
    vals = [torch.as_tensor(v) for v in values]
    shapes = {tuple(v.shape) for v in vals}
    if len(shapes) != 1:
        what_k = "be latents of one shape" if key == "latents" else f"share the shape of {key!r}"
        raise ValueError(
            f"samples {mb.sample_ids} of one micro-batch must {what_k}; got {sorted(shapes)} (the "
            f"planner groups samples of one latent shape; pad or crop the conditioning to one "
            f"shape per latent shape)"
        )
    return torch.stack(vals)


def patch_tokens(patch: tuple[int, int, int]):
    def tokens(grid: tuple[int, ...]) -> int:
        if len(grid) != 3 or any(g % p for g, p in zip(grid, patch, strict=True)):
            raise ValueError(
                f"latent shape {grid} is not (frames, height, width) divisible by the patch {patch}; "
                f"crop or pad the latents"
            )
        return math.prod(g // p for g, p in zip(grid, patch, strict=True))

    return tokens


def patch_collate(patch: tuple[int, int, int], *, what: str = "video", required: Sequence[str] = ()):
    """The loader's collate of a video model on latent patches ``patch`` (frames, height,
    width): `collate_latents` with the tokens `patch_tokens` counts."""
    tokens = patch_tokens(patch)

    def collate(samples: Mapping[int, Any], mb: MicroBatch, ranks: tuple[int, ...], rank: int) -> Batch:
        return collate_latents(samples, mb, ranks, rank, tokens=tokens, what=what, required=required)

    return collate


def flow_draws(batch: Batch, ctx: Any, x0: Tensor) -> tuple[Tensor, Tensor]:
    """Rectified-flow draws per sample from its own generator (every rank of a group draws
    the same), on ``x0``'s device: t (B,) logit-normal in fp32, noise shaped like ``x0``."""
    ts, noises = [], []
    for sid in batch.sample_ids:
        g = ctx.generator(sid)
        ts.append(torch.sigmoid(torch.randn((), generator=g, device=x0.device)))
        noises.append(torch.randn(x0.shape[1:], generator=g, device=x0.device))
    t = torch.stack(ts).to(device=x0.device, dtype=torch.float32)
    return t, torch.stack(noises).to(device=x0.device, dtype=x0.dtype)


def latent_flow_loss(model: nn.Module, batch: Batch, ctx: Any, predict) -> Tensor:
    """Rectified-flow training: per sample a timestep t (logit-normal) and noise from its own
    generator; x_t = (1 - t) x0 + t noise, target velocity noise - x0, mean squared error over
    channels per latent position. ``predict(model, x_t, t, batch)`` -> the velocity
    (B, C, F, H, W) for latents x_t (B, C, F, H, W) — or (B, C, H, W) for image models — and
    timesteps t (B,) in [0, 1]."""
    dtype = next(model.parameters()).dtype
    x0 = batch.inputs.to(dtype)
    t, noise = flow_draws(batch, ctx, x0)
    tb = t.to(x0.dtype).view(-1, *[1] * (x0.dim() - 1))
    pred = predict(model, (1 - tb) * x0 + tb * noise, t, batch)
    return ctx.dense_loss((pred.float() - (noise - x0).float()).pow(2).mean(1))


def extras_as(batch: Batch, dtype: torch.dtype, *names: str) -> dict[str, Tensor]:
    """The named conditioning of the batch present, floating ones in the model's dtype. A
    default loss names everything its model takes: any other key the items carried is refused,
    never dropped."""
    unused = sorted(set(batch.extras) - set(names))
    if unused:
        raise ValueError(
            f"the micro-batch's items carry {unused}, which the model's default loss does not pass to "
            f"the model (it takes {list(names)}); pass a loss_fn(model, batch, ctx) that uses them "
            f"(batch.extras), or leave them out of the dataset items"
        )
    out = {}
    for k in names:
        v = batch.extras.get(k)
        if v is not None:
            out[k] = v.to(dtype) if v.is_floating_point() else v
    return out


def random_items(parts: Callable[[Size], Mapping[str, tuple[int, ...] | Tensor]], seed: int = 0):
    """Synthetic items: per size, ``parts(size)`` names each tensor's shape (random normal
    values, fixed per index) or gives its value (a tensor: a mask, a guidance scale, an id)."""

    def sample(size: Size, index: int) -> dict:
        if not isinstance(size, tuple):
            raise ValueError(
                f"a diffusers video/image model takes latent (frames, height, width) sample sizes; got {size!r}"
            )
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return {k: v.clone() if isinstance(v, Tensor) else torch.randn(*v, generator=g) for k, v in parts(size).items()}

    return sample


def padded_text_mask(tokens: int) -> Tensor:
    """A synthetic caption mask (1 = real token): the last quarter of the tokens padding."""
    mask = torch.ones(tokens, dtype=torch.long)
    mask[tokens - tokens // 4 :] = 0
    return mask


def check_args(who: str, unused: Mapping[str, Any], accepted: tuple[str, ...]) -> None:
    """A family adapter's unknown model-protocol arguments: named with what it takes."""
    if unused:
        raise ValueError(
            f"{who} does not take {sorted(unused)}; its adapter takes {', '.join(accepted)} (besides "
            f"layers, num_heads, loss_fn, sample_fn, name); leave the others out"
        )


class RuntimeProcessor:
    """Base of dcparallel's diffusers attention processors. A subclass's ``__call__`` takes
    what its family's diffusers processor takes and keeps that processor's projections,
    norms and rotary; it attends with ``attention``, the runtime's (Ulysses or ring inside a
    micro-batch, plain attention outside)."""

    def __init__(self, attention: Any):
        self.attention = attention


def replace_processors(modules: list, default: str, make: Callable[[], Any], who: str) -> None:
    """Gives every attention module a dcparallel processor (``make()``), after checking that
    each still has diffusers' ``default`` processor: another one (an IP-adapter's, a custom
    one) adds work that dcparallel's processor would silently drop."""
    ours = type(make()).__name__  # installed before (a model driven again): replaced alike
    odd = sorted({type(m.processor).__name__ for m in modules} - {default, ours})
    if odd:
        raise ValueError(
            f"{who}'s attention modules use {', '.join(odd)}, not diffusers' {default}: dcparallel "
            f"replaces the default processor with its Ulysses one and would drop what those add "
            f"(IP-adapter or custom attention); restore the default (model.set_default_attn_processor() "
            f"or unload the adapter) or pass your own adapter"
        )
    for m in modules:
        m.set_processor(make())


def latent_adapter(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    spec: ModelSpec,
    *,
    install: Callable[[Any], None],
    attn_modules: Callable[[nn.Module], list[nn.Module]],
    mlp_modules: Callable[[nn.Module], list[nn.Module]],
    loss_fn: Any,
    sample: Any,
    collate: Any,
    plan: Any = None,
    install_hooks: Callable[[Any], list[Any]] | None = None,
    skip_block: Callable[..., Any] | None = None,
) -> ModelAdapter:
    """The `ModelAdapter` of a diffusers transformer that takes whole latents and shards its
    token sequence itself (Wan, LTX-Video, the image families, the joint-attention video
    families): ``install`` puts its attention processors in, every head is a key/value head
    (the spec's ``num_heads``), and the hooks apply its context-parallel ``plan``
    (`cp_plan.read_plan`'s cuts; None: the model's own ``_cp_plan``, read when the hooks are
    installed) unless ``install_hooks`` replaces them (`joint.video_token_hooks`)."""

    def plan_hooks(attention: Any) -> list[Any]:
        return PlanHooks(model, read_plan(model) if plan is None else plan, attention).install()

    return ModelAdapter(
        name=spec.name,
        kind="video",
        blocks=blocks,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_heads,
        install_attention=install,
        spec=spec,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn,
        sample=sample,
        collate=collate,
        install_hooks=install_hooks or plan_hooks,
        skip_block=skip_block,
    )
