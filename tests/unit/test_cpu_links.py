"""The links of a CPU launch for ``cost = "analytic"`` (`profile.cpu_links`): the latency and
bandwidth fitted from two timed all-to-alls reproduce those timings through the cost model's
own formula, are cached beside the calibration, and price the all-to-alls of SP groups."""

from __future__ import annotations

import json
import math

import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.base import alltoall_time
from dcparallel.profile import cpu_calibration as cc
from dcparallel.profile import cpu_links
from dcparallel.profile.inputs import reference_spec
from dcparallel.runtime import comm
from dcparallel.spec import ClusterSpec, Recompute
from tests.unit.test_profile import tiny_llama

GPU_LINKS = ClusterSpec(world_size=2, gpus_per_node=2, memory_bytes=2**34, intra_bw=1e10, inter_bw=1e10, name="cpu")


@pytest.mark.parametrize("n", [2, 4])
def test_the_fit_reproduces_the_timings_through_the_cost_formula(n):
    lat, bw = 3e-4, 8e8
    timed = [(float(b), lat * (n - 1) + b * (n - 1) / n / bw) for b in cpu_links.TIMED_BYTES]
    link = cpu_links.fit_link(n, timed[::-1])  # order does not matter
    assert math.isclose(link["bw"], bw, rel_tol=1e-9) and math.isclose(link["latency"], lat, rel_tol=1e-9)
    cluster = cpu_links.with_links(ClusterSpec(world_size=n, gpus_per_node=n, name="cpu"), link)
    for b, t in timed:
        assert math.isclose(alltoall_time(cluster, n, b), t, rel_tol=1e-9)


def test_noisy_timings_give_no_negative_latency_nor_bandwidth():
    # the larger timing faster than the smaller one: all of it counted as bandwidth
    link = cpu_links.fit_link(2, [(65536.0, 0.004), (4194304.0, 0.003)])
    assert link["bw"] == pytest.approx(0.5 * 4194304 / 0.003) and link["latency"] >= 0.0
    # a slope steeper than the intercept allows: latency 0, not negative
    link = cpu_links.fit_link(2, [(65536.0, 1e-6), (4194304.0, 0.01)])
    assert link["latency"] == 0.0 and link["bw"] > 0


def test_links_timed_once_cached_and_priced(tmp_path, monkeypatch):
    link = {"bw": 5e8, "latency": 4e-4}
    calls = []
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm, "all_gather_object", lambda obj, group=None: [obj])
    monkeypatch.setattr(cpu_links, "measure_links", lambda: calls.append(1) or dict(link))
    path = tmp_path / cc.CACHE_NAME
    cluster = cc.cpu_cluster(GPU_LINKS, path)
    assert (cluster.intra_bw, cluster.intra_latency, cluster.inter_bw, cluster.inter_latency) == (5e8, 4e-4, 5e8, 4e-4)
    assert cc.cpu_cluster(GPU_LINKS, path) == cluster and calls == [1]  # the second from the cache
    assert link in json.loads(path.read_text()).values()
    spec = reference_spec(tiny_llama(num_layers=2), tiny_llama(num_layers=2).layers)[0]
    slow, fast = AnalyticCost(spec, cluster), AnalyticCost(spec, GPU_LINKS)
    n, none = 1000, Recompute(0, 0)
    assert slow.terms((n,), 1).time(none) == fast.terms((n,), 1).time(none)  # SP 1: no all-to-all
    a2a = alltoall_time(cluster, 2, n / 2 * spec.hidden * spec.bytes_per_value)
    assert slow.terms((n,), 2).time(none) - fast.terms((n,), 2).time(none) > spec.num_layers * a2a
    assert slow.grad_sync_time() > fast.grad_sync_time()
    monkeypatch.setattr(comm, "world_size", lambda: 1)
    assert cc.cpu_cluster(GPU_LINKS, tmp_path / "other.json") == GPU_LINKS  # one rank: nothing to time


def test_each_timed_call_follows_compute_on_every_rank_and_a_barrier(monkeypatch):
    """`cpu_links` times all-to-alls as the runtime makes them, between stretches of compute,
    not back to back: every timed call follows `COMPUTE_S` of matrix work and a barrier."""
    seen = []

    class FakeDist:
        def barrier(self):
            seen.append("barrier")

        def all_to_all_single(self, out, x):
            seen.append("all_to_all")

    monkeypatch.setattr(cpu_links, "dist", FakeDist())
    monkeypatch.setattr(cpu_links, "_compute", lambda s: seen.append(("compute", s)))
    monkeypatch.setattr(cpu_links, "MIN_S", 0.0)
    monkeypatch.setattr(comm, "all_gather_object", lambda obj, group=None: [obj])
    cpu_links._timed_alltoall(65536)
    calls = [i for i, x in enumerate(seen) if x == "all_to_all"]
    assert len(calls) == 2 + 2 * cpu_links.REPEATS  # warm-up, the call that sizes a window, the windows
    assert all(seen[i - 2 : i] == [("compute", cpu_links.COMPUTE_S), "barrier"] for i in calls)
