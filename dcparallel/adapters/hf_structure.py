"""The structure of a transformers causal LM, read from the model itself: its decoder
blocks, each block's attention and MLP sub-modules, and the layers dcparallel must refuse.

* Blocks: the longest ``nn.ModuleList`` of the decoder whose entries are all of the classes
  the model names in ``_no_split_modules`` (its decoder-layer classes: ``model.layers`` of
  Llama, ``gpt_neox.layers`` of GPT-NeoX, ``transformer.h`` of Falcon ...); failing that,
  the longest one whose entries each hold an attention module.
* Attention: the sub-modules of a block whose class calls transformers' attention
  interface (a method refers to ``ALL_ATTENTION_FUNCTIONS``): only these call the function
  dcparallel registers, whatever their name (``self_attn``, ``attention``,
  ``self_attention``).
* MLP: the block's children named or typed as a feed-forward (``mlp``, ``feed_forward``,
  ``block_sparse_moe``, ``*MLP`` / ``*MoE`` / ``*Experts`` classes ...), for attention-/MLP-only
  recompute and the planner's parameter counts.
* Refusals (`check_token_mixing`): a block that mixes tokens outside the attention
  interface cannot run under Ulysses (each rank holds a shard of the sequence, and only the
  attention exchanges it) and, packed, would mix documents even at SP 1: a block with no
  interface attention (a linear-attention / state-space / recurrent layer, or an attention
  that calls its kernel itself), a block with a convolution or a state-space / recurrent /
  linear-attention sub-module beside its attention, a ``config.layer_types`` entry that is
  not a softmax attention, or an attention that builds its own mask (Doge's learned dynamic
  mask). Each refusal names the model class, the layer, the module and why.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from torch import nn

#: ``config.layer_types`` entries that are a softmax attention over the tokens (sliding and
#: chunked windows are checked per document at run time)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
#: child names of a decoder block that are its feed-forward
MLP_NAMES = frozenset(
    {"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "shared_mlp", "mlp_block", "sparse_moe", "experts"}
)
_MLP_CLASS = re.compile(r"(MLP|Mlp|MoE|Moe|Experts|FeedForward|FFN|SparseMoeBlock)$")
#: sub-module classes that mix tokens without attention (state-space, recurrent, linear attention)
_MIXER_CLASS = re.compile(
    r"Mamba|Mixer|SSM|Ssm|DeltaNet|Lightning|LinearAttention|ShortConv|Recurren|RWKV|Rwkv|"
    r"Retention|xLSTM|Lstm|LSTM|GRU"
)
_NORM_CLASS = re.compile(r"Norm")
_VISION = re.compile(r"vision|visual|image|audio|speech")

Finder = Callable[[nn.Module], list[nn.Module]]
#: attention classes that change the attention pattern with a mask of their own
_OWN_MASK = {
    "DogeAttention": "a learned dynamic mask (dt_proj / A) added to the attention logits and top-k "
    "selected per query, passed to the attention as attention_mask"
}


@cache
def calls_attention_interface(cls: type) -> bool:
    """Whether a method of ``cls`` (not of `nn.Module`) refers to transformers'
    ``ALL_ATTENTION_FUNCTIONS``: the class dispatches to the registered attention."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        for value in vars(klass).values():
            fn = inspect.unwrap(value) if callable(value) else None
            code = getattr(fn, "__code__", None)
            if code is not None and "ALL_ATTENTION_FUNCTIONS" in _names(code):
                return True
    return False


def _names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def attention_modules(block: nn.Module) -> list[nn.Module]:
    """The outermost sub-modules of ``block`` (or the block) whose class calls the attention interface."""
    found: list[nn.Module] = []
    seen_prefixes: list[str] = []
    for name, m in block.named_modules():
        if any(name == p or name.startswith(p + ".") for p in seen_prefixes):
            continue
        if calls_attention_interface(type(m)):
            found.append(m)
            seen_prefixes.append(name)
    return found


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    """The block's feed-forward children (by name or class), outside its attention."""
    attn = {id(m) for m in attention_modules(block)}
    return [
        m
        for name, m in block.named_children()
        if m is not None and id(m) not in attn and (name in MLP_NAMES or _MLP_CLASS.search(type(m).__name__))
    ]


def _lists(root: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(n, m) for n, m in root.named_modules() if isinstance(m, nn.ModuleList) and len(m)]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's decoder blocks, in order (see the module docstring)."""
    who = type(model).__name__
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    lists = _lists(model)
    # a multimodal model's vision encoder is a list of layers too: only the text decoder counts
    lists = [(n, m) for n, m in lists if not _VISION.search(n)]
    by_class = [(n, m) for n, m in lists if layer_classes and all(type(b).__name__ in layer_classes for b in m)]
    with_attn = [(n, m) for n, m in lists if all(attention_modules(b) for b in m)]
    decoder_first = sorted(by_class or with_attn, key=lambda nm: -len(nm[1]))
    if not decoder_first:
        raise ValueError(
            f"{who}: found no list of decoder layers (an nn.ModuleList of its "
            f"_no_split_modules classes {sorted(layer_classes)}, or of blocks with an attention that "
            f"calls transformers' attention interface); pass layers=[...] with the decoder blocks"
        )
    return list(decoder_first[0][1])


def ffn_size(config, blocks: Sequence[nn.Module], hidden: int) -> int:
    """The feed-forward width for the planner's spec: the config's (under the names families
    use), else the first MLP's first linear layer, else 4 x hidden."""
    for key in (
        "intermediate_size",
        "ffn_hidden_size",
        "n_inner",
        "ffn_dim",
        "moe_intermediate_size",
        "intermediate_size_mlp",
    ):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    for m in mlp_modules(blocks[0]) if blocks else []:
        lin = next((x for x in m.modules() if isinstance(x, nn.Linear)), None)
        if lin is not None:
            return lin.out_features
    return 4 * hidden


def _mixers(block: nn.Module, attn: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Sub-modules of the block that mix tokens outside the attention interface: convolutions
    and state-space / recurrent / linear-attention modules (outermost only)."""
    inside_attn = {id(x) for a in attn for x in a.modules()}
    out: list[tuple[str, nn.Module]] = []
    for name, m in block.named_modules():
        if id(m) in inside_attn or any(name.startswith(p + ".") for p, _ in out):
            continue
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.RNNBase)) or _MIXER_CLASS.search(type(m).__name__):
            out.append((name, m))
    return out


def _token_modules(block: nn.Module) -> str:
    """The block's children that are neither norms nor feed-forwards: where it mixes tokens."""
    mlp = {id(m) for m in mlp_modules(block)}
    parts = [
        f"{n} ({type(m).__name__})"
        for n, m in block.named_children()
        if m is not None
        and id(m) not in mlp
        and not _NORM_CLASS.search(type(m).__name__)
        and any(True for _ in m.parameters())
    ]
    return ", ".join(parts) or "no attention module"


_SHARD = (
    "dcparallel shards each packed row over the SP group (Ulysses) and exchanges tokens only inside the "
    "attention it installs, which applies each document's causal boundaries"
)
_RECURRENT = (
    f"{_SHARD}; this layer would see only its rank's shard under SP > 1 and, packed, would carry its "
    f"state across documents even at SP 1. A recurrent state (or a convolution) over the sequence "
    f"cannot be split by Ulysses: it needs a scan whose state (or the last tokens) passes between "
    f"the group's ranks in order"
)


def _fix(who: str) -> str:
    return (
        f"Fix: train {who} with one document per row and no sequence parallelism outside dcparallel, or use "
        f"a model whose layers are all softmax attention through transformers' attention interface "
        "(docs/models.md)"
    )


def check_token_mixing(model: nn.Module, blocks: Sequence[nn.Module], attn_of: Finder = None) -> None:
    """Refuses (ValueError) a model with a layer that mixes tokens outside the attention
    interface or changes the attention pattern itself (see the module docstring)."""
    who = type(model).__name__
    attn_of = attn_of or attention_modules
    cfg = getattr(model, "config", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    for i, b in enumerate(blocks):
        layer = f"layer {i} ({type(b).__name__})"
        kind = types[i] if i < len(types) and types[i] not in ATTENTION_LAYER_TYPES else None
        attn = attn_of(b)
        if not attn:
            own = [
                (n, m)
                for n, m in b.named_children()
                if "Attention" in type(m).__name__ and not _MIXER_CLASS.search(type(m).__name__)
            ]
            if own and kind is None:
                n, m = own[0]
                raise ValueError(
                    f"{who}: {layer} computes attention in {n} ({type(m).__name__}) itself, not "
                    f"through transformers' attention interface, so dcparallel cannot install its "
                    f"attention there: {_SHARD}; this layer would attend over its rank's shard only "
                    f"under SP > 1 and across packed documents at SP 1. {_fix(who)}."
                )
            what = f"a layer of type {kind!r}" if kind else "a layer without softmax attention"
            raise ValueError(
                f"{who}: {layer} is {what}: it mixes tokens in {_token_modules(b)}, not through "
                f"transformers' attention interface. {_RECURRENT}. {_fix(who)}."
            )
        mixers = _mixers(b, attn)
        if mixers:
            names = ", ".join(f"{n} ({type(m).__name__})" for n, m in mixers)
            what = f"a layer of type {kind!r}" if kind else "a hybrid layer"
            raise ValueError(
                f"{who}: {layer} is {what}: beside its attention it mixes tokens in {names}. {_RECURRENT}. {_fix(who)}."
            )
        if kind:
            raise ValueError(
                f"{who}: {layer} is a layer of type {kind!r} (config.layer_types[{i}]): its attention "
                f"does not cover exactly the causal prefix of each document, which is what "
                f"dcparallel's attention computes (sliding and chunked windows are checked per "
                f"document at run time). {_fix(who)}."
            )
        for a in attn:
            why = _OWN_MASK.get(type(a).__name__)
            if why is not None:
                raise ValueError(
                    f"{who}: {layer}'s attention {type(a).__name__} uses {why}; dcparallel's "
                    f"attention applies causality and document boundaries itself and has no place "
                    f"for a mask the model computes, so it cannot run this attention exactly (this "
                    f"is the model's own mask: no attention_mask argument of yours causes it). "
                    f"{_fix(who)}."
                )


def resolve(
    model: nn.Module, layers: Sequence[nn.Module] | None, attn: Finder | None, mlp: Finder | None
) -> tuple[list[nn.Module], Finder, Finder]:
    """(blocks, attention finder, MLP finder) of ``model``: overrides where given, else read
    from the structure; the attention finder must find at least one module in every block."""
    blocks = list(layers) if layers is not None else decoder_blocks(model)
    attn_of = attn or attention_modules
    mlp_of = mlp or mlp_modules
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise ValueError(f"layers[{i}] is a {type(b).__name__}, not an nn.Module; pass the decoder blocks")
    if attn is not None:
        for i, b in enumerate(blocks):
            found = attn(b)
            if not found or not all(calls_attention_interface(type(m)) for m in found):
                raise ValueError(
                    f"attn_modules returned {[type(m).__name__ for m in found]} for layer {i} "
                    f"({type(b).__name__}); return the block's attention sub-modules, each of a class "
                    f"that calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS): only "
                    f"those call the attention dcparallel installs"
                )
    check_token_mixing(model, blocks, attn_of)
    who = type(model).__name__
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{who}.forward takes no position_ids, so its positions come from the row index: packed "
            f"documents after the first, and every SP shard after the first, would get wrong positions. "
            f"dcparallel needs each document's own positions; use a causal LM whose forward takes "
            f"position_ids (docs/models.md)"
        )
    return blocks, attn_of, mlp_of


class DocumentLimit:
    """The runtime attention of one layer whose pattern equals plain per-document causal
    attention only while documents (and, for ``local``, the rank's shard of the row) are at
    most ``limit`` tokens: a chunked-attention layer (chunks of ``attention_chunk_size``
    from each row's start) or Llama 4's temperature tuning of no-RoPE layers (a query scale
    that grows with the row position from ``floor_scale`` tokens on). Longer is refused per
    call; everything else goes to the wrapped attention."""

    def __init__(self, fn, limit: int, local: bool, why: str):
        object.__setattr__(self, "fn", fn)
        self.limit, self.local, self.why = limit, local, why

    def __call__(self, q, k, v, pattern, *args, **kwargs):
        longest = self.fn.longest_document(q.shape[1])
        if longest > self.limit or (self.local and q.shape[1] > self.limit):
            what = f"a document of {longest} tokens" if longest > self.limit else f"a row shard of {q.shape[1]} tokens"
            raise ValueError(
                f"{what} is longer than {self.limit}: {self.why}; dcparallel's attention is plain causal "
                f"per document, equal to it only up to {self.limit} tokens. Keep documents (and "
                f"micro-batch rows per rank) within {self.limit} tokens"
            )
        return self.fn(q, k, v, pattern, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


def document_limit(model: nn.Module, index: int, attn: nn.Module) -> tuple[int, bool, str] | None:
    """(limit, local, why) for `DocumentLimit` when layer ``index``'s attention ``attn`` is
    exact only up to a length, else None."""
    cfg = model.config
    i = attn.layer_idx if isinstance(getattr(attn, "layer_idx", None), int) else index
    types = list(getattr(cfg, "layer_types", None) or [])
    out: list[tuple[int, bool, str]] = []
    chunk = getattr(cfg, "attention_chunk_size", None)
    if i < len(types) and types[i] == "chunked_attention" and chunk:
        out.append((int(chunk), False, f"layer {index} is chunked attention (chunks of {chunk} tokens)"))
    if getattr(attn, "attn_temperature_tuning", False) and not getattr(attn, "use_rope", True):
        floor = int(getattr(attn, "floor_scale", 0) or getattr(cfg, "floor_scale", 0))
        out.append(
            (
                floor - 1,
                True,
                f"layer {index} scales its queries by the row position from {floor} tokens on "
                f"(attention temperature tuning of a no-RoPE layer)",
            )
        )
    return min(out) if out else None


def set_block_attention(fn: Any, blocks: Any, attn_of: Any, limits: dict[int, Any]) -> None:
    """Points every attention module of ``blocks`` at ``fn``, wrapped in its `DocumentLimit`
    where ``limits`` (by module id, from `document_limit`) has one."""
    for b in blocks:
        for m in attn_of(b):
            limit = limits[id(m)]
            m.dcparallel_attention = fn if limit is None else DocumentLimit(fn, *limit)
