"""What Ulysses moves for a model's heads: how often each key / value head is repeated so
that the heads split evenly over an SP group, and the all-to-all volume that follows, per
attention sub-block and per planner layer (read by the cost models and by `runtime.ulysses`)."""

from __future__ import annotations

import math

from dcparallel.spec import ModelSpec

#: all-to-all calls one attention sub-block's Ulysses forward makes (`runtime.ulysses`: q, k
#: and v travel in one, the output back in another); its backward mirrors them. The cost
#: models charge a link's latency per call and its bandwidth per byte (`a2a_hidden_units`).
ULYSSES_CALLS = 2


def kv_repeats(num_kv_heads: int, sp: int) -> int:
    """How many times Ulysses repeats each key/value head at SP degree ``sp`` so that the
    heads split evenly over the group: 1 when sp divides them, else sp / gcd(sp, kv heads)."""
    return sp // math.gcd(sp, num_kv_heads)


def kv_heads_sent(num_kv_heads: int, sp: int) -> int:
    """Key/value heads that one Ulysses all-to-all moves at SP degree ``sp`` (after repeats)."""
    return num_kv_heads * kv_repeats(num_kv_heads, sp) if sp > 1 else num_kv_heads


def a2a_hidden_units(model: ModelSpec, sp: int) -> float:
    """What one attention sub-block's Ulysses all-to-alls move forward per token, in units of
    the hidden size: q and the (repeated) k to head sharding at the query/key head size, v
    there and the output back at the value head size — (H + kv) (Dqk + Dv) / hidden; 2 + 2 kv / H
    when the heads split the hidden size."""
    qk = model.head_dim * model.num_heads / model.hidden if model.head_dim else 1.0
    v = model.v_head_dim * model.num_heads / model.hidden if model.v_head_dim else qk
    return (1 + kv_heads_sent(model.kv_heads, sp) / model.num_heads) * (qk + v)


def layer_a2a_units(model: ModelSpec, sp: int) -> float:
    """What one planner layer's Ulysses all-to-alls move forward per token, in units of the
    hidden size: every attention sub-block sends its q, k, v to head sharding and its output
    back (`a2a_hidden_units`) — each of a factorized DiT pair's spatial and temporal blocks
    too, since `runtime.ulysses` hands each block the whole row for its heads, frames and
    all (8 units a pair of multi-head blocks)."""
    return model.attn_per_layer * a2a_hidden_units(model, sp)


def layer_a2a_calls(model: ModelSpec) -> int:
    """All-to-all calls one planner layer's forward makes: `ULYSSES_CALLS` per attention
    sub-block."""
    return ULYSSES_CALLS * model.attn_per_layer
