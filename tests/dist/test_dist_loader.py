"""The loader on gloo (world 2): an epoch of a real small dataset through the reference LM
and DataCentricParallel, coverage checked from each rank's own log file."""

from __future__ import annotations

import json
import math
import re

import pytest

from dcparallel.loss import shift_labels
from tests.dist import loader_cases
from tests.dist.harness import Workers
from tests.support import Data, make_model, reference

pytestmark = pytest.mark.dist

LINE = re.compile(r"rank (\d+) epoch (\d+) step (\d+)/(\d+): micro-batches \(group ranks, sample ids\) (.*)$")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    # not daemonic: the ranks start DataLoader worker processes of their own
    w = Workers(2, tmp_path_factory.mktemp("rdv-loader"), daemon=False)
    yield w
    w.close()


def test_epoch_through_the_reference_lm_covers_every_sample_once(workers, tmp_path):
    num_samples = 40
    out = workers.run(loader_cases.case_loader_epoch, str(tmp_path), num_samples, 3, 1)
    lengths = out[0]["lengths"]

    # coverage from the ranks' own logs: one line per step per rank, empty steps included
    lines = {r: [LINE.search(x) for x in (tmp_path / f"rank{r}.log").read_text().splitlines()] for r in (0, 1)}
    parsed = {r: [m for m in ms if m] for r, ms in lines.items()}
    num_steps = len(out[0]["steps"])
    holders: dict[int, list[int]] = {}
    group_of: dict[int, tuple[int, ...]] = {}
    for r in (0, 1):
        assert [int(m[3]) for m in parsed[r]] == list(range(num_steps)), f"rank {r} did not log every step"
        assert all(int(m[1]) == r and int(m[4]) == num_steps for m in parsed[r])
        for m in parsed[r]:
            for ranks, sids in json.loads(m[5]):
                for sid in sids:
                    holders.setdefault(sid, []).append(r)
                    assert group_of.setdefault(sid, tuple(ranks)) == tuple(ranks)
        assert any("epoch 0 done" in x for x in (tmp_path / f"rank{r}.log").read_text().splitlines())
    assert sorted(holders) == list(range(num_samples)), "a sample was dropped"
    for sid, ranks in holders.items():
        assert sorted(ranks) == list(group_of[sid]), f"sample {sid}: ranks {ranks} vs its group {group_of[sid]}"

    # the step's normalizer: targets of its whole samples (n - 1 each, after the shift),
    # summed once over the ranks although SP=2 samples are split between them
    for k in range(num_steps):
        s0, s1 = out[0]["steps"][k], out[1]["steps"][k]
        assert s0["step_samples"] == s1["step_samples"]
        expected = sum(lengths[i] - 1 for i in s0["step_samples"])
        assert s0["count"] == s1["count"] == expected
        assert s0["loss"] == s1["loss"] and math.isfinite(s0["loss"])
    # what this epoch exercised: SP=2 groups, two SP=1 groups running different samples,
    # a rank with no micro-batch that still joined the sync (its count above is global)
    sps = {sp for r in (0, 1) for s in out[r]["steps"] for sp in s["sp"]}
    assert sps == {1, 2}, f"the epoch should mix SP=1 and SP=2 micro-batches; saw {sps}"
    assert any(len(set(group_of[i] for i in s["step_samples"])) == 2 for s in out[0]["steps"])
    assert any(s["num_batches"] == 0 for r in (0, 1) for s in out[r]["steps"]), "no idle rank in any step"
    assert out[0]["state"]["step"] == num_steps and out[0]["state"]["epoch"] == 0

    # the first step's loss (same initial weights) equals a single process's mean loss over
    # the step's samples, each run alone: collation (packing, positions, shifted labels,
    # sharding) changed nothing. fp32 with sums reordered: see test_dist_runtime's note.
    dataset = loader_cases.ArithmeticTokens(num_samples, 3)
    first = out[0]["steps"][0]["step_samples"]
    docs = {i: dataset[i] for i in first}
    data = Data("llama", docs, {i: shift_labels(d) for i, d in docs.items()}, {}, {}, {})
    ref_loss, _ = reference(make_model("llama"), data, first)
    assert abs(out[0]["steps"][0]["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)


def test_plan_check_stops_ranks_that_disagree(workers):
    for msg in workers.run(loader_cases.case_plan_mismatch):
        assert "plan of epoch 0 step 0 differs across ranks" in msg and "ranks [0]" in msg


def test_a_plan_that_differs_on_one_rank_is_caught_at_the_next_checked_step(workers):
    """Rank 1 plans from step 3 on with another policy; with the check every 2 steps the
    plans agree at steps 0 and 2, and both ranks stop at step 4 (not hang), with a message
    naming the epoch, the step and the differing group. With check_plans=1 both stop at
    step 3 itself."""
    every2 = workers.run(loader_cases.case_planted_divergence, 2, 3)
    assert every2[0]["num_steps"] > 5
    for out in every2:
        assert out["steps"] == [0, 1, 2, 3], out
        assert (
            "the plan of epoch 0 step 4 differs across ranks: ranks [0] hold one plan, rank 1 another" in out["error"]
        )
        assert "group 0: rank 0 has {'ranks'" in out["error"] and "rank 1 has {'ranks'" in out["error"]
    for out in workers.run(loader_cases.case_planted_divergence, 1, 3):
        assert out["steps"] == [0, 1, 2] and "epoch 0 step 3 differs" in out["error"], out


def test_prepare_refuses_memory_budgets_that_differ_between_ranks(workers):
    """Each rank plans on its own from its memory budget: budgets that differ would give
    different plans (and a hang), so prepare stops every rank with the field, the values per
    rank and the fix; equal budgets prepare."""
    for out in workers.run(loader_cases.case_prepare_budgets, [1_900_000, 2_000_000]):
        assert out["error"].startswith(
            "prepare: memory budget (memory_bytes) differs across ranks (ranks [0]: 1900000; ranks [1]: 2000000)"
        ), out
        assert "pass the same memory_bytes on every rank" in out["error"]
    same = workers.run(loader_cases.case_prepare_budgets, [1_900_000, 1_900_000])
    assert same[0]["error"] == "" and same[0]["steps"] == same[1]["steps"] > 1, same


def test_buffers_that_differ_across_ranks_are_refused_before_training(workers):
    """A replicated buffer that differs across ranks would be saved from one rank and resume
    the others wrong: running statistics (BatchNorm) are refused when the model is wrapped,
    and a persistent buffer whose values differ in `prepare`, each naming the buffers and the
    fix; a persistent buffer equal on every rank prepares."""
    for out in workers.run(loader_cases.case_rank_buffers):
        assert out["batchnorm"].startswith("BatchNorm1d 'head_norm' keeps running statistics"), out
        for words in (
            "head_norm.running_mean, head_norm.running_var, head_norm.num_batches_tracked",
            "track_running_stats=False",
        ):
            assert words in out["batchnorm"], out
        assert out["differ"].startswith("prepare: the persistent buffer 'scale' differs across ranks"), out
        assert "register it with persistent=False" in out["differ"], out
        assert out["same"] > 1, out


def test_refined_plans_are_identical_on_every_rank(workers):
    """Each rank feeds its own micro-batch times; the loader gathers them, so both ranks (and
    their planning processes) refit alike and plan alike."""
    out = workers.run(loader_cases.case_refine, 3)
    assert out[0]["plans"] == out[1]["plans"] and out[0]["predicted"] == out[1]["predicted"]
    assert out[0]["corrections"] == out[1]["corrections"]
    assert all(c != (1.0, 0.0) for c in out[0]["corrections"].values())  # fitted
    assert out[0]["fed"] == out[1]["fed"] == [True] * 3 + [False] * (len(out[0]["plans"]) - 3)
    assert out[0]["refine_left"] == 0
