"""Joint attention under Ulysses: diffusers video transformers that attend over video tokens
and text tokens in one attention (HunyuanVideo, CogVideoX, Mochi) and have no ``_cp_plan``.

The model takes whole samples (``Batch.sharded`` is False): every rank of an SP group runs
the text stream and the embeddings whole, module hooks cut the video tokens (and their rotary
tables) to this rank's shard before the blocks and gather them before the output layer
(`shard_tokens`, `gather_tokens`). Inside each joint attention (`joint_attention`):

* the video queries, keys and values (B, L/sp, H, D) go through Ulysses' all-to-all to
  (B, L, H/sp, D): all video tokens, this rank's heads;
* the text ones (B, T, H, D) are replicated in the group: each rank takes its own H/sp heads;
* each rank attends over [all video tokens, text tokens] for its heads, padding of the
  video sequence (odd token counts) and the text padding mask never attended;
* the video output returns through the reverse all-to-all; the text output (B, T, H/sp, D)
  is all-gathered over heads, so every rank continues the text stream whole.

Gradients: each rank's backward yields a share of every gradient, and the step's sync sums
the shares over the world. Values every rank holds whole (the text stream, the timestep
embedding) are consumed either by this rank's tokens or heads (its share) or after the final
gather, where `MicroBatchContext.dense_loss` weights each position 1/sp; the head gather's
backward sums the ranks' shares of the text output's gradient and hands each rank the full
gradient of its own heads (`comm.gather_seq` on the head dim) — so the group's shares add up
to the single-process gradient once, with nothing counted twice.

Under ring attention (``Layout.ring`` r > 1, SP = u x r) the video tokens are the zigzag
columns of `data.ring_order` (`shard_tokens`, `gather_tokens` follow them); the all-to-all
over the Ulysses sub-group gives each rank its ring block for its H/u heads, and
`runtime.ring_joint` attends it: the video queries over every block (the ring) and the text
once, the text queries over every block once (partial softmaxes merged round the ring).
Every family here runs there (HunyuanVideo, CogVideoX, Mochi, and through `adapters.flux` /
`adapters.qwenimage` Flux, Flux 2 and Qwen-Image: tests/dist/test_dist_joint.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dcparallel.adapters import cp_plan
from dcparallel.adapters.base import ModelAdapter
from dcparallel.adapters.latents import check_args, latent_adapter, patch_collate, random_items
from dcparallel.data.batch import Batch
from dcparallel.runtime import comm
from dcparallel.runtime.ring_joint import ring_joint_attention


def sharding(attention: Any) -> tuple[Any, Batch] | None:
    """(group, batch) when the active micro-batch shards the model's tokens (SP > 1): the
    whole SP group (under ring attention the ring's group, whose ranks are its slots)."""
    a = attention.state()
    if a is None or a.batch is None or a.batch.sharded or a.sp == 1:
        return None
    return (a.group if a.ring is None else a.ring.group), a.batch


def shard_tokens(x: Tensor, batch: Batch, dim: int = 1, copy: bool = False) -> Tensor:
    """This rank's ``shard_len`` tokens along ``dim`` of the whole sequence (``batch.seq_len``
    long), padded with zeros past its end: only the shard is copied, and only where it runs
    past the real tokens (the last ranks of an odd count) or ``copy`` asks — a view would keep
    the whole sequence's storage alive wherever the shard is saved for backward."""
    if x.shape[dim] != batch.seq_len:
        raise ValueError(
            f"expected the whole sequence of {batch.seq_len} video tokens on dim {dim}, got "
            f"{tuple(x.shape)}; the model passed its blocks a tensor the sharding hooks do not know"
        )
    if batch.ring > 1:  # the zigzag columns of ring attention (a copy)
        return cp_plan.shard(x, dim, batch)
    start, n = batch.shard_start, batch.shard_len
    real = max(0, min(n, batch.seq_len - start))
    if real == n:
        return x.narrow(dim, start, n).clone() if copy else x.narrow(dim, start, n)
    shape = list(x.shape)
    shape[dim] = n - real
    return torch.cat([x.narrow(dim, min(start, batch.seq_len), real), x.new_zeros(shape)], dim=dim)


def gather_tokens(x: Tensor, attention: Any, dim: int = 1) -> Tensor:
    """The whole video sequence from this rank's shard (padding dropped); unchanged outside SP."""
    active = sharding(attention)
    if active is None:
        return x
    group, batch = active
    if batch.ring > 1:
        return cp_plan.gather(x, dim, group, batch)
    return comm.gather_seq(x, group, dim=dim).narrow(dim, 0, batch.seq_len)


def joint_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_text: Tensor,
    k_text: Tensor,
    v_text: Tensor,
    text_mask: Tensor | None,
    attention: Any,
    *,
    text_first: bool,
) -> tuple[Tensor, Tensor]:
    """Video q, k, v (B, L_local, H, D) — this rank's shard inside an SP micro-batch, the whole
    sequence otherwise — and replicated text q, k, v (B, T, H, D); ``text_mask`` (B, T) bool,
    True where a text token may be attended (None: all). Returns the video output
    (B, L_local, H, D) and the text output (B, T, H, D), whole on every rank. ``text_first``:
    the model's own order of the joint sequence (the keys' order changes only rounding)."""
    active = sharding(attention)
    b, t, h = q.shape[0], q_text.shape[1], q.shape[2]
    video_valid = None
    if active is not None and active[1].ring > 1:
        return _under_ring(q, k, v, q_text, k_text, v_text, text_mask, attention.state())
    if active is not None:
        group, batch = active
        if h % batch.sp:
            raise ValueError(f"{h} attention heads do not split over SP {batch.sp}; use an SP degree dividing them")
        q, k, v = comm.seq_to_heads([q, k, v], group)  # (B, padded L, H/sp, D)
        hs = h // batch.sp
        lo = batch.rank_in_group * hs
        q_text, k_text, v_text = (x.narrow(2, lo, hs) for x in (q_text, k_text, v_text))
        if batch.padded_len != batch.seq_len:
            video_valid = (torch.arange(batch.padded_len, device=q.device) < batch.seq_len).expand(b, -1)
    n = q.shape[1]
    mask = None
    if video_valid is not None or text_mask is not None:
        vm = video_valid if video_valid is not None else torch.ones(b, n, dtype=torch.bool, device=q.device)
        tm = (
            text_mask.to(device=q.device, dtype=torch.bool)
            if text_mask is not None
            else torch.ones(b, t, dtype=torch.bool, device=q.device)
        )
        mask = (torch.cat([tm, vm], 1) if text_first else torch.cat([vm, tm], 1))[:, None, None, :]
    join = (lambda x, y: torch.cat([y, x], 1)) if text_first else (lambda x, y: torch.cat([x, y], 1))
    out = F.scaled_dot_product_attention(
        *(join(x, y).transpose(1, 2) for x, y in ((q, q_text), (k, k_text), (v, v_text))), attn_mask=mask
    ).transpose(1, 2)
    out_text, out_video = (out[:, :t], out[:, t:]) if text_first else (out[:, n:], out[:, :n])
    if active is not None:
        group, _ = active
        out_video = comm.heads_to_seq(out_video, group)
        out_text = comm.gather_seq(out_text, group, dim=2)
    return out_video, out_text


def _under_ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_text: Tensor,
    k_text: Tensor,
    v_text: Tensor,
    text_mask: Tensor | None,
    active: Any,
) -> tuple[Tensor, Tensor]:
    """`joint_attention` at ring degree > 1: Ulysses over the sub-group ``active.group``
    gives this rank its ring block for its heads, `ring_joint_attention` attends it and its
    heads of the text over the whole row; the outputs go back as under Ulysses alone."""
    group, batch, h = active.group, active.batch, q.shape[2]
    u = comm.group_size(group)
    if h % u:
        raise ValueError(
            f"{h} attention heads do not split over Ulysses degree {u} (SP {batch.sp} = Ulysses {u} x "
            f"ring {batch.ring}); plan a split whose Ulysses degree divides them"
        )
    q, k, v = comm.seq_to_heads([q, k, v], group)
    hs = h // u
    lo = comm.group_rank(group) * hs
    q_text, k_text, v_text = (x.narrow(2, lo, hs) for x in (q_text, k_text, v_text))
    out, out_text = ring_joint_attention(
        q, k, v, q_text, k_text, v_text, text_mask, active.ring, batch.seq_len, batch.padded_len
    )
    return comm.heads_to_seq(out, group), comm.gather_seq(out_text, group, dim=2)


def block_input_hooks(
    blocks: Sequence[nn.Module], attention: Any, *, names: Sequence[str], hidden: str, rotary: str | None
) -> list[Any]:
    """Forward pre-hooks on the blocks: the first block's whole video hidden states (argument
    ``hidden``) and every block's whole rotary tables (argument ``rotary``: a (cos, sin) pair
    of (N, ...) tables, held whole by the model's forward anyway: views) are cut to this
    rank's shard. ``names``: the blocks' positional
    parameter names, so arguments passed either way are found."""
    first = blocks[0]

    def hook(block: nn.Module, args: tuple, kwargs: dict):
        active = sharding(attention)
        if active is None:
            return None
        _, batch = active
        args, kwargs = list(args), dict(kwargs)

        def update(name: str, fn) -> None:
            i = names.index(name)
            if i < len(args):
                args[i] = fn(args[i])
            elif kwargs.get(name) is not None:
                kwargs[name] = fn(kwargs[name])

        if block is first:  # a copy: the block saves its input, which must not pin the whole sequence
            update(hidden, lambda x: shard_tokens(x, batch, dim=1, copy=True))
        if rotary is not None:
            update(rotary, lambda r: r if r is None else tuple(shard_tokens(x, batch, dim=0) for x in r))
        return tuple(args), kwargs

    return [b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks]


def two_stream_passthrough(names: Sequence[str]):
    """`ModelAdapter.skip_block` for blocks returning (video, text): both streams unchanged."""

    def skip(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        found = dict(zip(names, args, strict=False)) | kwargs
        return found["hidden_states"], found["encoder_hidden_states"]

    return skip


def gather_before(module: nn.Module, attention: Any) -> Any:
    """A forward pre-hook on ``module`` (the output norm) that gathers its first argument."""

    def hook(mod: nn.Module, args: tuple):
        if sharding(attention) is None:
            return None
        return (gather_tokens(args[0], attention), *args[1:])

    return module.register_forward_pre_hook(hook)


def video_token_hooks(
    blocks: Sequence[nn.Module], norm: nn.Module, attention: Any, *, names: Sequence[str]
) -> list[Any]:
    """The hooks of a joint-attention model: its video tokens and rotary tables
    (``image_rotary_emb``) cut before the blocks (`block_input_hooks`), gathered before the
    output norm ``norm`` (`gather_before`)."""
    return [
        *block_input_hooks(blocks, attention, names=names, hidden="hidden_states", rotary="image_rotary_emb"),
        gather_before(norm, attention),
    ]


def check_driven(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    layers: Any,
    num_heads: Any,
    num_kv_heads: Any,
    unused: Mapping[str, Any],
    accepted: Sequence[str] = ("context_tokens",),
) -> int:
    """The model-protocol arguments a joint-attention adapter takes (it drives all of the
    model's blocks and reads its heads; ``accepted``: its family arguments): anything else is
    refused by name. Returns the heads."""
    who = type(model).__name__
    check_args(f"diffusers {who}", unused, accepted)
    if layers is not None and [id(b) for b in layers] != [id(b) for b in blocks]:
        raise ValueError(
            f"{who}: dcparallel drives all of its {len(blocks)} transformer blocks itself; leave "
            f"layers= out (or pass exactly those blocks)"
        )
    heads = model.config.num_attention_heads
    if num_heads not in (None, heads) or num_kv_heads not in (None, heads):
        raise ValueError(
            f"{who} has {heads} attention heads (query and key/value); leave num_heads / num_kv_heads "
            f"out or pass {heads}"
        )
    return heads


def video_adapter(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    spec: Any,
    *,
    processor: Any,
    attn_modules: Any,
    mlp_modules: Any,
    loss_fn: Any,
    parts: Any,
    sample_fn: Any,
    norm: nn.Module,
    block_args: Sequence[str],
    patch: tuple[int, int, int],
    required: Sequence[str],
) -> ModelAdapter:
    """The `ModelAdapter` of a joint-attention video model, from what its family module says:
    ``processor(attention)``, the Ulysses processor every block's attention module (its
    ``attn_modules``) gets, the `ModelSpec` ``spec`` (its heads), the default loss
    ``loss_fn`` and synthetic items ``parts`` (`random_items`, unless ``sample_fn``),
    the output norm ``norm`` its video tokens are gathered before (`video_token_hooks`), its
    blocks' positional argument names ``block_args``, the latent ``patch`` (frames, height,
    width) and the conditioning every item must carry (``required``). Blocks return (video,
    text): the profiler's skipped blocks pass both on (`two_stream_passthrough`)."""

    def install(fn: Any) -> None:
        for m in (m for b in blocks for m in attn_modules(b)):
            if hasattr(m, "set_processor"):
                m.set_processor(processor(fn))
            else:  # Mochi's attention module has none
                m.processor = processor(fn)

    return latent_adapter(
        model,
        blocks,
        spec,
        install=install,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn,
        sample=sample_fn or random_items(parts),
        collate=patch_collate(patch, what=type(model).__name__, required=required),
        install_hooks=lambda attention: video_token_hooks(blocks, norm, attention, names=block_args),
        skip_block=two_stream_passthrough(block_args),
    )


def caption_mask(batch: Batch, text: Tensor) -> Tensor:
    """The items' ``encoder_attention_mask`` (B, T) (1 = real token), all real where absent."""
    mask = batch.extras.get("encoder_attention_mask")
    return torch.ones(text.shape[:2], dtype=torch.long, device=text.device) if mask is None else mask.to(text.device)


def project_out(attn: nn.Module, out: Tensor, out_text: Tensor) -> tuple[Tensor, Tensor]:
    """The joint attention's outputs (B, L, H * D), (B, T, H * D) through the module's output
    projections where it has them (``to_out``: video; ``to_add_out``: text)."""
    if getattr(attn, "to_out", None) is not None:
        out = attn.to_out[1](attn.to_out[0](out))
    if getattr(attn, "to_add_out", None) is not None:
        out_text = attn.to_add_out(out_text)
    return out, out_text


def project_two_streams(attn: nn.Module, hidden: Tensor, text: Tensor, split) -> tuple[Tensor, ...]:
    """q, k, v of the video tokens (``to_q``/``to_k``/``to_v``, ``norm_q``/``norm_k``) and of
    the text tokens (``add_q_proj``/``add_k_proj``/``add_v_proj``, ``norm_added_q``/``_k``),
    each through ``split`` (B, L, H * D) -> (B, L, H, D): a dual-stream diffusers attention."""
    q, k, v = split(attn.to_q(hidden)), split(attn.to_k(hidden)), split(attn.to_v(hidden))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    qt, kt, vt = split(attn.add_q_proj(text)), split(attn.add_k_proj(text)), split(attn.add_v_proj(text))
    if attn.norm_added_q is not None:
        qt = attn.norm_added_q(qt)
    if attn.norm_added_k is not None:
        kt = attn.norm_added_k(kt)
    return q, k, v, qt, kt, vt
