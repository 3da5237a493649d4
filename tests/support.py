"""Shared by unit, dist and e2e tests: tiny models, random samples, random step plans, the
single-process reference, one rank's run of a step, a user's training loop; the torchrun
launch of `tests.torchrun_launch`, re-exported."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dcparallel.cost.schema import Profile
from dcparallel.data.collate import text_batch, video_batch
from dcparallel.loss import per_token_loss, shift_labels
from dcparallel.models.dit import DiT, DiTConfig, draw_flow, flow_matching_loss, patchify
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime.engine import Engine, sample_seed
from dcparallel.spec import Layout, ModelSpec, Recompute, llama_like
from tests.torchrun_launch import ROOT, torchrun, torchrun_train  # noqa: F401  (re-exported)

NUM_HEADS = 4
NUM_LAYERS = 3
#: kinds of `Data` whose samples are token sequences (packed several to a row)
TEXT_PREFIXES = ("llama", "hf-", "custom")


def make_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        return Llama(
            LlamaConfig.tiny(num_layers=NUM_LAYERS, num_heads=NUM_HEADS, hidden=32, ffn_hidden=48, vocab_size=64)
        )
    if kind == "llama-tied":
        return Llama(
            LlamaConfig.tiny(
                num_layers=NUM_LAYERS,
                num_heads=NUM_HEADS,
                hidden=32,
                ffn_hidden=48,
                vocab_size=64,
                tie_embeddings=True,
            )
        )
    if kind == "dit":
        return DiT(DiTConfig.tiny(num_layers=NUM_LAYERS, num_heads=NUM_HEADS, hidden=32, freq_dim=16))
    if kind == "dit-factorized":
        return DiT(DiTConfig.tiny(num_layers=4, num_heads=NUM_HEADS, hidden=32, freq_dim=16, attention="factorized"))
    raise ValueError(kind)


@dataclass
class Data:
    """Whole samples by id. Text: 1-D token ids. Video: patch tokens, positions, frames."""

    kind: str
    docs: dict[int, Tensor]
    labels: dict[int, Tensor]
    positions: dict[int, Tensor]
    frames: dict[int, int]
    shape_of: dict[int, tuple]


def make_data(kind: str, num_samples: int, seed: int) -> Data:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    docs, labels, pos, frames, shape_of = {}, {}, {}, {}, {}
    for i in range(num_samples):
        if kind.startswith("llama"):
            n = rng.randint(2, 37)
            docs[i] = torch.randint(0, 64, (n,), generator=g)
            lab = shift_labels(docs[i])
            if rng.random() < 0.3:  # a prompt whose tokens are not targets
                lab[: n // 3] = -100
            labels[i] = lab
            shape_of[i] = (n,)
        else:
            shape = rng.choice([(2, 4, 6), (3, 4, 4), (1, 6, 6)])  # latent (T, H, W); patch 1x2x2
            lat = torch.randn(4, *shape, generator=g)
            tok, p, grid = patchify(lat, (1, 2, 2))
            docs[i], pos[i], frames[i], shape_of[i] = tok, p, grid[0], shape
    return Data(kind, docs, labels, pos, frames, shape_of)


def _tile(start: int, size: int, rng: random.Random, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    if size in sizes and (size == min(sizes) or rng.random() < 0.4):
        return [tuple(range(start, start + size))]
    half = size // 2
    return _tile(start, half, rng, sizes) + _tile(start + half, half, rng, sizes)


def random_plan(
    data: Data,
    sample_ids: list[int],
    world: int,
    seed: int,
    num_layers: int = NUM_LAYERS,
    sizes: tuple[int, ...] = (1, 2, 4),
    mode: str = "random",
    min_size: int = 1,
) -> StepPlan:
    """Aligned groups, samples dealt unevenly, micro-batches of 1-3 samples (video: same
    shape only), random recompute per micro-batch. ``mode``: "random" (random tiling with
    SP 1/2/4, sometimes an idle group), "world" (one group of the whole world), "idle"
    (a group of half the world + single ranks, one group with no micro-batch), "phases"
    (three phases: narrow groups, then a group of the whole world, then narrow groups again,
    one of them idle: the packed plans' sub-groups run before their wide parent, and `dcp`'s
    two-phase plans run their narrow groups after the wide ones). ``min_size``: every group
    is made of whole aligned blocks of this many ranks (the shard-block rule, shard_size);
    "idle" then pairs the half-world group with blocks of ``min_size``."""
    rng = random.Random(seed)
    allowed = tuple(s for s in sizes if min_size <= s <= world)
    if mode == "world":
        blocks = [(0, tuple(range(world)))]
    elif mode == "idle":
        half = world // 2
        if min_size > 1:
            k = max(half, min_size)
            blocks = [
                (0, b) for b in [tuple(range(k))] + [tuple(range(r, r + min_size)) for r in range(k, world, min_size)]
            ]
        else:
            blocks = [
                (0, b)
                for b in ([tuple(range(half))] if half > 1 else [(0,)]) + [(r,) for r in range(max(half, 1), world)]
            ]
    elif mode == "phases":
        narrow = allowed[:-1] or allowed
        blocks = (
            [(0, b) for b in _tile(0, world, rng, narrow)]
            + [(1, tuple(range(world)))]
            + [(2, b) for b in _tile(0, world, rng, narrow)]
        )
    else:
        blocks = [(0, b) for b in _tile(0, world, rng, allowed)]
    assigned: dict[tuple[int, tuple[int, ...]], list[int]] = {b: [] for b in blocks}
    num_idle = 1 if len(blocks) > 1 and (mode in ("idle", "phases") or rng.random() < 0.6) else 0
    if mode == "phases":  # the whole-world group always runs something
        wide = [b for b in blocks if b[0] == 1]
        rest = [b for b in blocks if b[0] != 1]
        busy = wide + rng.sample(rest, k=len(rest) - num_idle)
    else:
        busy = rng.sample(blocks, k=len(blocks) - num_idle)
    for n, sid in enumerate(sample_ids):  # "phases": every busy group gets a sample first
        assigned[busy[n] if mode == "phases" and n < len(busy) else rng.choice(busy)].append(sid)
    groups = []
    for phase, b in blocks:
        sids = assigned[(phase, b)]
        mbs: list[MicroBatch] = []
        if data.kind.startswith(TEXT_PREFIXES):
            while sids:
                k = rng.randint(1, 3)
                chunk, sids = sids[:k], sids[k:]
                mbs.append(_mb(chunk, len(b), rng, num_layers))
        else:
            by_shape: dict[tuple, list[int]] = {}
            for s in sids:
                by_shape.setdefault(data.shape_of[s], []).append(s)
            for same in by_shape.values():
                while same:
                    k = rng.randint(1, 2)
                    chunk, same = same[:k], same[k:]
                    mbs.append(_mb(chunk, len(b), rng, num_layers))
            rng.shuffle(mbs)
        groups.append(GroupPlan(b, tuple(mbs), phase))
    plan = StepPlan(
        index=0,
        sample_ids=tuple(sample_ids),
        groups=tuple(groups),
        num_tokens=sum(data.docs[s].shape[0] for s in sample_ids),
    )
    plan.validate(world)
    return plan


def _mb(chunk: list[int], sp: int, rng: random.Random, num_layers: int) -> MicroBatch:
    rc = Recompute(rng.randint(0, num_layers), rng.randint(0, num_layers))
    return MicroBatch(tuple(chunk), Layout(sp, len(chunk), rc))


def reference(
    model: torch.nn.Module, data: Data, sample_ids: list[int], seed: int = 0, epoch: int = 0
) -> tuple[float, dict[str, Tensor]]:
    """Single process, one sample at a time, plain autograd: mean loss over all targets of
    the samples and the gradient of that mean."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0.0
    losses = []
    for sid in sample_ids:
        if data.kind.startswith("llama"):
            d = data.docs[sid]
            ptl, mask = per_token_loss(model(d[None]), data.labels[sid][None])
        else:
            g = torch.Generator().manual_seed(sample_seed(seed, epoch, sid))
            x0 = data.docs[sid]
            t, noise = draw_flow(g, x0.shape[0], x0.shape[1])
            ptl = flow_matching_loss(model, x0[None], data.positions[sid][None], t[None], noise[None], data.frames[sid])
            mask = torch.ones_like(ptl, dtype=torch.bool)
        losses.append(ptl[mask].sum())
        count += float(mask.sum())
    loss = torch.stack(losses).sum() / count
    loss.backward()
    total = float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


def run_rank_step(dc: Engine, data: Data, plan: StepPlan, rank: int, backward_outside: bool = False) -> float:
    """This rank's micro-batches of the plan, then the step's gradient sync.
    ``backward_outside``: call backward after the micro-batch block has exited."""
    model = dc.model
    work = plan.work_of(rank)
    for j, (mb, ranks) in enumerate(work):
        if data.kind.startswith("llama"):
            batch = text_batch(mb, ranks, rank, data.docs, data.labels)
        else:
            batch = video_batch(mb, ranks, rank, data.docs, data.positions, data.frames[mb.sample_ids[0]])
        # the last micro-batch's backward launches the gradient buckets (overlapped sync)
        with dc.micro_batch(batch, last=j == len(work) - 1) as ctx:
            if data.kind.startswith("llama"):
                ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
            else:
                ts, noise = [], []
                for sid in batch.sample_ids:
                    t, n = draw_flow(ctx.generator(sid), batch.seq_len, batch.inputs.shape[-1])
                    ts.append(t)
                    noise.append(batch.shard_sample(n))
                ptl = flow_matching_loss(
                    model, batch.inputs, batch.positions, torch.stack(ts), torch.stack(noise), batch.frames
                )
            loss = ctx.token_loss(ptl, batch.loss_mask)
            if not backward_outside:
                ctx.backward(loss)
        if backward_outside:
            loss.backward()
    return dc.sync_gradients()


def rel_err(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reference_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """torch's AdamW as ZeroAdamW(lr=1e-2, weight_decay=0.1) is set up: decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=1e-2)


def capped(plan: StepPlan, num_layers: int) -> StepPlan:
    """The plan with each micro-batch's recompute capped at `num_layers` (a plan made for a
    planning model with more layers, run on a small test model)."""

    def cap(mb: MicroBatch) -> MicroBatch:
        rc = mb.layout.recompute
        return MicroBatch(
            mb.sample_ids,
            Layout(
                mb.layout.sp,
                mb.layout.mbs,
                Recompute(min(rc.attn, num_layers), min(rc.mlp, num_layers)),
                mb.layout.ring,
            ),
        )

    groups = tuple(GroupPlan(g.ranks, tuple(cap(mb) for mb in g.micro_batches), g.phase) for g in plan.groups)
    return StepPlan(plan.index, plan.sample_ids, groups, plan.num_tokens)


_REFERENCES: dict = {}


def reference_once(key: tuple, compute):
    """``compute()`` (a single-process reference: loss and gradients), computed once per key in
    this pytest process. A parity test runs at world 2 and again at world 4 against the same
    model, data and seeds; the reference is the same, so the second world reuses it."""
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def train_steps(dc: Any, model: torch.nn.Module, loader: Any, opt: Any) -> Iterator[tuple[Any, float]]:
    """One pass of ``loader`` as a user's loop trains it: every micro-batch of a step through
    ``dc.loss_fn`` (forward and backward), the gradient sync, the optimizer step; yields each
    step and its loss after its optimizer step."""
    for step in loader:
        for batch in step:
            with dc.micro_batch(batch) as ctx:
                ctx.backward(dc.loss_fn(model, batch, ctx))
        loss = dc.sync_gradients()
        opt.step()
        yield step, loss


#: the 2-head model of the hand-written world-4 profiles (`two_head_profile`)
TWO_HEADS = llama_like("tiny-lm-2h", num_layers=4, hidden=64, num_heads=2, ffn_hidden=160, vocab_size=1000)


def two_head_profile(entries: list[dict[str, Any]]) -> Profile:
    """A world-4 profile of `TWO_HEADS` (4 GPUs on one node) with buckets of 500 and 4000
    tokens, keyed ``t500`` and ``t4000``, holding ``entries``; read back from its JSON as a
    saved profile is."""
    return Profile.from_json(
        Profile(
            fingerprint={"world_size": 4},
            model=TWO_HEADS,
            world_size=4,
            gpus_per_node=4,
            model_state_bytes=1e4,
            grad_sync_s=1e-3,
            buckets=[{"key": k, "size": t, "tokens": t} for k, t in (("t500", 500), ("t4000", 4000))],
            entries=entries,
        ).to_json()
    )


def one_entry_profile_json(model: ModelSpec) -> dict[str, Any]:
    """The JSON of a world-1 profile of ``model``: one 64-token bucket, one feasible entry
    (SP 1, one micro-batch, no recompute, 10 ms, 1 MB)."""
    e = {"bucket": "t64", "sp": 1, "mbs": 1, "recompute": "none", "time_s": 0.01, "memory_bytes": 1e6, "feasible": True}
    p = Profile(
        fingerprint={},
        model=model,
        world_size=1,
        gpus_per_node=1,
        model_state_bytes=1e6,
        grad_sync_s=0.0,
        buckets=[{"key": "t64", "size": 64, "tokens": 64}],
        entries=[e],
    )
    return p.to_json()


class FakeClock:
    """The budget's clock (`profile.budget._now`), moved only by the fake measurements."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def slow_measure(prof, clock: FakeClock, calls: list | None = None, scale: float = 1.0):
    """A profiler's `_measure` of one layout that takes (on ``clock``) ``scale`` x 0.1 s per
    16 tokens per run of both short stacks, once for memory and once per timed round, and
    reports that time; each call's (size, mbs, mode, rounds) appended to ``calls``."""

    def measure(size, ranks, mbs, mode, depths, full_depth=None, ring=None):
        run = scale * 0.1 * mbs * size / 16
        rounds = prof.round_config.repeats
        clock.t += run * (1 + rounds)
        if calls is not None:
            calls.append((size, mbs, mode, rounds))
        return {
            "ok": True,
            "memory": {d: 1000.0 * d * mbs * size for d in depths},
            "time": {depths[0]: run / 3, depths[1]: 2 * run / 3},
            "slope": run / 3,
            "spread": 0.0,
            "rounds": rounds,
            "rejected": 0,
        }

    return measure
