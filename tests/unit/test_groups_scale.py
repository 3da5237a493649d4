"""Process groups at scale, on torch's fake process-group backend (one process acts as one
rank of a large world; collectives do nothing): how many groups a wrapped model creates,
that they are made once per process, what their communicators cost the memory budget, and
that the ranks of every group issue the same collectives for real plans."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from dcparallel.runtime import groups as groups_mod
from dcparallel.runtime.groups import ProcessGroups, group_cache


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """``rank`` of a fake world of ``world`` ranks (the NCCL path of the group factory)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def creations(monkeypatch):
    """Counts every process-group creation call (`new_group`, `split_group`) by its ranks."""
    seen: list[tuple[str, object]] = []
    for name in ("new_group", "split_group"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counted(*args, _real=real, _name=name, **kw):
            seen.append((_name, args[0] if args else kw.get("ranks", kw.get("split_ranks"))))
            return _real(*args, **kw)

        monkeypatch.setattr(dist, name, counted)
    return seen


def llama32():
    """A transformers Llama of 32 attention heads (8 key/value heads), two layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128,
        use_cache=False,
    )
    return LlamaForCausalLM._from_config(cfg)


def test_a_1024_rank_world_creates_one_group_per_sp_size_once_per_process(creations):
    """W=1024, 32 heads: 993 `new_group` calls per wrapped model with a call per block; now
    one per SP size between 1 and the world, plus the sync's world group, and a second
    wrapped model (a second Engine) creates none."""
    import dcparallel

    with fake_world(1024, rank=5):
        dc = dcparallel.DataCentricParallel(llama32())
        topo = dc.groups.topology
        assert topo.sizes == (1, 2, 4, 8, 16, 32) and topo.mix == topo.sizes
        assert len(creations) <= len(topo.mix) + 2, creations
        assert len(creations) == 6  # sizes 2..32 and the sync's group
        assert dc.groups.group((4, 5)) is not None and dist.get_process_group_ranks(dc.groups.group((4, 5))) == [4, 5]
        assert dist.get_process_group_ranks(dc.groups.group(tuple(range(32)))) == list(range(32))
        assert dc.groups.group((5,)) is None
        with pytest.raises(ValueError, match=r"1024 ranks\): .* sizes \[1, 2, 4, 8, 16, 32\]"):
            dc.groups.group(range(1024))
        with pytest.raises(ValueError, match=r"rank 5 .* ranks \(0, 1\), which it is not in"):
            dc.groups.group((0, 1))
        before = len(creations)
        dc2 = dcparallel.DataCentricParallel(llama32())
        assert len(creations) == before
        assert dc2.groups.group((4, 5)) is dc.groups.group((4, 5)) and dc2.grad_sync.group is dc.grad_sync.group


def test_gloo_still_makes_every_block_and_a_new_world_gets_new_groups(tmp_path, creations):
    """gloo keeps one `new_group` per block (every rank takes part in each); the cache belongs
    to one default group, so a re-initialized world creates its groups again."""
    for _ in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv{_}", rank=0, world_size=1)
        try:
            ProcessGroups(4)
        finally:
            dist.destroy_process_group()
    assert creations == []  # a one-rank world needs no group
    with fake_world(8):
        ProcessGroups(8)
        n = len(creations)
    with fake_world(8):
        ProcessGroups(8)
    assert n == 3 and len(creations) == 2 * n  # sizes 2, 4 and the sync's; the world of 8 is WORLD


def test_a_device_bound_world_splits_once_per_size(monkeypatch, creations):
    """With a device bound to the default group each `new_group` is a world-wide NCCL split:
    all blocks of a size then come from one `split_group` with every block of that size."""
    calls = []

    def split_group(parent_pg=None, split_ranks=None, **kw):
        calls.append(split_ranks)
        return next((object() for b in split_ranks if dist.get_rank() in b), None)

    monkeypatch.setattr(dist, "split_group", split_group)
    monkeypatch.setattr(groups_mod, "_device_bound", lambda: True)
    with fake_world(16, rank=6):
        pg = ProcessGroups(8, _cluster(16, 8))
        assert calls == [[list(range(s, s + k)) for s in range(0, 16, k)] for k in (2, 4, 8)]
        assert pg.group((6, 7)) is not None
    assert [name for name, _ in creations] == ["new_group"]  # the sync's world group alone


def _cluster(world: int, gpus_per_node: int):
    from dcparallel.spec import ClusterSpec

    return ClusterSpec(world_size=world, gpus_per_node=gpus_per_node)


def test_communicator_memory_is_measured_around_creation_and_warm_up(monkeypatch):
    """On CUDA the device's free memory is read before the groups are made and after a first
    collective on each of this rank's new groups; the difference is `communicator_bytes`."""
    free = [10 * 2**30]
    warmed = []

    def warm_up(group, device):
        warmed.append(dist.get_process_group_ranks(group))
        free[0] -= 2**28  # each communicator takes 256 MiB on its first collective

    monkeypatch.setattr(groups_mod, "_comm_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(groups_mod, "_warm_up", warm_up)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * 2**30))
    with fake_world(64, rank=9):
        pg = ProcessGroups(8)
        assert warmed == [[8, 9], [8, 9, 10, 11], list(range(8, 16)), list(range(64))]
        assert pg.communicator_bytes == 4 * 2**28
        assert ProcessGroups(8).communicator_bytes == 4 * 2**28  # nothing new, the same total
        assert group_cache().creations == 4


def test_the_default_memory_budget_leaves_out_the_communicators(monkeypatch):
    """The budget the planner gets (measured from the device) is what is left after the
    communicators; a budget the user gives is taken as given."""
    import dcparallel
    from dcparallel.runtime.launch import device_memory

    free = [10 * 2**30]

    def warm_up(group, device):
        free[0] -= 2**28

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(groups_mod, "_comm_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(groups_mod, "_warm_up", warm_up)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * 2**30))
    with fake_world(64, rank=3):
        dc = dcparallel.DataCentricParallel(llama32())
        assert dc.groups.communicator_bytes == 6 * 2**28  # sizes 2..32 and the sync's group
        assert dc.memory_bytes == dc.cluster_spec.memory_bytes == device_memory(torch.device("cpu"), 1) - 6 * 2**28
        given = dcparallel.DataCentricParallel(llama32(), memory_bytes=2**30)
        assert given.memory_bytes == given.cluster_spec.memory_bytes == 2**30


@pytest.mark.parametrize(
    ("backend", "per_size"), [("gloo", False), ("nccl", True), ("fake", True), ("cpu:gloo,cuda:nccl", True)]
)
def test_which_backends_make_one_group_per_size(monkeypatch, backend, per_size):
    monkeypatch.setattr(groups_mod, "_backend", lambda: backend)
    assert groups_mod._per_size() is per_size
