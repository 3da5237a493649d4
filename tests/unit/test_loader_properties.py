"""Property tests of the loader over random lengths, world sizes, policies, budgets and seeds.

Ranks are simulated in one process: one loader per rank (``rank=``, ``world_size=``, no
process group), raw samples (collate=None) from a dataset of sample ids, so each example
checks the plans and the sample ids each rank is handed, not tensors."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcparallel.data import DataCentricLoader
from dcparallel.plan.policies import ALL

from ._models import TINY_LM, cluster, cost

# world size -> GPUs per node (a multi-node shape for 8)
WORLDS = {1: 1, 2: 2, 3: 4, 4: 4, 8: 4}


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 30))
    # mostly short, some long enough to need SP or recompute under 1.5 GiB
    lengths = draw(st.lists(st.one_of(st.integers(1, 2000), st.integers(2000, 60_000)), min_size=n, max_size=n))
    budget = draw(
        st.one_of(
            st.builds(lambda t: ("tokens_per_step", t), st.integers(1, 80_000)),
            st.builds(lambda s: ("samples_per_step", s), st.integers(1, 12)),
        )
    )
    return {
        "world": world,
        "lengths": lengths,
        "budget": budget,
        "policy": draw(st.sampled_from(ALL)),
        "seed": draw(st.integers(0, 3)),
        "epoch": draw(st.integers(0, 2)),
        "lookahead": draw(st.sampled_from([0, 1, 3])),
        "stop": draw(st.floats(0, 1)),
        # rank 0's planning path (the other ranks plan in a thread: `loaders`)
        "planning": draw(st.sampled_from(["process", "thread", "thread"])),
    }


def loaders(case: dict, ranks: range | None = None, first: str | None = None) -> list[DataCentricLoader]:
    """One loader per rank of ``ranks`` (default: every rank of the case's world). Rank 0
    plans the case's way (or ``first``'s), the others in a thread: a planning process knows
    nothing of its rank (it plans every rank's steps), so one per example tests that path,
    and the plans compared across ranks then also compare the process's plans with the
    thread's."""
    world = case["world"]
    cl = cluster(world, WORLDS[world])
    c = cost(TINY_LM, cl)
    key, value = case["budget"]
    out = []
    for r in ranks if ranks is not None else range(world):
        loader = DataCentricLoader(
            range(len(case["lengths"])),
            case["lengths"],
            cost=c,
            cluster=cl,
            policy=case["policy"],
            research=True,
            seed=case["seed"],
            lookahead=case["lookahead"],
            planning=(first or case["planning"]) if r == 0 else "thread",
            collate=None,
            rank=r,
            world_size=world,
            **{key: value},
        )
        loader.set_epoch(case["epoch"])
        out.append(loader)
    return out


def record(steps) -> list[tuple]:
    """(step, rank, ranks of its group per phase, sample ids per micro-batch) of each step handed out, with
    the raw samples checked against the plan's sample ids."""
    out = []
    for s in steps:
        assert [list(b) for b in s.batches] == [list(mb.sample_ids) for mb in s.micro_batches]
        out.append((s.index, s.rank, tuple(g.ranks for g in s.groups), tuple(mb.sample_ids for mb in s.micro_batches)))
    return out


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_sample_once_plans_identical_and_resume_exact(case):
    ranks = loaders(case)
    runs = [list(loader) for loader in ranks]
    num_steps = len(ranks[0])
    assert all(len(run) == num_steps for run in runs), "a rank skipped a step (it must still sync)"

    # plans identical across ranks, step by step
    for k in range(num_steps):
        plan = runs[0][k].plan
        assert all(run[k].plan == plan for run in runs)
        assert all(run[k].index == k for run in runs)

    # every rank gets exactly its groups' micro-batches; every sample in exactly one group
    holders: dict[int, set[int]] = {}
    group_of: dict[int, tuple[int, ...]] = {}
    for r, run in enumerate(runs):
        for s in run:
            assert all(r in g.ranks for g in s.groups)
            for mb, ranks in s.plan.work_of(r):
                for i in mb.sample_ids:
                    assert i not in holders or r not in holders[i], f"sample {i} twice on rank {r}"
                    holders.setdefault(i, set()).add(r)
                    assert group_of.setdefault(i, ranks) == ranks
    assert sorted(holders) == list(range(len(case["lengths"]))), "a sample was dropped"
    assert all(holders[i] == set(group_of[i]) for i in holders), "a sample missing on a rank of its group"

    # stop at a random step, save, resume in a fresh loader: the same remaining sequence. The
    # loaders stopped plan in a thread (what is checked of them is their state and their
    # steps so far; a planning process stopped mid-epoch: test_loader_stop.py and
    # test_plan_process.py); rank 0's fresh one resumes the case's way.
    reference = [record(run) for run in runs]
    stop = int(case["stop"] * num_steps)
    for r, loader in enumerate(loaders(case, first="thread")):
        it = iter(loader)
        head = record(s for _, s in zip(range(stop), it))
        state = loader.state_dict()
        it.close()
        assert state["step"] == stop and state["epoch"] == case["epoch"]
        (fresh,) = loaders(case, range(r, r + 1))
        fresh.load_state_dict(state)
        fresh.set_epoch(case["epoch"])
        assert head + record(fresh) == reference[r]
