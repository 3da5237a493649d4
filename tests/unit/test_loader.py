"""DataCentricLoader without a process group: input validation (each error names the
offending value and the fix), collation into this rank's shard, empty steps, resuming,
and that threads/workers never change what is handed out."""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch

from dcparallel.data import Batch, DataCentricLoader
from dcparallel.data.collate import IGNORE_INDEX
from dcparallel.plan.types import NoLayoutFits

from ._models import TINY_DIT, TINY_LM, cluster, cost


def text_data(num: int, seed: int = 0, lo: int = 16, hi: int = 3000) -> tuple[list[torch.Tensor], list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(num)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g) for n in lens], lens


def make(dataset, lengths, world: int = 1, rank: int = 0, memory_mib: int = 1536, **kw) -> DataCentricLoader:
    cl = cluster(world, min(world, 8), memory_mib=memory_mib)
    if "samples_per_step" not in kw:
        kw.setdefault("tokens_per_step", 8000)
    return DataCentricLoader(dataset, lengths, cost=cost(TINY_LM, cl), cluster=cl, rank=rank, world_size=world, **kw)


def local(dataset, lengths, **kw) -> DataCentricLoader:
    """`make` with the plans made in a thread of this process: what the tests using it check
    does not depend on where plans are made, and a planning process is an interpreter started
    per loader (about 0.5 CPU-s). The planning process is tested where it matters:
    `test_lookahead_and_workers_do_not_change_what_each_rank_gets`, the idle-rank regression,
    `predict` below, tests/unit/test_plan_process.py and test_loader_properties.py."""
    return make(dataset, lengths, planning="thread", **kw)


def walk(loader: DataCentricLoader) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(s.index, s.rank, s.sample_ids) for s in loader]


# ---------------------------------------------------------------- bad input


def test_lengths_count_differs_from_dataset():
    ds, lens = text_data(4)
    with pytest.raises(ValueError, match=r"lengths has 3 entries but the dataset has 4 samples; give one size per"):
        make(ds, lens[:3])


@pytest.mark.parametrize(
    "bad,why",
    [
        (0, "is not positive"),
        (-5, "is not positive"),
        (2.5, "is not an integer"),
        ("12", "is not a number"),
        (None, "is not a number"),
        ((17, 64), "has 2 values, not 3"),
    ],
)
def test_bad_length_is_named_with_its_index(bad, why):
    ds, lens = text_data(4)
    lens[2] = bad
    with pytest.raises(ValueError, match=re.escape(f"lengths[2] = {bad!r} {why}") + ".*positive integer token count"):
        make(ds, lens)


def test_bad_length_from_a_function_is_named_too():
    ds, lens = text_data(5)
    with pytest.raises(ValueError, match=r"lengths\[3\] = 0 is not positive"):
        make(ds, lambda i: 0 if i == 3 else lens[i])


def test_empty_dataset():
    with pytest.raises(ValueError, match=r"the dataset is empty \(len\(dataset\) == 0\)"):
        make([], [])


def test_oversize_sample_named_with_memory_or_skipped_and_reported(caplog):
    ds, lens = text_data(6)
    lens[4] = 5_000_000
    ds[4] = torch.zeros(5_000_000, dtype=torch.long)
    with pytest.raises(
        NoLayoutFits,
        match=r"sample 4 \(size 5000000, 5000000 tokens\) fits no layout.*"
        r"needs [0-9.]+ GiB per rank.*skip_oversize=True",
    ):
        local(ds, lens, world=2)
    with caplog.at_level(logging.WARNING, logger="dcparallel.data.loader"):
        loader = local(ds, lens, world=2, skip_oversize=True)
    assert "skipping 1 sample(s) that fit no layout: sample 4 (size 5000000, needs" in caplog.text
    summary = loader.summary()
    assert summary["num_usable"] == 5 and [s["sample"] for s in summary["skipped"]] == [4]
    assert summary["skipped"][0]["needs_gib"] > 1.5  # more than the cluster's 1.5 GiB
    # each sample counted once: by the first rank of the group that ran it
    seen = [
        i
        for r in (0, 1)
        for st in local(ds, lens, world=2, rank=r, skip_oversize=True)
        for mb, ranks in st.plan.work_of(r)
        if ranks[0] == r
        for i in mb.sample_ids
    ]
    assert sorted(seen) == [0, 1, 2, 3, 5]


def test_other_bad_arguments():
    ds, lens = text_data(4)
    with pytest.raises(ValueError, match="give exactly one of tokens_per_step or samples_per_step"):
        make(ds, lens, samples_per_step=2, tokens_per_step=100)
    with pytest.raises(ValueError, match=r"tokens_per_step must be a positive integer; got 0"):
        make(ds, lens, tokens_per_step=0)
    with pytest.raises(ValueError, match=r"unknown policy 'fast'; choose one of"):
        make(ds, lens, policy="fast")
    cl = cluster(4, 4)
    with pytest.raises(ValueError, match=r"world_size=4 but this loader runs on 2 ranks"):
        DataCentricLoader(ds, lens, cost=cost(TINY_LM, cl), cluster=cl, tokens_per_step=100, rank=0, world_size=2)
    with pytest.raises(ValueError, match=rf"lengths\[0\] = {lens[0]}, but the model 'tiny-dit' is a video model"):
        cl = cluster(1)
        DataCentricLoader(ds, lens, cost=cost(TINY_DIT, cl), cluster=cl, tokens_per_step=100)
    with pytest.raises(ValueError, match="has no len"):
        make(iter(ds), lens)


def test_real_length_differing_from_lengths_is_an_error_when_loaded():
    ds, lens = text_data(3)
    lens[1] += 1
    with pytest.raises(ValueError, match=r"sample 1 has \d+ tokens but lengths\[1\] = \d+"):
        walk(local(ds, lens))


# ---------------------------------------------------------------- collation


def test_text_collation_packs_documents_and_shards_labels_before_sharding():
    """World 2, 1 GiB per rank: the 60001-token sample fits only at SP=2 (odd: padded), the
    short ones pack at SP=1. Each shard holds its columns of the packed row, labels shifted
    on the whole document (a shard boundary loses no target), targets counted per sample."""
    ds, lens = text_data(12, seed=3, lo=5, hi=40)
    lens[5] = 60_001
    ds[5] = torch.randint(0, 1000, (60_001,), generator=torch.Generator().manual_seed(5))
    labels = {}
    data = []
    for i, d in enumerate(ds):
        lab = torch.cat([d[1:], torch.tensor([IGNORE_INDEX])])
        if i % 3 == 0:
            lab[:2] = IGNORE_INDEX  # a prompt: not targets
        labels[i] = lab
        data.append({"input_ids": d, "labels": lab})
    per_rank = [list(local(data, lens, world=2, rank=r, memory_mib=1024, tokens_per_step=120)) for r in (0, 1)]
    covered = []
    for s0, s1 in zip(*per_rank, strict=True):
        assert s0.plan == s1.plan
        for r, st in enumerate((s0, s1)):
            for b in st:
                assert isinstance(b, Batch) and b.rank_in_group == b.ranks.index(r)
                row = torch.cat([ds[i] for i in b.sample_ids])
                assert b.cu_seqlens == tuple([0] + list(torch.tensor([lens[i] for i in b.sample_ids]).cumsum(0)))
                lo = b.shard_start
                real = max(0, min(b.shard_len, b.seq_len - lo))
                assert torch.equal(b.inputs[0, :real], row[lo : lo + real])
                lab_row = torch.cat([labels[i] for i in b.sample_ids])
                assert torch.equal(b.labels[0, :real], lab_row[lo : lo + real])
                assert not b.loss_mask[0, real:].any()
                pos = torch.cat([torch.arange(lens[i]) for i in b.sample_ids])
                assert torch.equal(b.positions[0, :real], pos[lo : lo + real])
                # targets counted on the whole sample, the same on every rank of the group
                assert b.num_targets == tuple(int((labels[i] != IGNORE_INDEX).sum()) for i in b.sample_ids)
                assert st.num_targets == {**st.num_targets, **dict(zip(b.sample_ids, b.num_targets))}
                if b.ranks[0] == r:
                    covered.extend(b.sample_ids)
    assert sorted(covered) == list(range(12))
    assert any(b.sp == 2 for st in per_rank[0] for b in st), "no SP=2 micro-batch: the test proves less"


def test_video_collation_stacks_same_shape_samples():
    from dcparallel.models.dit import patchify

    shapes = [(17, 64, 64), (17, 64, 64), (1, 64, 64), (17, 64, 64), (1, 64, 64)]
    data = []
    for i, (f, h, w) in enumerate(shapes):
        t = 1 if f == 1 else TINY_DIT.latent_grid((f, h, w))[0]
        lat = torch.randn(4, t, h // 16, w // 16, generator=torch.Generator().manual_seed(i))
        tok, pos, grid = patchify(lat, (1, 1, 1))
        assert tok.shape[0] == TINY_DIT.tokens((f, h, w))
        data.append({"tokens": tok, "positions": pos, "frames": grid[0]})
    cl = cluster(1)
    loader = DataCentricLoader(data, shapes, cost=cost(TINY_DIT, cl), cluster=cl, samples_per_step=5, planning="thread")
    steps = list(loader)
    assert len(steps) == 1
    for b in steps[0]:
        assert b.inputs.shape[0] == len(b.sample_ids)
        for row, sid in enumerate(b.sample_ids):
            assert torch.equal(b.inputs[row, : b.seq_len], data[sid]["tokens"])
    assert sorted(i for b in steps[0] for i in b.sample_ids) == list(range(5))


def test_custom_collate_and_raw_samples():
    ds, lens = text_data(6)
    calls = []

    def collate(samples, mb, ranks, rank):
        calls.append(mb.sample_ids)
        return sum(len(samples[i]) for i in mb.sample_ids)

    total = sum(b for st in local(ds, lens, collate=collate) for b in st)
    assert total == sum(lens) and sorted(i for c in calls for i in c) == list(range(6))
    raw = [b for st in local(ds, lens, collate=None) for b in st]
    assert sorted(int(t.numel()) for b in raw for t in b) == sorted(lens)


# ---------------------------------------------------------------- steps, ranks, threads


def test_fewer_samples_than_ranks_gives_empty_steps_on_idle_ranks():
    ds, lens = text_data(5, hi=200)
    steps = {r: list(local(ds, lens, world=4, rank=r, samples_per_step=1, policy="dcp")) for r in range(4)}
    assert all(len(s) == 5 for s in steps.values())  # every rank gets every step
    for k in range(5):
        assert len({steps[r][k].plan for r in range(4)}) == 1
        empty = [r for r in range(4) if len(steps[r][k]) == 0]
        assert empty, f"step {k}: one sample on 4 ranks but no rank is idle"
        assert all(steps[r][k].sample_ids == () and steps[r][k].num_samples == 1 for r in empty)


def test_last_step_smaller_and_nothing_dropped_or_repeated():
    ds, lens = text_data(23)
    steps = list(local(ds, lens, samples_per_step=5))
    assert [len(s.plan.sample_ids) for s in steps] == [5, 5, 5, 5, 3]
    assert sorted(i for s in steps for i in s.sample_ids) == list(range(23))


def test_lengths_function_is_called_once_per_sample():
    ds, lens = text_data(9)
    calls = []

    def length(i):
        calls.append(i)
        return lens[i]

    loader = local(ds, length)
    for e in range(2):
        loader.set_epoch(e)
        walk(loader)
    assert sorted(calls) == list(range(9))


def test_lookahead_and_workers_do_not_change_what_each_rank_gets():
    ds, lens = text_data(40, seed=1)
    ref = {
        r: [(s.index, s.plan, [b.inputs for b in s]) for s in make(ds, lens, world=2, rank=r, lookahead=0)]
        for r in (0, 1)
    }
    for lookahead, workers in [(1, 0), (4, 2)]:
        for r in (0, 1):
            got = [
                (s.index, s.plan, [b.inputs for b in s])
                for s in make(ds, lens, world=2, rank=r, lookahead=lookahead, num_workers=workers)
            ]
            assert [g[:2] for g in got] == [x[:2] for x in ref[r]]
            for g, x in zip(got, ref[r], strict=True):
                assert all(torch.equal(a, b) for a, b in zip(g[2], x[2], strict=True))


@pytest.mark.parametrize("lookahead,planning", [(0, "thread"), (2, "thread"), (2, "process")])
def test_predict_hands_each_step_the_replay_of_its_whole_plan(lookahead, planning):
    """``predict=True``: every step comes with the simulator's replay of its plan, made where
    the plan is (the caller's thread, the planning thread or the planning process)."""
    from dcparallel.sim.replay import replay_step

    ds, lens = text_data(40, seed=1)
    steps = list(make(ds, lens, world=4, rank=1, lookahead=lookahead, planning=planning, predict=True))
    assert len(steps) > 3
    ctx = make(ds, lens, world=4).context
    for s in steps:
        r = replay_step(s.plan, ctx)
        assert (s.predicted.compute_s, s.predicted.step_s, s.predicted.peak_memory_bytes) == (
            r.compute_time,
            r.step_time,
            r.peak_memory,
        )
    assert {s.predicted for s in make(ds, lens, world=4, rank=1, lookahead=lookahead, planning=planning)} == {None}


def test_epochs_reshuffle_and_each_covers_everything():
    ds, lens = text_data(30)
    loader = local(ds, lens)
    orders = []
    for e in range(2):
        loader.set_epoch(e)
        ids = [i for _, _, s in walk(loader) for i in s]
        assert sorted(ids) == list(range(30))
        orders.append(ids)
    assert orders[0] != orders[1]


def test_resume_mid_epoch_and_set_epoch_keeps_the_position():
    ds, lens = text_data(40, seed=2)
    full = local(ds, lens)
    full.set_epoch(1)
    reference = walk(full)
    assert len(reference) >= 4
    first = local(ds, lens)
    first.set_epoch(1)
    it = iter(first)
    head = [(s.index, s.rank, s.sample_ids) for _, s in zip(range(3), it)]
    state = first.state_dict()
    assert state["epoch"] == 1 and state["step"] == 3
    it.close()
    resumed = local(ds, lens)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the usual epoch loop calls this; it must not restart the epoch
    assert head + walk(resumed) == reference
    assert resumed.state_dict()["step"] == len(reference)
    resumed.set_epoch(2)
    assert walk(resumed)[0][0] == 0


def test_resume_with_other_settings_is_refused_or_replanned():
    ds, lens = text_data(20)
    state = local(ds, lens).state_dict()
    with pytest.raises(ValueError, match=r"saved with seed=0 but this loader has seed=1; resume with the same seed"):
        local(ds, lens, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with tokens_per_step=8000 but this loader has tokens_per_step=9000"):
        local(ds, lens, tokens_per_step=9000).load_state_dict(state)
    other = list(lens)
    other[0] += 1
    with pytest.raises(ValueError, match="other sample lengths"):
        local(ds, other).load_state_dict(state)
    # another world size keeps the samples of every step (the step former ignores the cluster)
    state["step"] = 1
    w2 = [local(ds, lens, world=2, rank=r) for r in (0, 1)]
    for loader in w2:
        loader.load_state_dict(state)
    steps = [list(loader) for loader in w2]
    one = list(local(ds, lens))[1:]
    assert [s.plan.sample_ids for s in steps[0]] == [s.plan.sample_ids for s in one]


def test_rank_idle_for_several_steps_then_busy_again_does_not_hang():
    """Regression: the DataLoader's sampler only moves on when this rank has a micro-batch,
    so it lags behind the step assembler across idle steps; the plans it still needs must
    not be dropped (they were, and the loader waited forever). Short samples run on one
    rank, the 60001-token ones need both (SP=2 under 1 GiB)."""
    import threading

    lens = [100] * 12 + [60_001] * 3
    ds = [torch.zeros(n, dtype=torch.long) for n in lens]
    for lookahead, workers in [(0, 0), (1, 0), (3, 1)]:
        got: dict[int, list] = {}

        def run(r, lookahead=lookahead, workers=workers, got=got):
            got[r] = walk(
                make(
                    ds,
                    lens,
                    world=2,
                    rank=r,
                    memory_mib=1024,
                    samples_per_step=1,
                    lookahead=lookahead,
                    num_workers=workers,
                )
            )

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(got) == [0, 1], f"lookahead={lookahead} workers={workers}: a rank hung"
        pattern = ["".join("x" if s else "." for _, _, s in got[r]) for r in (0, 1)]
        assert any("x.x" in p or "x..x" in p or "x...x" in p for p in pattern), pattern  # idle, then busy
        ids = sorted(i for r in (0, 1) for _, _, s in got[r] for i in s)
        assert sorted(set(ids)) == list(range(15))


def plan_digests() -> list[str]:
    """The digest of each policy's plans of one epoch of 60 mixed lengths on 8 ranks."""
    from dcparallel.plan.policies import ALL
    from dcparallel.runtime.comm import digest

    rng = random.Random(7)
    lens = [rng.choice([rng.randint(16, 3000), rng.randint(3000, 60000)]) for _ in range(60)]
    cl = cluster(8, 4)
    out = []
    for policy in ALL:
        loader = DataCentricLoader(
            range(60),
            lens,
            cost=cost(TINY_LM, cl),
            cluster=cl,
            policy=policy,
            research=True,
            tokens_per_step=40000,
            seed=3,
            collate=None,
            rank=0,
            world_size=8,
        )
        out.append(digest([p.to_json() for p in loader.plans(1)]))
    return out


def test_plans_do_not_depend_on_the_process_hash_seed():
    """Ranks are separate processes with their own string-hash seeds; a planner iterating a
    set or dict keyed by strings in hash order would plan differently on each rank. This
    process and an interpreter with another PYTHONHASHSEED must produce the same plans for
    every policy."""
    from ._hash_seed import run_with_other_hash_seed

    here = plan_digests()
    there = run_with_other_hash_seed("from tests.unit.test_loader import plan_digests; print(' '.join(plan_digests()))")
    assert len(here) == 7 and there.split() == here


def test_lengths_as_numpy_torch_or_integral_floats_plan_like_ints():
    import numpy as np

    ds, lens = text_data(10)
    reference = walk(local(ds, lens))
    for other in (np.asarray(lens), torch.tensor(lens), [float(n) for n in lens], np.asarray(lens, dtype=np.float64)):
        assert walk(local(ds, other)) == reference
    shapes = np.asarray([(17, 64, 64), (1, 128, 128)])
    cl = cluster(1)
    loader = DataCentricLoader(
        range(2), shapes, cost=cost(TINY_DIT, cl), cluster=cl, samples_per_step=2, collate=None, planning="thread"
    )
    assert loader.sizes == ((17, 64, 64), (1, 128, 128))
