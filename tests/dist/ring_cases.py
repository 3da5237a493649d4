"""What the gloo workers of `test_dist_ring` run (module level, so spawn pickles it by name):
the Ulysses x ring attention op on its own, and whole steps of models whose micro-batches
run (u, r) splits of one SP group."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.data.ring_order import ring_padded_length, shard_columns
from dcparallel.models.attention import AttnPattern
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime.engine import Engine
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.ulysses import ulysses_attention
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import ClusterSpec, Layout, Recompute, Workload, llama_like
from tests.dist.cases_common import adapter_step
from tests.support import capped, make_data, run_rank_step

#: documents of uneven lengths packed in one row, and the padding after them: 3 + 14 + 1 + 9
#: = 27 real columns of 32 at SP 4 x ring 2 (padded to a multiple of 2 x 4 x 2)
OP_DOCS = (3, 14, 1, 9)


def op_inputs(seed: int, heads: int, kv_heads: int, dim: int = 8, padded_len: int = 32, batch: int = 2):
    """Whole padded rows of q, k, v and an output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, padded_len, heads, dim, generator=g)
    k = torch.randn(batch, padded_len, kv_heads, dim, generator=g)
    v = torch.randn(batch, padded_len, kv_heads, dim + 2, generator=g)  # a value head size of its own
    dout = torch.randn(batch, padded_len, heads, dim + 2, generator=g)
    return q, k, v, dout


def cu_of(docs) -> tuple[int, ...]:
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    return tuple(cu)


def case_op(ring: int, pattern: AttnPattern, heads: int, kv_heads: int, seed: int) -> dict:
    """This rank's columns of the op's output and of dq, dk, dv, for an SP group of the
    whole world split into Ulysses degree world / ring x ring degree ``ring``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cu = cu_of(OP_DOCS)
    padded = ring_padded_length(cu[-1], world, ring)
    q, k, v, dout = op_inputs(seed, heads, kv_heads, padded_len=padded)
    cols = torch.tensor(shard_columns(padded, world, ring, rank))
    groups = ProcessGroups(heads, ring=True)
    group, peers = groups.split(tuple(range(world)), ring)
    mine = [t[:, cols].clone().requires_grad_(True) for t in (q, k, v)]
    out = ulysses_attention(*mine, pattern, group=group, cu_seqlens=cu, ring=peers)
    out.backward(dout[:, cols])
    return {"cols": cols, "out": out.detach(), "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}


def case_op_refused(pattern: AttnPattern, sinks: bool) -> str:
    """The error of a pattern ring attention refuses (ring degree 2 over the world)."""
    world = dist.get_world_size()
    q, k, v, _ = op_inputs(0, 4, 4, padded_len=8 * world)
    groups = ProcessGroups(4, ring=True)
    group, peers = groups.split(tuple(range(world)), 2)
    cols = torch.tensor(shard_columns(8 * world, world, 2, dist.get_rank()))
    try:
        ulysses_attention(
            q[:, cols],
            k[:, cols],
            v[:, cols],
            pattern,
            group=group,
            ring=peers,
            sinks=torch.zeros(4) if sinks else None,
        )
    except ValueError as exc:
        return str(exc)
    return "not refused"


# ---------------------------------------------------------------- whole steps

LLAMA_HEADS, LLAMA_LAYERS = 4, 3


def llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(
        LlamaConfig.tiny(num_layers=LLAMA_LAYERS, num_heads=LLAMA_HEADS, hidden=32, ffn_hidden=48, vocab_size=64)
    )


def mixed_split_plan(world: int, recompute: bool, num_samples: int) -> StepPlan:
    """One group of the whole world whose micro-batches run every (u, r) split of it (the
    samples dealt round the splits, 2-3 packed per micro-batch), then two half-world groups
    each with their own splits; recompute of every layer's attention and MLP or none."""
    rc = Recompute(LLAMA_LAYERS, LLAMA_LAYERS) if recompute else Recompute.none()
    rings = [r for r in range(1, world + 1) if world % r == 0 and LLAMA_HEADS % (world // r) == 0]
    ids = list(range(num_samples))
    wide = [ids[i : i + 3] for i in range(0, 3 * len(rings), 3)]
    mbs = tuple(MicroBatch(tuple(c), Layout(world, len(c), rc, ring)) for c, ring in zip(wide, rings, strict=True))
    rest = ids[3 * len(rings) :]
    half = world // 2
    narrow = (
        GroupPlan(tuple(range(half)), (MicroBatch(tuple(rest[:2]), Layout(half, 2, rc, half)),), 1),
        GroupPlan(tuple(range(half, world)), (MicroBatch(tuple(rest[2:]), Layout(half, len(rest) - 2, rc, 1)),), 1),
    )
    plan = StepPlan(0, tuple(ids), (GroupPlan(tuple(range(world)), mbs, 0), *narrow), 0)
    plan.validate(world)
    return plan


def split_samples(world: int) -> int:
    """How many samples `mixed_split_plan` deals at this world size."""
    return 3 * sum(world % r == 0 and LLAMA_HEADS % (world // r) == 0 for r in range(1, world + 1)) + 4


def case_llama_mixed_splits(seed: int, recompute: bool, num_samples: int) -> dict:
    world = dist.get_world_size()
    plan = mixed_split_plan(world, recompute, num_samples)
    model = llama()
    dc = Engine(model, layers=model.layers, num_heads=LLAMA_HEADS, groups=ProcessGroups(LLAMA_HEADS, ring=True))
    loss = run_rank_step(dc, make_data("llama", num_samples, seed), plan, dist.get_rank())
    return {"loss": loss, "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


#: planning lengths (tokens) of a step whose first sample fits no group of 2 ranks of the
#: 2-head planning model under a 1.5 GiB budget, so the planner (ring on) runs it at SP 4 =
#: Ulysses 1 x ring 4, the others on single ranks in the next phase
PLANNED_SIZES = (120000, 2464, 6670, 3000)
PLANNING_2H = llama_like("tiny-lm-2h", num_layers=4, hidden=384, num_heads=2, ffn_hidden=1032, vocab_size=1000)


def two_head_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.tiny(num_layers=LLAMA_LAYERS, num_heads=2, hidden=32, ffn_hidden=48, vocab_size=64))


def planned_ring_plan(world: int) -> StepPlan:
    """`dcp`'s plan of `PLANNED_SIZES` on one node of ``world`` GPUs with ring on, its
    recompute capped at the test model's layers (the planning model has more)."""
    cl = ClusterSpec(
        world_size=world,
        gpus_per_node=world,
        memory_bytes=1536 * 2**20,
        intra_bw=300e9,
        intra_latency=10e-6,
        inter_bw=40e9,
        inter_latency=20e-6,
        ring=True,
    )
    ctx = PlanContext(Workload(PLANNING_2H, PLANNED_SIZES), AnalyticCost(PLANNING_2H, cl), cl)
    step = Step(0, tuple(range(len(PLANNED_SIZES))))
    return capped(make_planner("dcp", ctx, [step], score=step_seconds(ctx)).plan(step), LLAMA_LAYERS)


def case_planned_ring(seed: int) -> dict:
    """Every rank plans the step itself and runs its part; the groups come from the same
    ClusterSpec (ring on): loss, gradients, plan."""
    world = dist.get_world_size()
    plan = planned_ring_plan(world)
    model = two_head_llama()
    groups = ProcessGroups(2, ClusterSpec(world_size=world, gpus_per_node=world, ring=True))
    dc = Engine(model, layers=model.layers, num_heads=2, groups=groups)
    loss = run_rank_step(dc, make_data("llama", len(PLANNED_SIZES), seed), plan, dist.get_rank())
    return {
        "loss": loss,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "plan": plan.to_json(),
    }


def hf_two_heads(seed: int = 0):
    """A transformers Llama with 2 query heads sharing 1 key/value head: at SP 4 Ulysses
    alone cannot run it (4 does not divide 2), Ulysses 2 x ring 2 and ring 4 can."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = HFLlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").float()


def case_hf_two_heads(seed: int, num_samples: int) -> dict:
    """One step at SP = world: micro-batches at (2, world / 2) and (1, world), recompute on
    the second."""
    from tests.adapter_models import item
    from tests.adapter_models import make_data as hf_data

    world = dist.get_world_size()
    model = hf_two_heads()
    dc = Engine(model, groups=ProcessGroups(2, ring=True))
    ids = list(range(num_samples))
    cut = num_samples // 2
    full = Recompute(2, 2)
    mbs = (
        MicroBatch(tuple(ids[:cut]), Layout(world, cut, Recompute.none(), world // 2)),
        MicroBatch(tuple(ids[cut:]), Layout(world, num_samples - cut, full, world)),
    )
    plan = StepPlan(0, tuple(ids), (GroupPlan(tuple(range(world)), mbs, 0),), 0)
    loss = adapter_step(dc, plan, hf_data("hf-llama", num_samples, seed), item)
    return {"loss": loss, "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _diffusers_engine(model):
    from dcparallel.adapters import find_adapter

    adapter = find_adapter(model)
    return Engine(model, adapter=adapter, groups=ProcessGroups(adapter.num_heads, ring=True))


def case_wan_ring(seed: int) -> dict:
    """A diffusers Wan step: one sample at Ulysses world / 2 x ring 2 on the whole world, one
    at ring = world with recompute, and one at ring 2 on the first half-world group (phase 1)."""
    from tests.adapter_models import build, item
    from tests.adapter_models import make_data as wan_data

    world = dist.get_world_size()
    model = build("wan")
    dc = _diffusers_engine(model)
    full = Recompute(dc.adapter.spec.num_layers, dc.adapter.spec.num_layers)
    half = world // 2
    wide = (MicroBatch((0,), Layout(world, 1, Recompute.none(), 2)), MicroBatch((1,), Layout(world, 1, full, world)))
    plan = StepPlan(
        0,
        (0, 1, 2),
        (
            GroupPlan(tuple(range(world)), wide, 0),
            GroupPlan(tuple(range(half)), (MicroBatch((2,), Layout(half, 1, ring=2)),), 1),
            GroupPlan(tuple(range(half, world)), (), 1),
        ),
        0,
    )
    loss = adapter_step(dc, plan, wan_data("wan", 3, seed), item)
    return {"loss": loss, "grads": {n: p.grad.detach().clone() for n, p in dc.model.named_parameters()}}


# ---------------------------------------------------------------- joint video + text attention

#: video tokens of a joint-attention row (padded at every split of 4 ranks) and text tokens
JOINT_VIDEO, JOINT_TEXT = 11, 5


def joint_inputs(seed: int, heads: int, padded_len: int, dim: int = 8, batch: int = 2) -> dict:
    """Whole padded video rows and the text of a joint attention, the output gradients, and
    a text mask with the last token of the first row and the second of the second padded."""
    g = torch.Generator().manual_seed(seed)
    video = [torch.randn(batch, padded_len, heads, dim, generator=g) for _ in range(4)]
    text = [torch.randn(batch, JOINT_TEXT, heads, dim, generator=g) for _ in range(4)]
    mask = torch.ones(batch, JOINT_TEXT, dtype=torch.bool)
    mask[0, -1] = mask[1, 1] = False
    return {"video": video, "text": text, "mask": mask}


def case_joint_op(ring: int, seed: int) -> dict:
    """This rank's columns of the joint op's video output and video dq, dk, dv; its text
    output; its share of the text's dq, dk, dv. The text output's gradient is split into
    unequal shares over the ranks (rank i gets (i + 1) / sum of (j + 1) of it), as the
    ranks' text streams hand it back; the shares sum to the whole gradient."""
    from dcparallel.runtime.comm import gather_seq, group_rank, heads_to_seq, seq_to_heads
    from dcparallel.runtime.ring_joint import ring_joint_attention

    world, rank = dist.get_world_size(), dist.get_rank()
    heads = 4
    padded = ring_padded_length(JOINT_VIDEO, world, ring)
    x = joint_inputs(seed, heads, padded)
    cols = torch.tensor(shard_columns(padded, world, ring, rank))
    group, peers = ProcessGroups(heads, ring=True).split(tuple(range(world)), ring)
    video = [t[:, cols].clone().requires_grad_(True) for t in x["video"][:3]]
    text = [t.clone().requires_grad_(True) for t in x["text"][:3]]
    q, k, v = seq_to_heads(video, group)
    hs = heads // (world // ring)
    qt, kt, vt = (t.narrow(2, group_rank(group) * hs, hs) for t in text)
    out, out_text = ring_joint_attention(q, k, v, qt, kt, vt, x["mask"], peers, JOINT_VIDEO, padded)
    out, out_text = heads_to_seq(out, group), gather_seq(out_text, group, dim=2)
    share = (rank + 1) / sum(range(1, world + 1))
    torch.autograd.backward([out, out_text], [x["video"][3][:, cols], x["text"][3] * share])
    return {
        "cols": cols,
        "out": out.detach(),
        "out_text": out_text.detach(),
        **{f"d{n}": t.grad for n, t in zip("qkv", video, strict=True)},
        **{f"d{n}_text": t.grad for n, t in zip("qkv", text, strict=True)},
    }


#: `case_prepare_ring`'s documents: one of 200 tokens (no 2 ranks hold it in
#: `PREPARE_MEMORY`, 4 do at Ulysses 2 x ring 2) and short ones
PREPARE_LENGTHS = (200, 23, 31, 17, 40, 12)
#: bytes per rank: the model states (~217 kB) and, measured by the profiler's saved-tensor
#: meter, the 200-token sample's activations with full recompute: ~105 kB at SP 2 (over),
#: ~52 kB at SP 4 (under); the test checks both in the profile it made
PREPARE_MEMORY = 295_000
#: a tiny profiling run: one timed round per layout, micro-batches of 1, full recompute only (the
#: mode `PREPARE_MEMORY` is set for: a second mode would double the profile and decide nothing
#: the test checks), no wall-time budget (a budget would leave the 200-token bucket unmeasured
#: past SP 1)
PREPARE_PROFILE = {
    "repeats": 1,
    "max_repeats": 1,
    "warmup": 1,
    "min_time_s": 0.0,
    "max_mbs": 1,
    "modes": ("full",),
    "budget_s": None,
}


def prepare_data(seed: int):
    """`PREPARE_LENGTHS` documents of random tokens, by sample id (`tests.support.Data`)."""
    from tests import support

    g = torch.Generator().manual_seed(seed)
    docs = {i: torch.randint(0, 96, (n,), generator=g) for i, n in enumerate(PREPARE_LENGTHS)}
    return support.Data("hf-llama", docs, {}, {}, {}, {i: (n,) for i, n in enumerate(PREPARE_LENGTHS)})


def case_prepare_ring(seed: int, memory_bytes: int, profile_path: str) -> dict:
    """`hf_two_heads` wrapped by ``DataCentricParallel(ring=True)``: `prepare` profiles it at
    this world (its default profiled cost) and plans the epoch in one step; the step runs.
    Returns the profile, the plan, the step's loss and full gradients."""
    from dcparallel.api import DataCentricParallel

    data = prepare_data(seed)
    dataset = [data.docs[i] for i in range(len(PREPARE_LENGTHS))]
    model = hf_two_heads()
    dc = DataCentricParallel(model, ring=True, memory_bytes=memory_bytes)
    loader = dc.prepare(
        dataset,
        lengths=list(PREPARE_LENGTHS),
        tokens_per_step=sum(PREPARE_LENGTHS),
        profile_path=profile_path,
        profiler_config=PREPARE_PROFILE,
        planning="thread",
    )
    step = next(iter(loader))
    for batch in step:
        with dc.micro_batch(batch) as ctx:
            ctx.backward(dc.loss_fn(dc.model, batch, ctx))
    loss = dc.sync_gradients()
    return {
        "profile": dc.profile.to_json(),
        "plan": step.plan.to_json(),
        "loss": loss,
        "grads": dc.full_gradients(),
        "state": dc.cost.model_state_bytes(),
        "cluster": dataclasses.asdict(dc.cluster_spec),
    }
