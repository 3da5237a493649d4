"""Parameters and gradients sharded inside fixed blocks of ``shard_size`` ranks (FSDP2), with
uneven gradient accumulation kept.

The world is cut into aligned blocks of ``s`` ranks: block b is ranks ``b*s .. b*s+s-1``.
Inside a block, every repeated block of the model (the adapter's ``blocks``) and the root
are wrapped by PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) on a 1-D mesh of the
block's ranks: each rank stores 1/s of every parameter, the layer's parameters are
all-gathered for its forward and backward, and each micro-batch's backward reduce-scatters
its gradients (a plain sum: divide factor 1) into this rank's shard — with
`ShardedGrads.set_accumulate_unsharded`, only the step's last (the others keep them whole,
FSDP's gradient sync off: `cost.grad_hold` decides when they fit). The ranks of a block
are always in one SP group (the plan rule, `dcparallel.plan.types.StepPlan.check_shard_blocks`:
every SP group is made of whole blocks), so they run the same micro-batch sequence and
FSDP's collectives match inside the block whatever the other blocks do; a block that runs
nothing calls no FSDP collective at all.

The step's one reduction (`ShardedGrads.finish`, on every rank, idle blocks included):

- this rank's gradient shards live in one flat fp32 buffer (``flat_grad``; each ``p.grad``
  is a DTensor over a view of it, into which FSDP accumulates; allocated at the first
  micro-batch, so wrapping and loading weights hold no gradient), summed over the *replicas*
  (the ranks holding the same shard index in every block: ``r % s`` equal) by one
  all-reduce; an idle block contributes its zeros;
- this rank's summed loss and target count are summed over the world;
- the gradients are divided by the global target count, as in `runtime.grad_sync`.

Mixed precision: a bf16 / fp16 model keeps fp32 sharded trainable parameters (they are the
values the optimizer updates) and computes in its own dtype
(`MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`); gradients are reduced and
accumulated in fp32. fp32 trainable parameters on a bf16 base (LoRA adapters) compute as they
do unsharded, each parameter in its own dtype. Frozen parameters (``requires_grad=False``: a LoRA's base) are sharded in
the blocks too, in their own dtype, and get no gradient: FSDP gathers them with the trainable
ones and reduce-scatters only gradients, so the buffer below holds the trainable ones' alone.

A model built on the meta device (`runtime.meta_init.empty_init`) is wrapped the same way
on meta; only then do its parameters get storage on the run's device: this rank's fp32
shards (`runtime.meta_init.materialize`), filled by `Engine.load_weights`.

The optimizer for this path (`runtime.sharded_optim.ShardedAdamW`) keeps fp32 master weights
and moments of 1/W of the parameters per rank (ZeRO-1 over the replicas on top of the block
shard).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dcparallel.plan.types import splits_shard_block
from dcparallel.runtime import comm
from dcparallel.runtime.grad_sync import check_normalizer
from dcparallel.runtime.meta_init import materialize


def check_group(ranks: Sequence[int], shard_size: int) -> None:
    """An SP group must be made of whole shard blocks (else FSDP's collectives inside a
    block would not match and hang): at least ``shard_size`` ranks, a multiple of it,
    starting at a multiple of it."""
    s = shard_size
    if splits_shard_block(ranks, s):
        raise ValueError(
            f"the SP group {tuple(ranks)} splits a parameter-shard block of shard_size={s} (blocks are ranks "
            f"b*{s} .. b*{s}+{s - 1}): its ranks would run different micro-batches and FSDP would hang; plan "
            f"with SP groups of whole blocks (sizes >= {s}, aligned), e.g. a Topology built with shard_size={s}"
        )


def _fp32_masters(model: nn.Module, train_dtype: torch.dtype):
    """FSDP2's mixed precision for trainable parameters of ``train_dtype``. Low precision: the
    trainable parameters (the optimizer's master weights) and buffers become fp32 in place,
    computing in ``train_dtype``; frozen ones keep theirs (nothing updates them: a bf16 base
    stays bf16). fp32 (also fp32 adapters on a bf16 base): each parameter computes in its own
    dtype, as unsharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if train_dtype == torch.float32:
        return MixedPrecisionPolicy()
    for t in [*(p for p in model.parameters() if p.requires_grad), *model.buffers()]:
        if t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()
    return MixedPrecisionPolicy(param_dtype=train_dtype, reduce_dtype=torch.float32)


class ShardedGrads:
    """FSDP2 on the model inside blocks of ``shard_size`` ranks, the flat buffer of this
    rank's gradient shards and the step's reduction over replicas (module docstring).

    Duck-types the part of `runtime.grad_sync.GradSync` the engine and the micro-batch
    context use: ``params``, ``synced``, ``last_loss``, ``last_count``, `add_stats`, `begin`,
    `arm`, `zero_grad`, `finish`. ``params`` are the model's trainable parameters *after* wrapping
    (DTensors, sharded over the block's mesh)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module],
        shard_size: int,
        stats_group=None,
        device: torch.device | None = None,
    ):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        world, rank = comm.world_size(), comm.world_rank()
        s = shard_size  # validated by the engine against the cluster (`spec.check_shard_size`)
        first = next(p for p in model.parameters() if p.requires_grad)
        #: built on the meta device: sharded first, then only this rank's shards get storage
        self.from_meta = first.device.type == "meta"
        device = device if self.from_meta else first.device
        assert device is not None and device.type != "meta", "a meta model needs the run's device"
        # the model computes in its base weights' dtype (the first parameter's: a frozen bf16
        # base under fp32 adapters computes in bf16, as it does unsharded)
        dtype = next(model.parameters()).dtype
        self.shard_size, self.world_size, self.rank = s, world, rank
        self.num_replicas = world // s
        self.replica_index = rank // s  # which block this rank is in
        self.shard_index = rank % s  # which shard of every parameter it holds
        self.mesh = init_device_mesh(device.type, (self.num_replicas, s), mesh_dim_names=("replica", "shard"))
        self.shard_mesh = self.mesh["shard"]
        self.shard_group = self.shard_mesh.get_group()
        self.replica_group = self.mesh["replica"].get_group() if self.num_replicas > 1 else None
        self.stats_group = stats_group
        self.compute_dtype = dtype
        train_dtype = first.dtype
        del first  # no reference to a whole parameter outlives the sharding
        mp = _fp32_masters(model, train_dtype)
        for block in blocks:
            fully_shard(block, mesh=self.shard_mesh, mp_policy=mp)
        fully_shard(model, mesh=self.shard_mesh, mp_policy=mp)
        #: persistent buffers that were on meta: only a checkpoint can fill them (`load_weights`)
        self.unfilled_buffers = materialize(model, device) if self.from_meta else []
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # a sum: the step divides by the target count
                m.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        # ``ranges``: this rank's shard of every parameter, one after the other, padded to a multiple of
        # the replicas (the optimizer's ZeRO-1 pieces); the same layout on every replica
        self.ranges: list[tuple[int, int]] = []
        off = 0
        for p in self.params:
            n = p.to_local().numel()
            self.ranges.append((off, off + n))
            off += n
        self.local_numel = off
        self.piece_numel = math.ceil(off / self.num_replicas)
        self.device = device
        self._flat_grad: Tensor | None = None  # `flat_grad`: made by the first micro-batch
        self._grads: list[Tensor] = []  # each p.grad: a DTensor over a view of it
        self.numel = sum(p.numel() for p in self.params)
        self.stats = torch.zeros(2, dtype=torch.float64, device=device)
        self.synced = False
        self.last_loss = float("nan")
        self.last_count = 0.0
        self.accumulate_unsharded = False  # `set_accumulate_unsharded`
        self._unsynced = False  # FSDP holds whole gradients a reduce-scatter has yet to take
        self._broken = ""  # why no further step may run (a step ended with gradients held)

    @property
    def flat_grad(self) -> Tensor:
        """This rank's fp32 gradient shards end to end (the layout of ``ranges``, padded to a
        multiple of the replicas), zeros when first read: `begin` reads it before the first
        backward, so until then (wrap, `load_weights`) no gradient memory is held."""
        if self._flat_grad is None:
            flat = torch.zeros(self.piece_numel * self.num_replicas, dtype=torch.float32, device=self.device)
            self._grads = [self._as_grad(p, flat[lo:hi]) for p, (lo, hi) in zip(self.params, self.ranges, strict=True)]
            self._flat_grad = flat
        return self._flat_grad

    @staticmethod
    def _as_grad(p: nn.Parameter, view: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        local = view.view(p.to_local().shape)
        g = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
        assert g.to_local().numel() == 0 or g.to_local().data_ptr() == local.data_ptr(), "grad is not a view"
        return g

    @property
    def flat_param(self):
        raise ValueError(
            "with shard_size > 1 the parameters are FSDP shards (DTensors): there is no flat "
            "parameter buffer; use model.named_parameters() (p.to_local(), p.full_tensor())"
        )

    @property
    def shard_numel(self):
        raise ValueError(
            "with shard_size > 1 there is no ZeRO-1 range of a flat parameter buffer (the optimizer "
            "state is ShardedAdamW's); checkpoints of sharded runs are keyed by parameter name: "
            "dcparallel.runtime.sharded_checkpoint, dcparallel.checkpoint.save"
        )

    # ------------------------------------------------------------------ the engine's calls

    def add_stats(self, loss_sum: Tensor, count: Tensor) -> None:
        """Adds a micro-batch's summed loss and target count (this rank's shard of it)."""
        self.stats += torch.stack([loss_sum.detach().double(), count.detach().double()])

    def set_accumulate_unsharded(self, on: bool) -> None:
        """``on``: a micro-batch announced as not the step's last (``last=False``, or a loader
        batch's ``last_of_step``) runs with FSDP's gradient sync off, so its gradients stay
        whole (fp32, 4 bytes a parameter: `cost.base.state_recipe` with ``unsharded_grads``)
        and accumulate until the block's last micro-batch, whose backward reduce-scatters the
        sum once: one reduce-scatter per step instead of one per micro-batch. Between steps."""
        if self._unsynced:
            raise RuntimeError("set_accumulate_unsharded in the middle of a step: call it between steps")
        self.accumulate_unsharded = bool(on)

    def begin(self, last: bool | None = None) -> None:
        """A micro-batch starts: the first one of a step (the first of all, or the first after
        `finish`) zeroes the gradient shards and makes every ``p.grad`` a view of them.
        ``last``: whether it is this rank's last of the step (None: not known, so its backward
        reduce-scatters); with `set_accumulate_unsharded` only a known last one does."""
        if self._broken:
            raise RuntimeError(self._broken)
        if self.synced or self._flat_grad is None:
            self.zero_grad()
        hold = self.accumulate_unsharded and last is False and torch.is_grad_enabled()  # no_grad: nothing held
        self.model.set_requires_gradient_sync(not hold)
        self._unsynced = hold  # a micro-batch with the sync on reduce-scatters what earlier ones held

    def arm(self) -> None:
        """The last micro-batch of the step begins (the sharded path does not overlap the
        replica all-reduce with it: FSDP's reduce-scatters already run during backward)."""
        if self.synced:
            self.zero_grad()

    def skip_unreached(self, loss: Tensor) -> None:
        """Nothing to do: the replica all-reduce does not overlap the last backward (`arm`)."""

    def zero_grad(self) -> None:
        """Starts a new step: gradient shards and statistics zero, every ``p.grad`` a view of
        ``flat_grad`` again (FSDP accumulates each micro-batch's reduce-scatter into it).
        Refused while FSDP holds whole gradients no reduce-scatter has taken yet (they are
        FSDP's, out of reach here, and would join the next step's)."""
        if self._unsynced or self._broken:
            raise RuntimeError(
                self._broken
                or "zero_grad in the middle of a step whose gradients FSDP holds whole "
                "(micro-batches announced as not the last): run the step's last micro-batch and "
                "sync_gradients first"
            )
        self.flat_grad.zero_()
        self.stats.zero_()
        for p, g in zip(self.params, self._grads, strict=True):
            p.grad = g
        self.synced = False

    def _fold_foreign_grads(self) -> None:
        """A ``p.grad`` someone replaced (e.g. ``model.zero_grad()`` mid-step, or a backward run
        outside a micro-batch, after which FSDP made a new one) is added into the buffer, so no
        gradient is dropped."""
        flat = self.flat_grad
        for p, g, (lo, hi) in zip(self.params, self._grads, self.ranges, strict=True):
            if p.grad is not g and p.grad is not None:
                flat[lo:hi].add_(p.grad.to_local().reshape(-1).float())
            p.grad = g

    def finish(self, normalizer: float | None = None) -> float:
        """The step's reduction (module docstring); every rank calls it once per step.
        ``normalizer``: divide by this constant instead of the global target count. Returns
        the step's mean loss."""
        if self.synced:  # this rank ran no micro-batch since the last step
            self.zero_grad()
        if self._unsynced:  # FSDP keeps what it holds: no later step may run on this engine
            self._broken = (
                "the step's last micro-batch on this rank was announced as not the last (last=False or "
                "Batch.last_of_step False), so its gradients are still whole and unreduced in FSDP and "
                "the step's gradients are incomplete; this engine runs no further step (resume from a "
                "checkpoint): announce the last micro-batch of each step (micro_batch(batch, last=True)), "
                "or call dc.grad_sync.set_accumulate_unsharded(False)"
            )
        if self._broken:
            raise RuntimeError(self._broken)
        self._fold_foreign_grads()
        comm.all_reduce_(self.flat_grad, self.replica_group)  # None: one block, nothing to sum
        comm.all_reduce_(self.stats, comm.WORLD if self.stats_group is None else self.stats_group)
        loss_sum, count = self.stats.tolist()
        if not count > 0:
            raise ValueError(
                f"the step has {count} targets over all ranks: nothing to normalize by; check the labels / loss masks"
            )
        divisor = count if normalizer is None else check_normalizer(normalizer)
        self.last_loss, self.last_count = loss_sum / divisor, count
        self.flat_grad.div_(divisor)
        self.synced = True
        return self.last_loss

    # ------------------------------------------------------------------ after the sync

    def _require_synced(self, what: str) -> None:
        if not self.synced:
            raise RuntimeError(f"{what} needs the step's gradients: call dc.sync_gradients() first")

    def full_gradients(self) -> dict[str, Tensor]:
        """Every trainable parameter's whole gradient by name (fp32, on every rank).
        Collective: every rank calls it (each block all-gathers its shards)."""
        self._require_synced("full_gradients")
        return {n: g.full_tensor() for n, g in zip(self.names, self._grads, strict=True)}

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """The global norm of the step's gradients over shards and replicas (collective)."""
        self._require_synced("the gradient norm")
        mine = self.flat_grad[: self.local_numel]
        if math.isinf(norm_type):
            t = mine.abs().max() if mine.numel() else mine.new_zeros(())
            return float(comm.all_reduce_(t.reshape(1).clone(), self.shard_group, "max"))
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_ with shard_size > 1 supports norm_type 2 or inf; got {norm_type}")
        # the shard's norm reduced in fp32 without a copy; the squares summed over shards in fp64
        t = comm.all_reduce_(torch.linalg.vector_norm(mine).double().square().reshape(1), self.shard_group)
        return float(t.sqrt())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scales the gradients by min(1, max_norm / (norm + 1e-6)) as
        `torch.nn.utils.clip_grad_norm_` does, with the global norm; returns the norm before
        clipping. Collective."""
        norm = self.grad_norm(norm_type)
        coef = min(1.0, float(max_norm) / (norm + 1e-6))
        if coef < 1.0:
            self.flat_grad.mul_(coef)
        return norm

    def storage_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameter shards and gradient shards during training
        (for the memory report; the gradient buffer is counted before its first micro-batch too)."""
        return {
            "params": sum(p.to_local().numel() * p.element_size() for p in self.params),
            "grads": self.piece_numel * self.num_replicas * 4,
        }
