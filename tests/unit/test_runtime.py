"""The runtime on a single rank, no process group: engine vs. plain autograd, recompute,
the loss helper's normalisation, batch building, ZeRO-1 AdamW, errors."""

from __future__ import annotations

import math

import pytest
import torch

from dcparallel.data.batch import Batch
from dcparallel.data.collate import text_batch, video_batch
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime.engine import Engine, sample_seed
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.ulysses import check_heads
from dcparallel.spec import Layout, Recompute
from tests.support import NUM_HEADS, make_data, make_model, random_plan, reference, rel_err, run_rank_step

torch.set_num_threads(1)
KINDS = ["llama", "llama-tied", "dit", "dit-factorized"]


def engine(kind: str) -> Engine:
    m = make_model(kind)
    return Engine(m, layers=m.layers, num_heads=NUM_HEADS)


@pytest.mark.parametrize("kind", KINDS)
def test_single_rank_engine_equals_plain_autograd(kind):
    data = make_data(kind, 7, seed=3)
    ids = list(range(7))
    ref_loss, ref_grads = reference(make_model(kind), data, ids)
    dc = engine(kind)
    for seed in (1, 2):  # two steps: the second starts from zero gradients
        loss = run_rank_step(dc, data, random_plan(data, ids, 1, seed, len(dc.layers)), 0)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        for name, p in dc.model.named_parameters():
            # fp32; only packing and summation order differ from the reference
            assert rel_err(p.grad, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("kind", ["llama", "dit-factorized"])
def test_recompute_toggles_give_identical_grads_and_really_recompute(kind):
    data = make_data(kind, 3, seed=0)
    dc = engine(kind)
    num_layers = len(dc.layers)
    sids = (0,)
    attn_calls = [0] * num_layers
    mlp_calls = [0] * num_layers
    for i, layer in enumerate(dc.layers):
        inner = layer.attn_block.attention

        def counted(*a, _i=i, _inner=inner):
            attn_calls[_i] += 1
            return _inner(*a)

        layer.attn_block.attention = counted
        # the first Linear: non-reentrant checkpoint stops recomputing once it has every
        # tensor backward needs, so the last Linear of a block may never be re-run
        first_linear = next(m for m in layer.mlp_block.modules() if isinstance(m, torch.nn.Linear))
        first_linear.register_forward_hook(lambda *_, _i=i: mlp_calls.__setitem__(_i, mlp_calls[_i] + 1))
    grads = {}
    for rc in [
        Recompute(0, 0),
        Recompute(1, 0),
        Recompute(0, 2),
        Recompute(2, 1),
        Recompute.full(num_layers),
    ]:
        attn_calls[:] = [0] * num_layers
        mlp_calls[:] = [0] * num_layers
        plan = StepPlan(0, sids, (GroupPlan((0,), (MicroBatch(sids, Layout(1, 1, rc)),)),), 10)
        run_rank_step(dc, data, plan, 0)
        grads[rc] = [p.grad.clone() for p in dc.params]
        # recompute counts planner layers: a factorized DiT's layer is a spatial + temporal block pair
        layer = [dc.adapter.layer_of(i) for i in range(num_layers)]
        assert attn_calls == [2 if layer[i] < rc.attn else 1 for i in range(num_layers)], (rc, attn_calls)
        assert mlp_calls == [2 if layer[i] < rc.mlp else 1 for i in range(num_layers)], (rc, mlp_calls)
    base = grads[Recompute(0, 0)]
    for rc, g in grads.items():
        # recomputation re-runs the same fp32 ops in the same order: bitwise equal
        assert all(torch.equal(a, b) for a, b in zip(g, base, strict=True)), rc


def test_token_loss_sums_and_counts_targets_and_ignores_padding():
    dc = engine("llama")
    data = make_data("llama", 2, seed=0)
    mb = MicroBatch((0, 1), Layout(1, 2))
    batch = text_batch(mb, (0,), 0, data.docs, data.labels)
    with dc.micro_batch(batch) as ctx:
        ptl = torch.ones(batch.loss_mask.shape, requires_grad=True)
        with torch.no_grad():
            ptl[~batch.loss_mask] = float("nan")  # padding / non-targets may hold anything
        loss = ctx.token_loss(ptl, batch.loss_mask)
        assert float(loss.detach()) == float(batch.loss_mask.sum()) == sum(batch.num_targets)
        ctx.backward(loss)
        assert not torch.isnan(ptl.grad).any() and float(ptl.grad[~batch.loss_mask].abs().sum()) == 0
        # per-sample weights: the mean over samples -> each sample contributes weight 1
        w = batch.sample_mean_weights()
        ctx.token_loss(torch.ones(batch.loss_mask.shape), batch.loss_mask, w)
    assert dc.grad_sync.stats[1].item() == pytest.approx(sum(batch.num_targets) + 2)
    with pytest.raises(ValueError, match="differ"):
        with dc.micro_batch(batch) as ctx:
            ctx.token_loss(torch.ones(3), batch.loss_mask)


def test_sync_divides_by_the_global_count_and_refuses_an_empty_step():
    dc = engine("llama")
    data = make_data("llama", 2, seed=0)
    batch = text_batch(MicroBatch((0,), Layout(1, 1)), (0,), 0, data.docs, data.labels)
    with dc.micro_batch(batch) as ctx:
        x = dc.params[0]
        ctx.backward(ctx.token_loss(x.sum() * torch.ones(batch.loss_mask.shape), batch.loss_mask))
    n = int(batch.loss_mask.sum())
    assert dc.sync_gradients() == pytest.approx(float(x.detach().sum()))
    assert dc.last_count == n
    torch.testing.assert_close(dc.params[0].grad, torch.ones_like(x))  # n targets x 1 / n
    with pytest.raises(ValueError, match="0.0 targets"):
        dc.sync_gradients()  # a step in which no rank had a target


def test_text_batch_shifts_before_sharding_and_keeps_global_positions():
    data = make_data("llama", 3, seed=1)
    mb = MicroBatch((2, 0, 1), Layout(4, 3))
    shards = [text_batch(mb, (4, 5, 6, 7), r, data.docs, data.labels) for r in (4, 5, 6, 7)]
    row = lambda f: torch.cat([f(b) for b in shards], dim=1)[0]
    seq_len = shards[0].seq_len
    assert seq_len == sum(data.docs[s].numel() for s in (2, 0, 1)) and shards[0].padded_len % 4 == 0
    assert torch.equal(row(lambda b: b.inputs)[:seq_len], torch.cat([data.docs[s] for s in (2, 0, 1)]))
    assert torch.equal(row(lambda b: b.labels)[:seq_len], torch.cat([data.labels[s] for s in (2, 0, 1)]))
    assert torch.equal(
        row(lambda b: b.positions)[:seq_len],
        torch.cat([torch.arange(data.docs[s].numel()) for s in (2, 0, 1)]),
    )
    assert (row(lambda b: b.token_sample)[seq_len:] == -1).all() and not row(lambda b: b.loss_mask)[seq_len:].any()
    assert shards[0].num_targets == tuple(int((data.labels[s] != -100).sum()) for s in (2, 0, 1))
    assert int(row(lambda b: b.loss_mask).sum()) == sum(shards[0].num_targets)
    full = torch.arange(seq_len)
    assert torch.equal(torch.cat([b.shard_sample(full) for b in shards])[:seq_len], full)
    with pytest.raises(ValueError, match="rank 3 is not in the group"):
        text_batch(mb, (4, 5, 6, 7), 3, data.docs)


def test_video_batch_refuses_mixed_shapes():
    data = make_data("dit", 6, seed=0)
    shapes = {data.shape_of[s] for s in range(6)}
    assert len(shapes) > 1
    a = 0
    b = next(s for s in range(6) if data.shape_of[s] != data.shape_of[a])
    with pytest.raises(ValueError, match="must share a shape"):
        video_batch(MicroBatch((a, b), Layout(1, 2)), (0,), 0, data.docs, data.positions, data.frames[a])


def test_zero_adamw_on_one_rank_equals_torch_adamw():
    """Same gradients in, same parameters out: ZeroAdamW's update is torch.optim.AdamW's
    (decoupled weight decay on matrices only)."""
    data = make_data("llama", 4, seed=2)
    dc = engine("llama")
    opt = dc.optimizer(lr=1e-2, weight_decay=0.1)
    ref = make_model("llama")
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    ref_opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    for step in range(3):
        run_rank_step(dc, data, random_plan(data, [0, 1, 2, 3], 1, step, len(dc.layers)), 0)
        for p, q in zip(dc.model.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(dc.model.named_parameters(), ref.parameters(), strict=True):
            # identical inputs; only the rounding of a few fused fp32 ops may differ
            assert rel_err(p.detach(), q.detach()) <= 1e-6, (step, name)
    with pytest.raises(RuntimeError, match="sync_gradients"):
        opt.zero_grad()
        opt.step()


def test_sample_seed_is_a_pure_function_of_seed_epoch_sample():
    assert sample_seed(0, 0, 5) == sample_seed(0, 0, 5)
    assert len({sample_seed(0, 0, 5), sample_seed(0, 1, 5), sample_seed(0, 0, 6), sample_seed(1, 0, 5)}) == 4
    assert 0 <= sample_seed(3, 2, 1) < 2**63


def test_single_rank_groups_and_errors():
    pg = ProcessGroups(NUM_HEADS)
    assert pg.blocks == ((0,),) and pg.group((0,)) is None
    with pytest.raises(ValueError, match=r"no process group was created for ranks \(0, 1\)"):
        pg.group((0, 1))
    with pytest.raises(ValueError, match="6 attention heads .* not divisible by 4"):
        check_heads(6, 4)
    dc = engine("llama")
    data = make_data("llama", 1, seed=0)
    batch = text_batch(MicroBatch((0,), Layout(2, 1)), (2, 3), 2, data.docs)
    with pytest.raises(ValueError, match="rank 0 got a batch for group"):
        with dc.micro_batch(batch):
            pass
    with pytest.raises(ValueError, match="set_attention"):
        Engine(torch.nn.Linear(2, 2), layers=[], num_heads=1)


def test_batch_sample_mean_weights():
    b = Batch(
        sample_ids=(3, 4),
        layout=Layout(1, 2),
        ranks=(0,),
        rank_in_group=0,
        inputs=torch.zeros(1, 6, dtype=torch.long),
        positions=torch.zeros(1, 6, dtype=torch.long),
        labels=None,
        loss_mask=torch.ones(1, 6, dtype=torch.bool),
        token_sample=torch.tensor([[0, 0, 1, 1, 1, -1]]),
        num_targets=(2, 4),
        cu_seqlens=(0, 2, 5),
        seq_len=5,
        padded_len=6,
    )
    assert b.sample_mean_weights().tolist() == [[0.5, 0.5, 0.25, 0.25, 0.25, 0.0]]
    assert math.isclose(float(b.sample_mean_weights().sum()), 1.75)


def test_bf16_params_accumulate_fp32_grads_and_keep_fp32_master_copies():
    data = make_data("llama", 3, seed=4)
    m = make_model("llama").to(torch.bfloat16)
    dc = Engine(m, layers=m.layers, num_heads=NUM_HEADS)
    opt = dc.optimizer(lr=1e-2)
    assert dc.flat_grad.dtype == torch.float32 and opt.master.dtype == torch.float32
    assert opt.master.data_ptr() != dc.flat_param.data_ptr()  # a separate fp32 copy
    run_rank_step(dc, data, random_plan(data, [0, 1, 2], 1, 0, len(dc.layers)), 0)
    assert all(g.dtype == torch.float32 for g in dc.gradients().values())
    assert all(p.grad is None for p in dc.params)  # ZeroAdamW reads the fp32 buffer: no bf16 copies
    ref_loss, ref_grads = reference(make_model("llama"), data, [0, 1, 2])
    assert abs(dc.last_loss - ref_loss) < 0.05 * ref_loss  # bf16 forward
    opt.step()
    torch.testing.assert_close(dc.flat_param[: dc.numel], opt.master[: dc.numel].to(torch.bfloat16))


def test_wrapping_keeps_state_dict_names_and_values():
    m = make_model("dit")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    dc = Engine(m, layers=m.layers, num_heads=NUM_HEADS)
    after = m.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    # the parameters now live in the flat buffer
    p = next(m.parameters())
    assert p.untyped_storage().data_ptr() == dc.flat_param.untyped_storage().data_ptr()


def test_cuda_kernel_never_calls_varlen_on_cpu():
    from dcparallel.models.attention import AttnPattern, cuda_varlen_attention, sdpa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 10, 2, 4, generator=g) for _ in range(3))
    cu = (0, 4, 9)
    out = cuda_varlen_attention(q, k, v, AttnPattern("causal"), cu)  # varlen_attn would raise on CPU
    assert torch.equal(out, sdpa_attention(q, k, v, AttnPattern("causal"), cu))


def test_process_groups_check_the_world_size():
    from dcparallel.spec import ClusterSpec

    assert ProcessGroups(NUM_HEADS, 1).blocks == ((0,),)
    with pytest.raises(ValueError, match="world size 4"):
        ProcessGroups(NUM_HEADS, 4)
    with pytest.raises(ValueError, match="world_size=8"):
        ProcessGroups(NUM_HEADS, ClusterSpec(world_size=8))


def test_a_model_cast_after_wrapping_is_refused_at_the_next_step():
    """model.double() (like model.to / .cuda / .half) after wrapping gives the parameters new
    storage: the optimizer would update the flat buffer the model no longer reads. The next
    step's first micro-batch refuses it instead of training silently wrong."""
    dc = engine("llama")
    data = make_data("llama", 2, seed=0)
    batch = text_batch(MicroBatch((0,), Layout(1, 1)), (0,), 0, data.docs, data.labels)

    def step():
        with dc.micro_batch(batch) as ctx:
            ctx.backward(ctx.token_loss(dc.params[0].sum() * torch.ones(batch.loss_mask.shape), batch.loss_mask))
        dc.sync_gradients()

    step()
    step()  # the parameters still live in the buffer: accepted
    dc.model.double()
    with pytest.raises(RuntimeError, match="moved or cast after DataCentricParallel"):
        step()
