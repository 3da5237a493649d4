"""The runtime smoke run: a short training loop of the reference LM on hand-made step plans
(tests/e2e/test_runtime_smoke.py, tests/e2e/test_multinode_torchrun.py).

    torchrun --standalone --nproc-per-node 2 tests/e2e/smoke_worker.py --steps 30

Every step has the same kind of samples (arithmetic token sequences of uneven lengths,
learnable in a few dozen steps) but cycles through layouts: one SP=2 group running a
long sample + a packed pair; two SP=1 groups with 3 vs. 1 micro-batches; one rank with all
the work and one with none; recompute on, off and partial. World 4 (e.g. two "nodes" of
2 ranks: ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d ...``) runs an SP=4
group over all ranks, then SP=2 groups inside the nodes with an idle rank, then SP=1 groups
with uneven counts. The last micro-batch of each rank overlaps the gradient sync. One
metrics line per step on rank 0; ``--out FILE`` writes the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch

from dcparallel.data.collate import text_batch
from dcparallel.loss import per_token_loss
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime import comm
from dcparallel.runtime.engine import Engine
from dcparallel.runtime.launch import cluster_from_env, end_distributed, init_distributed
from dcparallel.spec import Layout, Recompute

CONFIG = LlamaConfig.tiny(vocab_size=64, hidden=64, num_layers=2, num_heads=4, ffn_hidden=128)
VOCAB = CONFIG.vocab_size


def make_docs(step: int, lengths: list[int]) -> dict[int, torch.Tensor]:
    """Sample i of a step: start a, stride b, tokens (a + j b) mod VOCAB."""
    g = torch.Generator().manual_seed(1000 + step)
    docs = {}
    for i, n in enumerate(lengths):
        a, b = torch.randint(0, VOCAB, (2,), generator=g).tolist()
        docs[i] = (a + torch.arange(n) * (b % 7 + 1)) % VOCAB
    return docs


def hand_made_plan(step: int, world: int, num_layers: int) -> tuple[StepPlan, list[int]]:
    """Cycles through three layouts (world 2); world 1 runs everything on rank 0."""
    full = Recompute.full(num_layers)
    part = Recompute(1, 0)
    none = Recompute.none()
    mb = lambda ids, sp, rc=none: MicroBatch(tuple(ids), Layout(sp, len(ids), rc))
    lengths = [97, 33, 21, 40, 18]
    ids = list(range(len(lengths)))
    kind = step % 3
    if world == 1:
        groups = (GroupPlan((0,), (mb([0], 1, full), mb([1, 2], 1), mb([3, 4], 1, part))),)
    elif world == 4 and kind == 0:  # one SP=4 group over both nodes
        groups = (GroupPlan((0, 1, 2, 3), (mb([0], 4, full), mb([1, 2, 3, 4], 4, part))),)
    elif world == 4 and kind == 1:  # an SP=4 phase, then SP=2 groups inside the nodes, one idle
        groups = (
            GroupPlan((0, 1, 2, 3), (mb([0], 4, part),)),
            GroupPlan((0, 1), (mb([1, 2], 2), mb([3, 4], 2, full)), phase=1),
            GroupPlan((2, 3), (), phase=1),
        )
    elif world == 4:  # SP=1 everywhere, 0 / 1 / 1 / 2 micro-batches
        groups = (
            GroupPlan((0,), ()),
            GroupPlan((1,), (mb([0], 1, full),)),
            GroupPlan((2,), (mb([1, 2], 1),)),
            GroupPlan((3,), (mb([3], 1, part), mb([4], 1))),
        )
    elif kind == 0:  # one SP=2 group: the long sample alone, recomputed; the rest packed
        groups = (GroupPlan((0, 1), (mb([0], 2, full), mb([1, 2, 3, 4], 2, part))),)
    elif kind == 1:  # two SP=1 groups, 1 vs 3 micro-batches
        groups = (
            GroupPlan((0,), (mb([0], 1, full),)),
            GroupPlan((1,), (mb([1, 2], 1), mb([3], 1), mb([4], 1, part))),
        )
    else:  # all work on rank 1, rank 0 idle but still in the gradient sync
        groups = (GroupPlan((0,), ()), GroupPlan((1,), (mb([0, 1], 1, part), mb([2, 3, 4], 1))))
    plan = StepPlan(step, tuple(ids), groups, sum(lengths))
    plan.validate(world)
    return plan, lengths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=None, help="write the per-step losses here (JSON), rank 0")
    ap.add_argument("--bucket-kib", type=int, default=None, help="gradient bucket size (default: 25 MiB)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    launch = init_distributed(timeout=timedelta(seconds=60))
    world, rank = comm.world_size(), comm.world_rank()
    if world not in (1, 2, 4):
        raise ValueError(f"the smoke plans are for 1, 2 or 4 ranks; got world size {world}")

    cfg = CONFIG
    torch.manual_seed(0)
    model = Llama(cfg).to(launch.device)
    cluster = cluster_from_env(num_heads=cfg.num_heads, memory_bytes=2**30, device=launch.device)
    dc = Engine(model, layers=model.layers, num_heads=cfg.num_heads, cluster=cluster)
    if args.bucket_kib is not None:
        dc.grad_sync.set_bucket_bytes(args.bucket_kib * 1024)
    opt = dc.optimizer(lr=args.lr)
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        plan, lengths = hand_made_plan(step, world, cfg.num_layers)
        docs = make_docs(step, lengths)
        work = plan.work_of(rank)
        for j, (micro, ranks) in enumerate(work):
            batch = text_batch(micro, ranks, rank, docs).to(launch.device)
            with dc.micro_batch(batch, last=j == len(work) - 1) as ctx:
                ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
                ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
        loss = dc.sync_gradients()
        opt.step()
        losses.append(loss)
        if rank == 0:
            sizes = "+".join(str(g.sp) for g in plan.groups)
            print(
                f"step {step:3d}  loss {loss:.4f}  targets {dc.last_count:.0f}  groups {sizes}  "
                f"nodes {cluster.num_nodes}  buckets overlapped {dc.grad_sync.last_overlapped}/"
                f"{dc.grad_sync.num_buckets}  "
                f"micro-batches {[len(g.micro_batches) for g in plan.groups]}  "
                f"{1e3 * (time.perf_counter() - t0):.0f} ms",
                flush=True,
            )
    if rank == 0:
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps on {world} rank(s)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world_size": world, "losses": losses}, f)
    del dc, opt, model  # before the process group ends (`end_distributed`)
    end_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
