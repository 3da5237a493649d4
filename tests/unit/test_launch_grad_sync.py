"""Set-up from the launch environment (runtime/launch.py) and the bucket bookkeeping of the
gradient sync (runtime/grad_sync.py) on one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dcparallel.cost.overlap import MAX_BUCKETS, MIN_BUCKET_BYTES, sync_buckets
from dcparallel.data.collate import text_batch
from dcparallel.loss import per_token_loss
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from dcparallel.runtime.grad_sync import GradSync, reached_leaves
from dcparallel.runtime.launch import Links, check_launch, choose_backend, cluster_from_env, init_distributed
from dcparallel.spec import ClusterSpec, Layout, h200_cluster
from tests.support import NUM_HEADS, make_data, make_model


def test_backend_and_device_choice():
    assert choose_backend(None, cuda_available=True) == ("nccl", "cuda")
    assert choose_backend(None, cuda_available=False) == ("gloo", "cpu")
    assert choose_backend("cpu", cuda_available=True) == ("gloo", "cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        choose_backend("cuda", cuda_available=False)
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        choose_backend("tpu", cuda_available=False)


def test_init_distributed_without_a_launcher_is_a_world_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    launch = init_distributed(device="cpu")
    assert (launch.backend, launch.world_size, launch.rank, launch.device.type) == (None, 1, 0, "cpu")


def test_cluster_from_the_launch_environment(tmp_path):
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3"}
    c = cluster_from_env(num_heads=32, memory_bytes=2**30, env=env, links=Links.datasheet(), device=torch.device("cpu"))
    h = h200_cluster(16, 8)
    assert (c.world_size, c.gpus_per_node, c.num_nodes, c.memory_bytes) == (16, 8, 2, 2**30)
    assert (c.intra_bw, c.inter_bw, c.intra_latency, c.inter_latency) == (
        h.intra_bw,
        h.inter_bw,
        h.intra_latency,
        h.inter_latency,
    )
    # memory from the device when not given: the CPU's memory shared by the node's 8 ranks
    assert 0 < cluster_from_env(env=env, device=torch.device("cpu"), links=Links.datasheet()).memory_bytes
    # link speeds from a config file; missing keys keep the datasheet values
    cfg = tmp_path / "links.toml"
    cfg.write_text("[links]\ninter_bw = 25e9\n")
    lk = Links.load(cfg)
    assert lk.inter_bw == 25e9 and lk.intra_bw == h.intra_bw
    assert cluster_from_env(env=env, memory_bytes=1, links=lk, device=torch.device("cpu")).inter_bw == 25e9
    cfg.write_text("[links]\ninter_bandwidth = 25e9\n")
    with pytest.raises(ValueError, match="unknown key"):
        Links.load(cfg)


def test_launches_the_plan_cannot_use_are_clear_errors():
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        cluster_from_env(env={"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}, memory_bytes=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="3 attention heads: no SP degree"):
        cluster_from_env(
            num_heads=3, env={"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, memory_bytes=1, device=torch.device("cpu")
        )
    check_launch(ClusterSpec(world_size=1, gpus_per_node=1), 3)  # one rank never splits a sample
    check_launch(ClusterSpec(world_size=16, gpus_per_node=8), 12)  # SP 2 and 4 divide 12
    check_launch(ClusterSpec(world_size=8, gpus_per_node=8, ring=True), 3)  # ring groups need not divide them


def _engine(bucket_bytes: int | None):
    model = make_model("llama")
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS)
    dc.grad_sync.set_bucket_bytes(bucket_bytes)
    return model, dc


def test_buckets_tile_the_buffer_in_a_fixed_order():
    _, dc = _engine(1000)
    gs = dc.grad_sync
    total = dc.flat_grad.numel()
    assert gs.buckets[0][1] == total and gs.buckets[-1][0] == 0
    assert all(gs.buckets[k][0] == gs.buckets[k + 1][1] for k in range(gs.num_buckets - 1))
    assert all(hi - lo == 250 for lo, hi in gs.buckets[:-1])
    # every parameter element lies in the buckets it is said to touch
    off = 0
    for p, ks in zip(dc.params, gs._param_buckets, strict=True):
        lo, hi = off, off + p.numel()
        for e in (lo, hi - 1):
            assert any(gs.buckets[k][0] <= e < gs.buckets[k][1] for k in ks)
        off = hi
    gs.set_bucket_bytes(0)
    assert gs.buckets == [(0, total)]


def _run(model, dc, data, ids, last: bool, twice: bool = False):
    mb = MicroBatch(tuple(ids), Layout(1, len(ids)))
    batch = text_batch(mb, (0,), 0, data.docs, data.labels)
    with dc.micro_batch(batch, last=last) as ctx:
        losses = []
        for _ in range(2 if twice else 1):  # twice: two forwards, then two backwards (not allowed when last)
            ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
            losses.append(ctx.token_loss(ptl, batch.loss_mask))
        for loss in losses:
            ctx.backward(loss)


def test_overlap_launches_buckets_in_the_last_backward_and_keeps_the_numbers():
    data = make_data("llama", 4, 0)
    grads = {}
    for bucket_bytes, last in ((0, False), (1000, True)):
        model, dc = _engine(bucket_bytes)
        _run(model, dc, data, [0, 1], last=False)
        assert dc.grad_sync._next == 0  # nothing goes out before the last micro-batch
        _run(model, dc, data, [2, 3], last=last)
        before = dc.grad_sync._next
        dc.sync_gradients()
        grads[bucket_bytes] = dc.flat_grad.clone()
        if last:
            assert before == dc.grad_sync.last_overlapped > dc.grad_sync.num_buckets // 2
    assert grads[0].equal(grads[1000])


def test_two_backwards_in_the_last_micro_batch_are_caught():
    data = make_data("llama", 2, 0)
    model, dc = _engine(1000)
    with pytest.raises(RuntimeError, match="arrived after its bucket's all-reduce was launched"):
        _run(model, dc, data, [0, 1], last=True, twice=True)
    dc.zero_grad()
    _run(model, dc, data, [0], last=False)
    _run(model, dc, data, [1], last=True)
    with pytest.raises(RuntimeError, match="loss was counted after the step's gradient sync began"):
        _run(model, dc, data, [0], last=False)  # a micro-batch after the one announced as last


def test_default_buckets_stay_few_and_grow_with_the_world():
    """A 7B model's 28 GB of fp32 gradients: 25 MiB buckets would be about 1000 sequential
    all-reduces; the default keeps them <= 64 and larger as the ring gets longer. A small
    model still gets the 25 MiB floor (one bucket here). Built on the meta device: no memory."""
    sizes = {}
    for world in (8, 1024):
        gs = GradSync([nn.Parameter(torch.empty(7 * 10**9, device="meta"))], world_size=world)
        assert 1 < gs.num_buckets <= MAX_BUCKETS, (world, gs.num_buckets)
        assert gs.bucket_bytes % 4 == 0 and (gs.num_buckets - 1) * gs.bucket_bytes < 4 * gs.flat_grad.numel()
        sizes[world] = gs.bucket_bytes
    assert sizes[1024] > sizes[8]
    assert sync_buckets(7e9, 1, 8) == 64 and sync_buckets(7e9, 1, 1024) == 4  # the cost model agrees
    _, dc = _engine(None)
    assert dc.grad_sync.bucket_bytes == MIN_BUCKET_BYTES and dc.grad_sync.num_buckets == 1
    dc.grad_sync.set_bucket_bytes(1000)  # an explicit size wins
    assert dc.grad_sync.num_buckets == -(-dc.flat_grad.numel() // 250)


def test_a_parameter_the_last_backward_cannot_reach_holds_back_no_bucket():
    """A parameter the loss never reaches, last in the parameter order (so in bucket 0): its
    hook never runs. ctx.backward searches the graph first, so every bucket goes out in that
    backward; a backward called outside ctx.backward leaves them all to sync_gradients."""
    data = make_data("llama", 2, 0)
    grads = {}
    for outside in (False, True):
        model = make_model("llama")
        model.tail = nn.Linear(4, 3, bias=False)  # registered last: the last parameter
        dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS)
        dc.grad_sync.set_bucket_bytes(1000)
        mb = MicroBatch((0, 1), Layout(1, 2))
        batch = text_batch(mb, (0,), 0, data.docs, data.labels)
        with dc.micro_batch(batch, last=True) as ctx:
            ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
            loss = ctx.token_loss(ptl, batch.loss_mask)
            if not outside:
                ctx.backward(loss)
        if outside:
            loss.backward()
        launched = dc.grad_sync._next
        dc.sync_gradients()
        grads[outside] = dc.flat_grad.clone()
        assert launched == dc.grad_sync.last_overlapped == (0 if outside else dc.grad_sync.num_buckets)
    assert grads[False].equal(grads[True])


def test_reentrant_checkpointing_hides_parameters_so_nothing_is_skipped():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    assert reached_leaves(lin(x).sum()) == {id(lin.weight), id(lin.bias), id(x)}
    hidden = checkpoint(lin, x, use_reentrant=True).sum()
    assert reached_leaves(hidden) is None  # the parameters are only seen when it recomputes
