"""What the gloo workers run for the loader tests (module level so that spawn can pickle it).

A real small dataset: arithmetic token sequences (learnable), 8-250 tokens, plus a few of
500-600 tokens. Under the 2.5 MB budget per rank (analytic cost of the tiny reference LM)
the dcp policy plans this epoch with SP=2 groups, steps of two SP=1 groups with different
samples, and a step that leaves rank 1 idle; the test asserts that mix."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
import torch.distributed as dist

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.data import DataCentricLoader
from dcparallel.loss import per_token_loss
from dcparallel.runtime.engine import Engine
from dcparallel.spec import ClusterSpec, llama_like
from tests.dist.cases import groups
from tests.support import NUM_HEADS, NUM_LAYERS, make_model

VOCAB = 64
TINY_SPEC = llama_like(
    "tiny-llama", num_layers=NUM_LAYERS, hidden=32, num_heads=NUM_HEADS, ffn_hidden=48, vocab_size=VOCAB
)
MEMORY_BYTES = 1_200_000  # the 500-600-token samples need SP=2 (memory), the rest fit one rank
#: the same for the analytic model of the model itself (fp32: its activations are twice
#: `TINY_SPEC`'s bf16 ones): what `DataCentricParallel(model, cost="analytic")` plans with
API_MEMORY_BYTES = 1_900_000


def tiny_cluster(world: int, **kw) -> ClusterSpec:
    """The loader cases' cluster: ``world`` ranks on one node, `MEMORY_BYTES` each."""
    return ClusterSpec(
        world_size=world, gpus_per_node=world, memory_bytes=MEMORY_BYTES, intra_bw=300e9, intra_latency=1e-5, **kw
    )


class ArithmeticTokens(torch.utils.data.Dataset):
    """Sample i: tokens (a + j b) mod VOCAB, j < its length; a, b drawn from i."""

    def __init__(self, num_samples: int, seed: int):
        rng = random.Random(seed)
        self.lengths = [rng.randint(500, 600) if i % 9 == 4 else rng.randint(8, 250) for i in range(num_samples)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = random.Random(i)
        a, b = rng.randrange(VOCAB), rng.randint(1, 7)
        return (a + torch.arange(self.lengths[i]) * b) % VOCAB


def case_loader_epoch(log_dir: str, num_samples: int, seed: int, num_workers: int) -> dict:
    """One epoch of the dataset through the Engine with the loader's plans (`dcp-own`: `dcp`'s
    own plans, which mix SP degrees and leave ranks idle; plan hashes compared across ranks
    every step); each rank logs the loader's lines to its own
    file. Returns per step the loss, the global target count and this rank's work."""
    rank, world = dist.get_rank(), dist.get_world_size()
    handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log", mode="w")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("dcparallel.data")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        dataset = ArithmeticTokens(num_samples, seed)
        cluster = tiny_cluster(world)
        loader = DataCentricLoader(
            dataset,
            dataset.lengths,
            cost=AnalyticCost(TINY_SPEC, cluster),
            cluster=cluster,
            policy="dcp-own",
            research=True,
            tokens_per_step=1200,
            seed=seed,
            num_workers=num_workers,
            check_plans=True,
        )
        model = make_model("llama")
        dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS, groups=groups())
        opt = dc.optimizer(lr=1e-2)
        steps = []
        for step in loader:
            for batch in step:
                with dc.micro_batch(batch) as ctx:
                    ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
                    ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
            loss = dc.sync_gradients()
            opt.step()
            steps.append(
                {
                    "index": step.index,
                    "loss": loss,
                    "count": dc.last_count,
                    "step_samples": list(step.plan.sample_ids),
                    "sp": [b.sp for b in step],
                    "num_batches": len(step),
                }
            )
        return {"steps": steps, "lengths": dataset.lengths, "state": loader.state_dict()}
    finally:
        logger.removeHandler(handler)
        handler.close()


def case_plan_mismatch() -> str:
    """Ranks built with different seeds: the debug plan check must stop them at step 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = ArithmeticTokens(12, 0)
    cluster = tiny_cluster(world)
    loader = DataCentricLoader(
        dataset,
        dataset.lengths,
        cost=AnalyticCost(TINY_SPEC, cluster),
        cluster=cluster,
        tokens_per_step=400,
        seed=rank,
        check_plans=True,
    )
    try:
        next(iter(loader))
    except RuntimeError as e:
        return str(e)
    return ""


class _PlantedPlanner:
    """Plans the steps from ``at`` on with another planner (valid plans of the same samples,
    different groups), the steps before with the loader's own."""

    def __init__(self, planner, other, at: int):
        self.planner, self.other, self.at = planner, other, at

    def plan(self, step):
        return (self.other if step.index >= self.at else self.planner).plan(step)


def case_planted_divergence(check_every: int, at: int) -> dict:
    """Same inputs on both ranks, but rank 1 plans from step ``at`` on with `bucket`: the
    loader's periodic plan check (every ``check_every`` steps) must stop both ranks at the
    first checked step from ``at`` on. Returns the steps each rank got and the error text."""
    from dcparallel.plan.policies import make_planner
    from dcparallel.sim.replay import step_seconds

    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = ArithmeticTokens(40, 0)
    cluster = tiny_cluster(world)
    loader = DataCentricLoader(
        dataset,
        dataset.lengths,
        cost=AnalyticCost(TINY_SPEC, cluster),
        cluster=cluster,
        tokens_per_step=400,
        seed=0,
        check_plans=check_every,
        planning="thread",
        lookahead=0,
    )
    if rank == 1:
        real = loader.planner
        loader.planner = lambda epoch: _PlantedPlanner(
            real(epoch),
            make_planner("bucket", loader.context, loader.steps(epoch), score=step_seconds(loader.context)),
            at,
        )
    got = []
    try:
        for step in loader:
            got.append(step.index)
    except RuntimeError as e:
        return {"steps": got, "error": str(e), "num_steps": len(loader)}
    return {"steps": got, "error": "", "num_steps": len(loader)}


def case_prepare_budgets(budgets: list[int]) -> dict:
    """`DataCentricParallel.prepare` on the reference LM with ``budgets[rank]`` bytes of memory
    per rank (analytic cost): the steps of the loader, or the error."""
    import dcparallel

    dataset = ArithmeticTokens(24, 0)
    dc = dcparallel.DataCentricParallel(
        make_model("llama"), memory_bytes=budgets[dist.get_rank()], gpus_per_node=dist.get_world_size()
    )
    try:
        loader = dc.prepare(dataset, lengths=dataset.lengths, tokens_per_step=400, cost="analytic", planning="thread")
    except ValueError as e:
        return {"error": str(e)}
    return {"error": "", "steps": len(loader)}


def case_refine(refine_steps: int) -> dict:
    """The loader fed each step's micro-batch times (synthetic, rank-dependent: 10 ms x (rank
    + 1) plus 10 us a token) for ``refine_steps`` steps, planning in a planning process: what
    each rank planned and predicted, and its cost model's corrections."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = ArithmeticTokens(40, 0)
    cluster = tiny_cluster(world)
    with DataCentricLoader(
        dataset,
        dataset.lengths,
        cost=AnalyticCost(TINY_SPEC, cluster),
        cluster=cluster,
        tokens_per_step=400,
        seed=0,
        predict=True,
        refine_steps=refine_steps,
    ) as loader:
        plans, predicted, fed = [], [], []
        for step in loader:
            plans.append(step.plan.to_json())
            predicted.append(step.predicted)
            times = [
                0.01 * (rank + 1) + 1e-5 * sum(dataset.lengths[i] for i in mb.sample_ids) for mb in step.micro_batches
            ]
            fed.append(loader.observe(step, times))
        cost = loader.context.cost
        return {
            "plans": plans,
            "predicted": predicted,
            "fed": fed,
            "refine_left": loader.refine_left,
            "corrections": {sp: cost.correction(sp) for sp in (1, 2)},
        }


def case_rank_buffers() -> dict:
    """Replicated buffers across ranks: wrapping a model with a BatchNorm (running statistics)
    at world 2, and `prepare` with a persistent buffer that holds this rank's number, each give
    their error; a persistent buffer equal on every rank prepares (the loader's steps)."""
    import dcparallel

    dataset, out = ArithmeticTokens(24, 0), {}
    model = make_model("llama")
    model.head_norm = torch.nn.BatchNorm1d(8)  # outside the forward: the refusal is by structure
    try:
        dcparallel.DataCentricParallel(model, memory_bytes=API_MEMORY_BYTES)
        out["batchnorm"] = ""
    except ValueError as e:
        out["batchnorm"] = str(e)
    for name, value in (("differ", float(dist.get_rank())), ("same", 1.0)):
        model = make_model("llama")
        model.register_buffer("scale", torch.full((4,), value))
        dc = dcparallel.DataCentricParallel(model, memory_bytes=API_MEMORY_BYTES)
        try:
            loader = dc.prepare(
                dataset, lengths=dataset.lengths, tokens_per_step=400, cost="analytic", planning="thread"
            )
            out[name] = len(loader)
        except ValueError as e:
            out[name] = str(e)
    return out
