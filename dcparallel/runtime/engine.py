"""`Engine`: runs this rank's part of a `StepPlan`, one micro-batch at a time.

Per micro-batch (`micro_batch`): the batch's SP group drives the model's attention
(Ulysses), recomputation is set per layer from the layout, each sample gets a generator
seeded by (seed, epoch, sample id), and the loss helper returns the shard's summed loss
while counting its targets. Gradients go, as they are accumulated, into one flat fp32
buffer whose last two elements are this rank's summed loss and target count
(`runtime.grad_sync.GradSync`, which also owns the flat parameters); its bucketed
all-reduce over the whole world starts during the backward of this rank's last micro-batch
of the step (`Batch.last_of_step`, or ``micro_batch(batch, last=True)``) and
`sync_gradients` finishes it, on every rank (also ranks that ran nothing), and divides by
the global count. Not DDP: docs/design.md, "Exact gradient".
Recomputation wrappers: `runtime.recompute`; the optimizer: `runtime.zero`. With
``shard_size`` s > 1 the parameters and gradients are sharded (FSDP2) inside aligned blocks
of s ranks instead of replicated in the flat buffers: `runtime.sharded` (its `ShardedGrads`
stands where `GradSync` does) and `runtime.sharded_optim`. The user-facing
`dcparallel.DataCentricParallel` (api.py) holds one `Engine` and adds `prepare`.

    dc = Engine(model)                               # the adapter is found from the model
    opt = dc.optimizer(lr=3e-4)                      # ZeRO-1 AdamW (or any torch.optim)
    for step_batches in loader:                      # this rank's Batches of one step
        for batch in step_batches:
            with dc.micro_batch(batch) as ctx:
                ctx.backward(ctx.lm_loss(model(batch.inputs, batch.positions)))
        dc.sync_gradients()                          # every rank, every step
        dc.clip_grad_norm_(1.0)                      # optional: global-norm clipping
        opt.step()

Wrap the model after moving it to its device and dtype: the trainable parameters become
views of one flat buffer. A model too large for one device is built under
`runtime.meta_init.empty_init`, wrapped with shard_size > 1 (``device``: where its shards
live; default the launch's) and given its weights by `Engine.load_weights`.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from dcparallel.adapters.base import ModelAdapter
from dcparallel.adapters.find import find_adapter
from dcparallel.data.batch import Batch
from dcparallel.loss import per_token_loss
from dcparallel.runtime import comm, synced_grads
from dcparallel.runtime.attention_check import AttentionProbe
from dcparallel.runtime.buffers import refuse_running_stats
from dcparallel.runtime.grad_sync import GradSync
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.launch import abort_on_oom, default_device
from dcparallel.runtime.meta_init import check_meta_model, load_weights, on_meta
from dcparallel.runtime.recompute import LayerRecompute
from dcparallel.runtime.sharded import ShardedGrads, check_group
from dcparallel.runtime.sharded_optim import ShardedAdamW
from dcparallel.runtime.ulysses import Kernel, UlyssesAttention, check_heads
from dcparallel.runtime.zero import ZeroAdamW
from dcparallel.spec import ClusterSpec, Recompute, check_shard_size


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed, a pure function of (seed, epoch, sample id)."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(sample_id)]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class MicroBatchContext:
    """What the training loop uses inside `Engine.micro_batch`: per-sample generators and
    the loss helpers, which count the shard's loss and targets into ``grad_sync``."""

    def __init__(self, batch: Batch, grad_sync: GradSync, seed: int, epoch: int):
        self.batch, self.grad_sync, self.seed, self.epoch = batch, grad_sync, seed, epoch

    def generator(self, sample_id: int) -> torch.Generator:
        """A generator seeded by (seed, epoch, sample id) on the batch's device: every rank of
        the group draws the same noise / timesteps / masks for the sample, where the model
        runs (a draw on the host would be copied to the device mid-step)."""
        if sample_id not in self.batch.sample_ids:
            raise ValueError(f"sample {sample_id} is not in this micro-batch {self.batch.sample_ids}")
        return device_generator(self.batch.inputs.device, sample_seed(self.seed, self.epoch, sample_id))

    def lm_loss(self, logits: Tensor) -> Tensor:
        """The shard's summed next-token loss from (B, L, vocab) logits — a transformers
        model's ``.logits`` or the reference LM's output — against the batch's labels
        (shifted before sharding; ignored positions and padding excluded)."""
        if self.batch.labels is None:
            raise ValueError("lm_loss needs a text batch with labels; this micro-batch has none")
        ptl, _ = per_token_loss(logits, self.batch.labels.to(logits.device))
        return self.token_loss(ptl, self.batch.loss_mask.to(logits.device))

    def dense_loss(self, per_position_loss: Tensor) -> Tensor:
        """The summed loss of a model whose output every rank of the group holds whole (a
        dense video transformer gathers its tokens before the output layer): each rank
        counts 1/sp of every position, so the group counts each once and the gradient
        through the gather is exact. ``per_position_loss`` (B, ...) unreduced, e.g. the mean
        over channels of the squared error per latent position."""
        if self.batch.sharded and self.batch.sp > 1:
            raise ValueError(
                "dense_loss is for batches every rank of the group holds whole (Batch.sharded False); "
                "this rank holds a shard of the rows: use token_loss with the batch's loss_mask"
            )
        mask = torch.ones_like(per_position_loss, dtype=torch.bool)
        w = torch.full_like(per_position_loss, 1.0 / self.batch.sp, dtype=torch.float32)
        return self.token_loss(per_position_loss, mask, w)

    def token_loss(self, per_token_loss: Tensor, mask: Tensor, sample_weights: Tensor | None = None) -> Tensor:
        """The shard's summed loss: sum of ``per_token_loss`` over ``mask`` (x
        ``sample_weights``, broadcastable: e.g. `Batch.sample_mean_weights()` for a mean over
        samples). Counts the shard's targets (sum of weights over the mask) for the step's
        normalizer; the gradient is divided by the global count in `sync_gradients`."""
        if per_token_loss.shape != mask.shape:
            raise ValueError(
                f"per-token loss {tuple(per_token_loss.shape)} and mask {tuple(mask.shape)} "
                f"differ; pass the unreduced loss (reduction='none') shaped like the mask"
            )
        mask = mask.bool()
        w = mask.to(torch.float32)
        if sample_weights is not None:
            w = w * sample_weights.to(torch.float32)
        # where(), not a product: padding may hold inf/nan and must not reach the gradient.
        loss = torch.where(mask, per_token_loss.float() * w, per_token_loss.new_zeros(()).float()).sum()
        self.grad_sync.add_stats(loss, w.sum())  # stays on the device
        return loss

    def backward(self, summed_loss: Tensor) -> None:
        """Backward of the shard's summed loss. Every rank of the batch's group must call it
        for the same micro-batch (backward runs the mirrored all-to-alls in that group);
        recomputed forwards get the batch's group back even after the block has exited. In
        the rank's last micro-batch, parameters the loss does not reach (an expert no token
        went to) stop holding back the gradient sync's buckets (`GradSync.skip_unreached`)."""
        self.grad_sync.skip_unreached(summed_loss)
        summed_loss.backward()


_warned_fp32_cuda = False
#: the models an engine wraps (each once: a second engine on one model is refused)
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def warn_fp32_cuda(params: Sequence[Tensor]) -> None:
    """Warns, once per process, when trainable parameters are float32 on a GPU: every matmul
    then runs at a fraction of the bf16 rate and activations take twice the memory. The
    optimizer keeps fp32 master weights either way, so bf16 parameters lose no update."""
    global _warned_fp32_cuda
    if _warned_fp32_cuda or not any(p.device.type == "cuda" and p.dtype == torch.float32 for p in params):
        return
    _warned_fp32_cuda = True
    warnings.warn(
        "the model's parameters are float32 on CUDA: cast it with model.to(torch.bfloat16) before "
        "wrapping (the optimizer keeps fp32 master weights); `dcparallel train` does so unless "
        '[train] dtype = "float32"',
        stacklevel=3,
    )


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a step trains, refused when there are none or they mix dtypes."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; cast the model to one dtype")
    warn_fp32_cuda(params)
    return params


def engine_shard_size(cluster: ClusterSpec | None, shard_size: int | None) -> int:
    """The parameter-shard block size: ``shard_size`` or the cluster spec's (not two different
    ones), checked against the launched world and the cluster's node size."""
    cluster_shard = cluster.shard_size if isinstance(cluster, ClusterSpec) else 1
    if shard_size is not None and cluster_shard != 1 and shard_size != cluster_shard:
        raise ValueError(
            f"shard_size={shard_size} differs from the cluster spec's shard_size={cluster_shard}; give one of them"
        )
    return check_shard_size(
        shard_size if shard_size is not None else cluster_shard,
        comm.world_size(),
        cluster.gpus_per_node if isinstance(cluster, ClusterSpec) else comm.world_size(),
    )


class Engine:
    """Wraps a single-device model for data-centric steps.

    ``adapter``: how to drive the model (`dcparallel.adapters.ModelAdapter`); found from the
    model when not given (reference models, transformers causal LMs, diffusers Wan, or the
    model protocol with ``layers`` / ``num_heads``). Recompute counts of a layout are planner
    layers: layer i is blocks ``i * blocks_per_layer ...`` of the adapter.
    Trainable parameters are moved into one flat buffer (their storage becomes views of it;
    names and state_dict are unchanged) so the ZeRO-1 optimizer can update a shard and
    all-gather it. Everything is checked before the model is changed: a constructor that
    raises leaves the model as it was."""

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Sequence[nn.Module] | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        adapter: ModelAdapter | None = None,
        cluster: ClusterSpec | None = None,
        seed: int = 0,
        kernel: Kernel | None = None,
        groups: ProcessGroups | None = None,
        shard_size: int | None = None,
        device: torch.device | None = None,
    ):
        if model in _WRAPPED:
            raise ValueError(f"{type(model).__name__} is already wrapped by a DataCentricParallel; wrap a model once")
        if comm.world_size() > 1:  # buffers updated from each rank's own samples would drift apart
            refuse_running_stats(model)
        self.adapter = adapter or find_adapter(model, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads)
        params = trainable_params(model)
        self.shard_size = engine_shard_size(cluster, shard_size)
        #: built on the meta device (`runtime.meta_init`): its weights come from `load_weights`
        self.weights_pending = on_meta(model)
        self.optimizer_made = False  # `load_weights` must come first with shard_size 1 (ZeRO-1 copies masters)
        if self.weights_pending:
            check_meta_model(model, self.shard_size)
        self.model = model
        self.layers = list(self.adapter.blocks)
        self.num_heads = self.adapter.num_heads
        self.num_kv_heads = self.adapter.num_kv_heads
        self.seed = seed
        self.epoch = 0
        self.groups = groups if groups is not None else ProcessGroups(self.num_heads, cluster)
        self.rank, self.world_size = comm.world_rank(), comm.world_size()
        self.attention = UlyssesAttention(kernel)
        # the attention behind a probe that checks, until a forward ran every block, that each calls it
        self.attention_probe = AttentionProbe(self.attention, self.layers)
        self.adapter.install_attention(self.attention_probe)
        self._hooks = self.adapter.install_hooks(self.attention) if self.adapter.install_hooks else []
        self.recompute = LayerRecompute(self.adapter, self.attention)
        self.attention_verified = False  # every block called the installed attention (`attention_check`)
        _WRAPPED.add(model)
        self.grad_sync = self._make_grad_sync(params, device)
        self.params = self.grad_sync.params if self.shard_size > 1 else params

    def _make_grad_sync(self, params: list[nn.Parameter], device: torch.device | None) -> GradSync | ShardedGrads:
        """The step's gradient sync: FSDP2 inside blocks of shard_size ranks (`runtime.sharded`),
        else ZeRO-1's flat buffer over the world (`runtime.grad_sync`)."""
        if self.shard_size > 1:
            return ShardedGrads(
                self.model,
                self.layers,
                self.shard_size,
                stats_group=self.groups.grad_sync,
                device=device or default_device(),
            )
        return GradSync(params, world_size=self.world_size, rank=self.rank, group=self.groups.grad_sync)

    # the flat buffers and the step's statistics live in `grad_sync`
    flat_param = property(lambda self: self.grad_sync.flat_param)
    flat_grad = property(lambda self: self.grad_sync.flat_grad)
    numel = property(lambda self: self.grad_sync.numel)
    shard_numel = property(lambda self: self.grad_sync.shard_numel)
    last_loss = property(lambda self: self.grad_sync.last_loss)
    last_count = property(lambda self: self.grad_sync.last_count)

    def load_weights(self, folder: str | Path) -> None:
        """Loads a ``save_pretrained`` folder's safetensors into the wrapped model, each rank
        reading only its shards (`runtime.meta_init.load_weights`): the way a model built on
        the meta device gets its weights. Not collective."""
        if self.shard_size == 1 and self.optimizer_made:
            raise ValueError(
                "load_weights after dc.optimizer() with shard_size 1: the ZeRO-1 optimizer already "
                "copied the weights it updates (fp32 masters of a low-precision model); call "
                "dc.load_weights(folder) before dc.optimizer()"
            )
        load_weights(self.model, folder)
        self.weights_pending = False

    # ------------------------------------------------------------------ per micro-batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def zero_grad(self) -> None:
        """Starts a new step's accumulation (done automatically after `sync_gradients`)."""
        self.grad_sync.zero_grad()

    def recompute_modes(self) -> list[str]:
        """The mode of every block right now ("none", "attn", "mlp", "full")."""
        return self.recompute.modes()

    @contextlib.contextmanager
    def micro_batch(self, batch: Batch, last: bool | None = None) -> Iterator[MicroBatchContext]:
        """Runs one micro-batch on this rank: activates the batch's SP group in attention (its
        Ulysses sub-group and ring under `Layout.ring` > 1) and the layout's recomputation.
        Forward and `ctx.backward` both go inside the block.
        ``last``: this is the rank's last micro-batch of the step, so its backward overlaps
        the gradient sync (default: ``batch.last_of_step``, set by the loader; None: no
        overlap). An out-of-memory error in a micro-batch of a loader step ends every rank
        (`runtime.launch.abort_on_oom`) instead of leaving its SP group waiting."""
        if self.weights_pending:
            raise ValueError(
                "the model was built on the meta device and has no weights yet: call "
                "dc.load_weights(folder) (a save_pretrained folder) or resume a checkpoint first"
            )
        if self.rank not in batch.ranks:
            raise ValueError(
                f"rank {self.rank} got a batch for group {batch.ranks}; the loader must hand "
                f"each rank only the micro-batches of its own group"
            )
        if batch.layout.sp != len(batch.ranks):
            raise ValueError(f"layout sp={batch.layout.sp} does not match the group {batch.ranks}")
        check_heads(self.num_heads, batch.layout.ulysses)
        check_group(batch.ranks, self.shard_size)
        group, ring = self.groups.split(batch.ranks, batch.layout.ring)
        last = last if last is not None else batch.last_of_step
        self.grad_sync.begin(last)  # a new step's gradients start at zero
        if last:
            self.grad_sync.arm()
        self.attention.activate(group, batch.cu_seqlens, batch, ring)
        self.recompute.set(batch.layout.recompute)
        probe = None if self.attention_verified else self.attention_probe  # runtime/attention_check.py
        if probe is not None:
            probe.start()
        try:
            yield MicroBatchContext(batch, self.grad_sync, self.seed, self.epoch)
            if probe is not None:
                self.attention_verified = probe.verify(self.adapter.name)
        except torch.OutOfMemoryError as exc:
            if batch.step is None:  # the profiler probes layouts until they fail
                raise
            abort_on_oom(
                exc,
                step=batch.step,
                epoch=self.epoch,
                layout=batch.layout,
                ranks=batch.ranks,
                sample_ids=batch.sample_ids,
                seq_len=batch.seq_len,
            )
        finally:
            if probe is not None:
                probe.remove()
            self.attention.deactivate()
            self.recompute.set(Recompute.none())

    # ------------------------------------------------------------------ per step

    def sync_gradients(self, normalizer: float | None = None) -> float:
        """The step's one reduction: sums gradients, losses and target counts over the world
        in fixed buckets (every rank calls it exactly once per step; buckets the last
        backward already launched are only waited for), divides the gradients by the global
        target count (by ``normalizer`` if given: a fixed constant, as Dr. GRPO's); `gradients`
        reads them (``p.grad``: `GradSync.expose_grads`). Returns the step's mean loss."""
        return self.grad_sync.finish(normalizer)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Global-norm gradient clipping of the synced step, as `torch.nn.utils.clip_grad_norm_`
        does it on a single process: the L2 norm over every trainable parameter's fp32
        gradient (replicated: the synced buffer, the same on every rank, no communication), and every
        gradient scaled by ``max_norm / (norm + 1e-6)`` when that is below 1. Returns the
        pre-clip norm. A non-finite norm scales by nan / 0 as torch does: check the returned
        norm (`math.isfinite`) before ``opt.step()`` to skip such a step. Call after
        `sync_gradients` and before the optimizer's step. Collective with shard_size > 1 (the
        norm summed over the block's shards, norm types 2 and inf) and with the ZeRO-1
        optimizer on several ranks (over the ranks' shards: `runtime.synced_grads`)."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0; got {max_norm!r}")
        if self.shard_size > 1:
            return self.grad_sync.clip_grad_norm_(max_norm, norm_type)
        return synced_grads.clip_grad_norm_(self.grad_sync, max_norm, norm_type)

    def optimizer(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> ZeroAdamW | ShardedAdamW:
        """The default optimizer: AdamW with ZeRO-1 sharded fp32 state (shard_size > 1:
        `runtime.sharded_optim.ShardedAdamW`, state sharded over the world)."""
        self.optimizer_made = True
        if self.shard_size > 1:
            return ShardedAdamW(self.grad_sync, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        return ZeroAdamW(self.grad_sync, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    # ------------------------------------------------------------------ after the sync

    def check_plan(self, plan) -> None:
        """Refuses (ValueError, on every rank alike) a `StepPlan` with an SP group that splits
        a shard block; call before running any of its micro-batches (the loader does, with
        its cluster's shard size)."""
        plan.check_shard_blocks(self.shard_size)

    def gradients(self) -> dict[str, Tensor]:
        """The step's synced gradient of every trainable parameter by name, fp32, without a
        copy: views of the gradient buffer (writing to one changes what the optimizer reads).
        How gradients are read: a bf16 parameter's ``p.grad`` is None once the engine's
        optimizer exists (`GradSync.materialize_grads`). Shard size 1 only (with shard blocks
        a rank holds shards: `full_gradients`)."""
        if self.shard_size > 1:
            raise ValueError(
                f"gradients() returns whole gradients without a copy, which with shard_size="
                f"{self.shard_size} no rank holds; use dc.full_gradients() (collective)"
            )
        if not self.grad_sync.synced:
            raise RuntimeError("gradients needs the step's gradients: call dc.sync_gradients() first")
        if self.grad_sync.sharded:
            raise ValueError(
                "gradients() returns whole gradients without a copy, but with the ZeRO-1 optimizer "
                "each rank holds only its shard's sum; use dc.full_gradients() (collective)"
            )
        return dict(zip(self._param_names(), self.grad_sync.views, strict=True))

    def _param_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def full_gradients(self) -> dict[str, Tensor]:
        """The step's whole gradient of every trainable parameter, by name (fp32 copies).
        Collective with shard_size > 1 (each block all-gathers its shards) and with the ZeRO-1
        optimizer on several ranks (the ranks' shards all-gathered): every rank calls it, after
        `sync_gradients`."""
        if self.shard_size > 1:
            return self.grad_sync.full_gradients()
        return dict(zip(self._param_names(), synced_grads.gathered(self.grad_sync), strict=True))
