"""The paper-scale scenarios (reduced epochs so the suite stays fast): every policy is
lossless, and dcp-inter-pac is never slower than the tuned bucket baseline."""

import numpy as np
import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.scenarios import DISTRIBUTIONS, SCENARIOS, long_token_share, read_lengths, sample_sizes
from dcparallel.sim.run import run_policies, summary
from dcparallel.spec import Workload


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_dcp_inter_pac_never_slower_than_bucket(scenario, distribution):
    sc = SCENARIOS[scenario]
    cl = sc.cluster(32, 8)
    sizes = sample_sizes(scenario, distribution, num_samples=600 if scenario == "text" else 400)
    w = Workload(sc.model, tuple(sizes))
    tps = sum(w.tokens) // 8  # eight steps
    _, steps, runs, bound = run_policies(w, AnalyticCost(sc.model, cl), cl, ["bucket", "dcp-inter-pac"],
                                         tokens_per_step=tps)
    s = summary(w, runs, bound)
    for v in s.values():
        assert v["samples_planned"] == len(sizes) and v["samples_dropped"] == 0 and v["samples_repeated"] == 0
        assert v["memory_violations"] == 0 and 0 < v["lower_bound_efficiency"] <= 1
    assert runs["dcp-inter-pac"].sim.total_time <= runs["bucket"].sim.total_time


def test_distributions_are_ordered_by_long_share():
    for scenario in SCENARIOS:
        m = SCENARIOS[scenario].model
        shares = [long_token_share(m, sample_sizes(scenario, d, num_samples=3000)) for d in ("short", "long")]
        assert shares[0] < shares[1]
    assert sample_sizes("text", "short", num_samples=50) == sample_sizes("text", "short", num_samples=50)


def test_lengths_files(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("# tokens\n100\n2048\n\n7\n")
    assert read_lengths(p) == [100, 2048, 7]
    p.write_text("51 240 426\n1 720 1280\n")
    assert read_lengths(p) == [(51, 240, 426), (1, 720, 1280)]
    np.save(tmp_path / "a.npy", np.array([[17, 100, 200], [1, 64, 64]]))
    assert read_lengths(tmp_path / "a.npy") == [(17, 100, 200), (1, 64, 64)]
    for text, msg in [("1 2\n", "`tokens` or `frames height width`"), ("abc\n", "expected integers"),
                      ("0\n", "positive integer"), ("", "holds no samples"), ("5\n1 64 64\n", "mixes")]:
        p.write_text(text)
        with pytest.raises(ValueError, match=msg):
            read_lengths(p)
    with pytest.raises(ValueError, match="does not exist"):
        read_lengths(tmp_path / "missing.txt")
