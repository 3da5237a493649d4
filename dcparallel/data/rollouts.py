"""Rollouts: in-memory samples with per-token tensors, routed to the ranks that run them.

An RL step's samples are not in a dataset: each rank holds the rollouts it generated. A
rollout is a mapping with ``input_ids`` (1-D token ids, prompt and completion) and any
number of per-token tensors aligned with them (entry t belongs to token t: its advantage,
the old policy's log-probability of token t given the tokens before it, ...); the optional
bool ``loss_mask`` says which tokens are trained (default: every token but the first).

Conventions (pure tensor code, no collectives; `runtime.rollout_step` moves the bytes):

- global sample ids are rank-major: rank r's j-th rollout is ``sum(counts[:r]) + j``;
- `routes` says which rollouts each rank sends to each rank for a `StepPlan` (every rank
  of the SP group that runs a rollout gets it whole; in ascending global id);
- `pack` / `unpack` turn rollouts into one flat byte buffer and back, field by field in
  the `Schema`'s order, so a receiver needs only the lengths and the schema to cut it;
- `rollout_batch` collates a micro-batch into this rank's `Batch`: labels are the next
  tokens where ``loss_mask`` marks them, and every per-token tensor is shifted like the
  labels (position p holds the value of token p + 1, the one predicted at p) before it is
  sharded, so a loss reads ``batch.per_token[name]`` next to ``batch.labels``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from dcparallel.data.batch import Batch
from dcparallel.data.collate import padded_length, text_batch
from dcparallel.loss import IGNORE_INDEX, shift_labels
from dcparallel.plan.types import MicroBatch, StepPlan

__all__ = ["Field", "Holdings", "Schema", "pack", "read_rollouts", "rollout_batch", "routes", "unpack"]

INPUT_IDS, LOSS_MASK = "input_ids", "loss_mask"


@dataclass(frozen=True)
class Field:
    """One per-token tensor of every rollout: (tokens, *shape) of ``dtype``."""

    name: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``float32``, ``bool``, ...)"""
    shape: tuple[int, ...] = ()
    """trailing dims after the token dim"""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def bytes_per_token(self) -> int:
        n = torch.empty((), dtype=self.torch_dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Schema:
    """The per-token fields every rollout carries, ``input_ids`` first, the rest by name."""

    fields: tuple[Field, ...]

    def bytes_per_token(self) -> int:
        return sum(f.bytes_per_token() for f in self.fields)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


@dataclass(frozen=True)
class Holdings:
    """What one rank holds: its rollouts' token counts and trained-token counts, and their schema."""

    lengths: tuple[int, ...]
    targets: tuple[int, ...]
    schema: Schema | None
    """None when the rank holds no rollout"""


def _field(name: str, t: Tensor) -> Field:
    return Field(name, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))


def _check_one(j: int, s: Mapping[str, Tensor]) -> Schema:
    if not isinstance(s, Mapping) or INPUT_IDS not in s:
        raise ValueError(
            f"rollout {j} must be a mapping with '{INPUT_IDS}' (1-D token ids) and per-token tensors; "
            f"got {type(s).__name__}" + (f" with keys {sorted(s)}" if isinstance(s, Mapping) else "")
        )
    ids = s[INPUT_IDS]
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.numel() < 2:
        raise ValueError(
            f"rollout {j}: '{INPUT_IDS}' must be a 1-D integer tensor of at least 2 tokens; got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {tuple(getattr(ids, 'shape', ()))}"
        )
    fields = [Field(INPUT_IDS, "int64")]
    for name in sorted(k for k in s if k != INPUT_IDS):
        t = s[name]
        if not isinstance(t, Tensor) or t.dim() < 1 or t.shape[0] != ids.numel():
            raise ValueError(
                f"rollout {j}: '{name}' must be a per-token tensor of {ids.numel()} entries along dim 0 "
                f"(one per input id); got shape {tuple(getattr(t, 'shape', ()))} — per-sample values "
                f"(a reward, an advantage) go to every token of the sample"
            )
        if name == LOSS_MASK and (t.dim() != 1 or t.dtype != torch.bool):
            raise ValueError(f"rollout {j}: '{LOSS_MASK}' must be a 1-D bool tensor; got {t.dtype} {tuple(t.shape)}")
        fields.append(_field(name, t))
    return Schema(tuple(fields))


def _mask(s: Mapping[str, Tensor]) -> Tensor:
    m = s.get(LOSS_MASK)
    if m is None:
        m = torch.ones(s[INPUT_IDS].numel(), dtype=torch.bool)
    return m


def num_targets(s: Mapping[str, Tensor]) -> int:
    """Tokens of the rollout that are trained (its first token never is: nothing predicts it)."""
    return int(_mask(s)[1:].sum())


def read_rollouts(samples: Sequence[Mapping[str, Tensor]]) -> Holdings:
    """Checks this rank's rollouts (ValueError naming the rollout and field) and returns
    what the ranks exchange before planning: lengths, trained tokens, the schema."""
    schema = None
    for j, s in enumerate(samples):
        mine = _check_one(j, s)
        if schema is None:
            schema = mine
        elif mine != schema:
            raise ValueError(
                f"rollout {j} has fields {mine.fields} but rollout 0 has {schema.fields}; give every "
                f"rollout the same per-token tensors with the same dtypes"
            )
    return Holdings(tuple(int(s[INPUT_IDS].numel()) for s in samples), tuple(num_targets(s) for s in samples), schema)


def owners(counts: Sequence[int]) -> list[int]:
    """The rank holding each global sample id (rank-major ids)."""
    return [r for r, n in enumerate(counts) for _ in range(n)]


def routes(plan: StepPlan, owner: Sequence[int], world_size: int) -> list[list[list[int]]]:
    """``out[src][dst]``: the global ids rank ``src`` sends rank ``dst`` (ascending): every
    rollout to every rank of the group that runs it, once per rank."""
    need: list[set[int]] = [set() for _ in range(world_size)]
    for g in plan.groups:
        ids = [i for mb in g.micro_batches for i in mb.sample_ids]
        for r in g.ranks:
            need[r].update(ids)
    out = [[[] for _ in range(world_size)] for _ in range(world_size)]
    for dst in range(world_size):
        for i in sorted(need[dst]):
            out[owner[i]][dst].append(i)
    return out


def nbytes(ids: Sequence[int], lengths: Sequence[int], schema: Schema) -> int:
    return sum(lengths[i] for i in ids) * schema.bytes_per_token()


def pack(samples: Mapping[int, Mapping[str, Tensor]], ids: Sequence[int], schema: Schema) -> Tensor:
    """The rollouts ``ids`` as one flat uint8 buffer: sample by sample, field by field."""
    parts = [
        samples[i][f.name].detach().to("cpu", f.torch_dtype).contiguous().reshape(-1).view(torch.uint8)
        for i in ids
        for f in schema.fields
    ]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buf: Tensor, ids: Sequence[int], lengths: Sequence[int], schema: Schema) -> dict[int, dict[str, Tensor]]:
    """`pack`'s inverse, given the senders' lengths and schema."""
    out: dict[int, dict[str, Tensor]] = {}
    at = 0
    for i in ids:
        s = {}
        for f in schema.fields:
            n = lengths[i] * f.bytes_per_token()
            s[f.name] = buf[at : at + n].clone().view(f.torch_dtype).reshape(lengths[i], *f.shape)
            at += n
        out[i] = s
    assert at == buf.numel(), (at, buf.numel())
    return out


def shifted(x: Tensor) -> Tensor:
    """Per-token values aligned with the labels: position p holds token p + 1's, the last 0."""
    out = torch.zeros_like(x)
    out[:-1] = x[1:]
    return out


def _shard(row: Tensor, padded_len: int, sp: int, slot: int) -> Tensor:
    """(L, ...) -> (1, padded_len // sp, ...): columns of shard ``slot``, zero past L."""
    ls = padded_len // sp
    lo = slot * ls
    out = row.new_zeros((1, ls, *row.shape[1:]))
    real = max(0, min(ls, row.shape[0] - lo))
    out[0, :real] = row[lo : lo + real]
    return out


def rollout_batch(
    mb: MicroBatch, ranks: Sequence[int], rank: int, samples: Mapping[int, Mapping[str, Tensor]]
) -> Batch:
    """This rank's `Batch` of a micro-batch of rollouts: packed into one row like text
    (`collate.text_batch`), labels only where ``loss_mask`` marks the token, and every other
    per-token tensor shifted like the labels and sharded (``Batch.per_token``)."""
    docs = {i: samples[i][INPUT_IDS] for i in mb.sample_ids}
    labels = {}
    for i in mb.sample_ids:
        lab = shift_labels(docs[i].long())
        lab[~shifted(_mask(samples[i]))] = IGNORE_INDEX
        labels[i] = lab
    batch = text_batch(mb, ranks, rank, docs, labels)
    names = [k for k in samples[mb.sample_ids[0]] if k not in (INPUT_IDS, LOSS_MASK)] if mb.sample_ids else []
    sp, slot = len(ranks), batch.rank_in_group
    per_token = {
        k: _shard(
            torch.cat([shifted(samples[i][k]) for i in mb.sample_ids]), padded_length(batch.seq_len, sp), sp, slot
        )
        for k in names
    }
    return dataclasses.replace(batch, per_token=per_token)


def rollout_sizes(max_tokens: int) -> tuple[int, ...]:
    """Sizes to price a cost model over for rollouts of up to ``max_tokens`` tokens: powers
    of two from 64, then ``max_tokens`` itself."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(
            f"max_tokens={max_tokens!r}: give the most tokens a rollout (prompt and completion) can have, an int >= 2"
        )
    sizes = [n for n in (2**k for k in range(6, 40)) if n < max_tokens]
    return (*sizes, max_tokens)


class Piece(NamedTuple):
    """The tokens ``lo:hi`` (positions in rollout ``sample``) that one shard of a micro-batch holds."""

    sample: int
    lo: int
    hi: int


def shard_pieces(mb: MicroBatch, slot: int, lengths: Sequence[int]) -> list[Piece]:
    """The rollouts' tokens shard ``slot`` of micro-batch ``mb`` holds (its packed row cut
    as `rollout_batch` cuts it), in the micro-batch's sample order; empty pieces left out."""
    seq = sum(lengths[i] for i in mb.sample_ids)
    ls = padded_length(seq, mb.layout.sp) // mb.layout.sp
    col_lo, col_hi = slot * ls, (slot + 1) * ls
    out, start = [], 0
    for i in mb.sample_ids:
        lo, hi = max(start, col_lo), min(start + lengths[i], col_hi)
        if hi > lo:
            out.append(Piece(i, lo - start, hi - start))
        start += lengths[i]
    return out
