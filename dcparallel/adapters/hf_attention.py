"""The attention function dcparallel registers in transformers' `AttentionInterface`, and
its keyword contract: every keyword a model passes is handled exactly or refused.

A transformers attention module calls ``attention_interface(module, query, key, value,
attention_mask, **keywords)`` with q (B, H, L, Dqk), k (B, H_kv, L, Dqk), v (B, H_kv, L, Dv)
(Dv differs for multi-head latent attention, DeepSeek-V2/V3) and takes back ((B, L, H, Dv),
weights). The keywords are the module's own (``scaling``, ``dropout``, ``sliding_window``,
``softcap``, ``s_aux``, ...) plus whatever reached its forward through ``**kwargs`` (the
model's `TransformersKwargs`, e.g. ``position_ids``). `HANDLED` lists the keywords this
function implements exactly (or whose value it checks, refusing the values it cannot honor);
`REFUSED` lists the ones it refuses, with the reason, unless passed as None (the feature off).
Any other keyword is refused, whatever its value: a new transformers release that passes
something new fails loudly instead of training wrongly.
``tests/unit/test_hf_attention_keywords.py`` reads the installed transformers' attention
call sites and fails on a keyword that is on neither list.

The runtime's attention (`dcparallel.runtime.ulysses.UlyssesAttention`, installed on each
attention module as ``dcparallel_attention``) applies causality and the packed row's document
boundaries itself; transformers builds no mask for a name its mask registry does not know.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from dcparallel.models.attention import AttnPattern

NAME = "dcparallel"
#: the keyword dcparallel's VLM adapter passes through the language model for Gemma 3's images
BLOCKS = "dcp_bidirectional_blocks"

#: keyword -> how this function honors it exactly (values it cannot honor are refused)
HANDLED: dict[str, str] = {
    "query": "the query (B, H, L, Dqk), when passed by name",
    "key": "the key (B, H_kv, L, Dqk), when passed by name",
    "value": "the value (B, H_kv, L, Dv), when passed by name",
    "attention_mask": "None only: causality and document boundaries come from the micro-batch; a mask is refused",
    "scaling": "the logit scale: the query is multiplied so the kernel's 1/sqrt(Dqk) gives it",
    "dropout": "0 (evaluation, or attention_dropout 0) is exact; a non-zero probability in training is refused",
    "sliding_window": "a query sees the window's latest keys of its document (key > query - window, "
    "transformers' mask), in the kernel (AttnPattern.window)",
    "softcap": "logit softcapping cap * tanh(logits / cap) before the causal mask, in the kernel's eager path",
    "s_aux": "per-head sink logits in the softmax's denominator (gpt-oss), each SP rank using its own heads'",
    "is_causal": "True or None (causal, the module's own is_causal True); False (bidirectional) is refused",
    "output_attentions": "False or None; True is refused (no attention weights are formed)",
    "deterministic": "flash-attention's deterministic-backward switch: it fixes a summation order, not the result",
    "position_ids": "used by the model's rotary embedding before the call; transformers' flash path reads "
    "document starts from position resets, which are exactly the micro-batch's documents",
    "cu_seq_lens_q": "packed document boundaries: checked equal to the micro-batch's (refused otherwise)",
    "cu_seq_lens_k": "packed document boundaries: checked equal to the micro-batch's (refused otherwise)",
    "max_length_q": "the longest packed document, flash-attention metadata derived from cu_seq_lens_q",
    "max_length_k": "the longest packed document, flash-attention metadata derived from cu_seq_lens_k",
    "use_cache": "the KV cache is updated by the module before the call; the attention function never reads it",
    "output_router_logits": "a model-level output switch (MoE routers); attention does not read it",
    "output_hidden_states": "a model-level output switch; attention does not read it",
    "num_items_in_batch": "a loss normalizer of transformers' own loss; attention does not read it",
    "seq_idx": "a packed-sequence index for state-space layers; attention does not read it",
    "return_dict": "a model-level output switch; attention does not read it",
    "max_seqlen": "the longest packed segment, flash-attention metadata of cu_seqlens (refused itself)",
    BLOCKS: "bidirectional spans of the whole row (dcparallel's own keyword, passed by its Gemma 3 adapter: each "
    "image's token block, per document), in the kernel (AttnPattern.blocks)",
}

_STATE = (
    "keys and values read inside the attention function from a cache or another layer are not "
    "implemented; dcparallel's attention sees only this call's q, k, v (train a model without them)"
)
_UNVERIFIED = (
    "a model-specific input dcparallel has not verified the attention ignores; dcparallel drives causal "
    "text decoders (train one of those)"
)

#: keyword -> why it is refused and what to do instead
REFUSED: dict[str, str] = {
    "position_bias": "an additive relative-position bias (T5-style) is not implemented by dcparallel's kernels; "
    "use a model with rotary or learned positions",
    "indices": "sparse attention over a learned top-k choice of keys (DeepSeek-V3.2's indexer) is not "
    "implemented; train the dense-attention variant (DeepSeek-V3)",
    "block_indices": "block-sparse attention is not implemented; train a dense-attention model",
    "sinks": "this model's own sink tensor convention is not implemented (dcparallel implements gpt-oss's "
    "per-head `s_aux` logits); train a model that passes s_aux",
    "cu_seqlens": "segment boundaries of a vision encoder's packed images are not implemented; dcparallel drives "
    "causal text decoders and packs their documents itself",
    "position_embeddings": "rotary embeddings handed to the attention function (to apply or undo inside it) are "
    "not implemented; dcparallel's attention takes q, k, v already rotated",
    "cache": _STATE,
    "cache_offset": _STATE,
    "shared_kv_states": _STATE,
    **{
        word: _UNVERIFIED
        for word in (
            "inputs_embeds",
            "cycle_offset",
            "t_cond",
            "grid_thw",
            "always_partition",
            "output_hidden_states_before_downsampling",
        )
    },
}

assert not set(HANDLED) & set(REFUSED)


def _refuse(module: nn.Module, word: str, why: str) -> ValueError:
    return ValueError(f"{type(module).__name__} passes `{word}` to the attention function: {why}")


def check_keywords(module: nn.Module, keywords: dict[str, Any]) -> None:
    """Raises for the first keyword not in `HANDLED`: a refused one with its reason unless its
    value is None (the feature is off: nothing to drop), an unknown one always (never ignored)."""
    for word in sorted(keywords):
        if word in HANDLED:
            continue
        if word in REFUSED:
            if keywords[word] is None:
                continue
            raise _refuse(module, word, REFUSED[word])
        raise _refuse(
            module,
            word,
            "dcparallel does not know this keyword, so it refuses it rather than ignore it "
            "(ignoring it could train wrongly); use a transformers version whose model does "
            "not pass it, or implement it in dcparallel.adapters.hf_attention (HANDLED) with "
            "a parity test",
        )


def _check_values(module: nn.Module, fn: Any, length: int, kw: dict[str, Any]) -> None:
    if kw.get("attention_mask") is not None:
        raise ValueError(
            "dcparallel's attention builds causality and document boundaries itself; call the model "
            "without attention_mask (pass position_ids=batch.positions)"
        )
    if kw.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise _refuse(
            module,
            "is_causal",
            "bidirectional attention (is_causal False) is not implemented for text "
            "models; dcparallel's text attention is causal: set the config's "
            "use_bidirectional_attention to False",
        )
    dropout = kw.get("dropout") or 0.0
    if dropout and module.training:
        raise ValueError(
            f"attention dropout {dropout} is not supported under dcparallel; set the config's attention_dropout to 0"
        )
    if kw.get("output_attentions"):
        raise _refuse(
            module,
            "output_attentions",
            "attention weights are never formed; call the model with output_attentions=False",
        )
    for word in ("cu_seq_lens_q", "cu_seq_lens_k"):
        given = kw.get(word)
        if given is not None:
            ours = fn.document_boundaries(length)
            if [int(x) for x in given.reshape(-1).tolist()] != list(ours):
                raise _refuse(
                    module,
                    word,
                    f"boundaries {given.tolist()} differ from the micro-batch's documents "
                    f"{list(ours)}; dcparallel packs documents itself: leave {word} out",
                )


def hf_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
) -> tuple[Tensor, None]:
    """transformers' attention signature: q (B, H, L, Dqk), k (B, H_kv, L, Dqk), v (B, H_kv,
    L, Dv) -> ((B, L, H, Dv), no weights), through the runtime attention installed on
    ``module``; see the module docstring for the keywords."""
    fn = getattr(module, "dcparallel_attention", None)
    if fn is None:
        raise RuntimeError(
            f"{type(module).__name__} runs dcparallel's attention but none was installed; wrap the "
            f"model with dcparallel.DataCentricParallel first"
        )
    check_keywords(module, kwargs)
    _check_values(module, fn, query.shape[2], {"attention_mask": attention_mask, **kwargs})
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    scaling = kwargs.get("scaling")
    d = q.shape[-1]
    if scaling is not None and abs(scaling * d**0.5 - 1.0) > 1e-9:
        q = q * (scaling * d**0.5)  # the kernel scales by 1/sqrt(Dqk)
    pattern = AttnPattern(
        "causal",
        softcap=kwargs.get("softcap"),
        window=kwargs.get("sliding_window"),
        blocks=tuple(kwargs.get(BLOCKS) or ()),
    )
    sinks = kwargs.get("s_aux")
    if sinks is None:
        return fn(q, k, v, pattern), None
    return fn(q, k, v, pattern, sinks=sinks), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, hf_attention)
