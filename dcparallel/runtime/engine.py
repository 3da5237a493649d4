"""`DataCentricParallel`: runs this rank's part of a `StepPlan`.

Per micro-batch (`micro_batch`): the batch's SP group drives the model's attention
(Ulysses), recomputation is set per layer from the layout, each sample gets a generator
seeded by (seed, epoch, sample id), and the loss helper returns the shard's summed loss
while counting its targets. Gradients go, as they are accumulated, into one flat fp32
buffer whose last two elements are this rank's summed loss and target count
(`runtime.grad_sync.GradSync`); its bucketed all-reduce over the whole world starts during
the backward of this rank's last micro-batch of the step (`Batch.last_of_step`, or
``micro_batch(batch, last=True)``) and `sync_gradients` finishes it, on every rank (also
ranks that ran nothing), and divides by the global count. Not DDP: DESIGN "Exact gradient".

    dc = DataCentricParallel(model)                  # the adapter is found from the model
    opt = dc.optimizer(lr=3e-4)                      # ZeRO-1 AdamW (or any torch.optim)
    for step_batches in loader:                      # this rank's Batches of one step
        for batch in step_batches:
            with dc.micro_batch(batch) as ctx:
                ctx.backward(ctx.lm_loss(model(batch.inputs, batch.positions)))
        dc.sync_gradients()                          # every rank, every step
        opt.step()

Wrap the model after moving it to its device and dtype: the trainable parameters become
views of one flat buffer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dcparallel.adapters.base import ModelAdapter
from dcparallel.adapters.find import find_adapter
from dcparallel.data.batch import Batch
from dcparallel.models.llama import per_token_loss
from dcparallel.runtime import comm
from dcparallel.runtime.grad_sync import GradSync
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.launch import abort_on_oom
from dcparallel.runtime.ulysses import Kernel, UlyssesAttention, check_heads
from dcparallel.runtime.zero import ZeroAdamW
from dcparallel.spec import ClusterSpec, Recompute


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed, a pure function of (seed, epoch, sample id)."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(sample_id)]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


class _Recompute:
    """Checkpointing of one module in backward when the micro-batch's mode for its block
    asks for it: a block wrapped as "full", its attention / MLP sub-modules as "attn" / "mlp"."""

    def __init__(self, module: nn.Module, mode: str, attention: UlyssesAttention):
        self.mode, self.active = mode, False
        inner = module.forward

        def forward(*args, **kwargs):
            if self.active and torch.is_grad_enabled():
                # The recomputation runs inside backward; it must see the SP group and
                # documents of this forward even if backward runs after the block exits.
                state = attention.state()

                def rerun(*a, **k):
                    with attention.restored(state):
                        return inner(*a, **k)

                return checkpoint(rerun, *args, use_reentrant=False, **kwargs)
            return inner(*args, **kwargs)

        # An instance attribute: the module's parameters and state_dict keys do not change.
        module.forward = forward


class MicroBatchContext:
    """What the training loop uses inside `DataCentricParallel.micro_batch`."""

    def __init__(self, dc: DataCentricParallel, batch: Batch):
        self.dc, self.batch = dc, batch

    def generator(self, sample_id: int) -> torch.Generator:
        """A generator seeded by (seed, epoch, sample id): every rank of the group draws the
        same noise / timesteps / masks for the sample."""
        if sample_id not in self.batch.sample_ids:
            raise ValueError(f"sample {sample_id} is not in this micro-batch {self.batch.sample_ids}")
        g = torch.Generator(device="cpu")
        g.manual_seed(sample_seed(self.dc.seed, self.dc.epoch, sample_id))
        return g

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
            raise ValueError("dense_loss is for batches every rank of the group holds whole (Batch.sharded False); "
                             "this rank holds a shard of the rows: use token_loss with the batch's loss_mask")
        mask = torch.ones_like(per_position_loss, dtype=torch.bool)
        w = torch.full_like(per_position_loss, 1.0 / self.batch.sp, dtype=torch.float32)
        return self.token_loss(per_position_loss, mask, w)

    def token_loss(
        self, per_token_loss: Tensor, mask: Tensor, sample_weights: Tensor | None = None
    ) -> Tensor:
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
        self.dc.grad_sync.add_stats(loss, w.sum())  # stays on the device
        return loss

    def backward(self, summed_loss: Tensor) -> None:
        """Backward of the shard's summed loss. Every rank of the batch's group must call it
        for the same micro-batch (backward runs the mirrored all-to-alls in that group);
        recomputed forwards get the batch's group back even after the block has exited."""
        summed_loss.backward()


class DataCentricParallel:
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
    ):
        if getattr(model, "_dcparallel_wrapped", False):
            raise ValueError(f"{type(model).__name__} is already wrapped by a DataCentricParallel; wrap a model once")
        self.adapter = adapter or find_adapter(model, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; cast the model to one dtype"
            )
        self.model = model
        self.layers = list(self.adapter.blocks)
        self.num_heads = self.adapter.num_heads
        self.num_kv_heads = self.adapter.num_kv_heads
        self.seed = seed
        self.epoch = 0
        self.groups = groups if groups is not None else ProcessGroups(self.num_heads, cluster)
        self.rank, self.world_size = comm.world_rank(), comm.world_size()
        self.attention = UlyssesAttention(kernel)
        self.adapter.install_attention(self.attention)
        self._hooks = self.adapter.install_hooks(self.attention) if self.adapter.install_hooks else []
        # per block: (its planner layer, its wrappers: full block, attention / MLP sub-modules)
        self._recompute: list[tuple[int, list[_Recompute]]] = []
        for i, block in enumerate(self.layers):
            wraps = [_Recompute(block, "full", self.attention)]
            wraps += [_Recompute(m, "attn", self.attention) for m in self.adapter.attn_modules(block)]
            wraps += [_Recompute(m, "mlp", self.attention) for m in self.adapter.mlp_modules(block)]
            self._recompute.append((self.adapter.layer_of(i), wraps))
        model._dcparallel_wrapped = True

        self.params = params
        device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = math.ceil(self.numel / self.world_size)
        padded = self.shard_numel * self.world_size
        self.flat_param = torch.zeros(padded, dtype=self.params[0].dtype, device=device)
        off = 0
        for p in self.params:
            n = p.numel()
            self.flat_param[off : off + n].copy_(p.detach().reshape(-1))
            p.data = self.flat_param[off : off + n].view_as(p)
            off += n
        self.grad_sync = GradSync(self.params, padded, group=getattr(self.groups, "grad_sync", None))

    # the gradient buffer and the step's statistics live in `grad_sync`
    flat_grad = property(lambda self: self.grad_sync.flat_grad)
    _grad_views = property(lambda self: self.grad_sync.views)
    _stats = property(lambda self: self.grad_sync.stats)
    _synced = property(lambda self: self.grad_sync.synced)
    last_loss = property(lambda self: self.grad_sync.last_loss)
    last_count = property(lambda self: self.grad_sync.last_count)

    # ------------------------------------------------------------------ per micro-batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def zero_grad(self) -> None:
        """Starts a new step's accumulation (done automatically after `sync_gradients`)."""
        self.grad_sync.zero_grad()

    def _set_recompute(self, rc: Recompute) -> None:
        """Layer i (a planner layer: `adapter.blocks_per_layer` blocks) recomputes attention if
        i < rc.attn and its MLP if i < rc.mlp; both = the whole blocks."""
        for layer, wraps in self._recompute:
            attn, mlp = layer < rc.attn, layer < rc.mlp
            mode = "full" if attn and mlp else "attn" if attn else "mlp" if mlp else "none"
            if mode in ("attn", "mlp") and not any(w.mode == mode for w in wraps):
                raise ValueError(f"{self.adapter.name}'s blocks expose no {mode} sub-module, so layer {layer} cannot "
                                 f"recompute {mode} alone ({rc}); use full recompute, or give the adapter "
                                 f"attn_modules and mlp_modules")
            for w in wraps:
                w.active = w.mode == mode

    def recompute_modes(self) -> list[str]:
        """The mode of every block right now ("none", "attn", "mlp", "full")."""
        return [next((w.mode for w in wraps if w.active), "none") for _, wraps in self._recompute]

    @contextlib.contextmanager
    def micro_batch(self, batch: Batch, last: bool | None = None) -> Iterator[MicroBatchContext]:
        """Runs one micro-batch on this rank: activates the batch's SP group in attention and
        the layout's recomputation. Forward and `ctx.backward` both go inside the block.
        ``last``: this is the rank's last micro-batch of the step, so its backward overlaps
        the gradient sync (default: ``batch.last_of_step``, set by the loader; None: no
        overlap). An out-of-memory error in a micro-batch of a loader step ends every rank
        (`runtime.launch.abort_on_oom`) instead of leaving its SP group waiting."""
        if self.rank not in batch.ranks:
            raise ValueError(
                f"rank {self.rank} got a batch for group {batch.ranks}; the loader must hand "
                f"each rank only the micro-batches of its own group"
            )
        if batch.layout.sp != len(batch.ranks):
            raise ValueError(f"layout sp={batch.layout.sp} does not match the group {batch.ranks}")
        check_heads(self.num_heads, batch.sp)
        group = self.groups.group(batch.ranks)
        if self._synced:
            self.zero_grad()
        if last if last is not None else getattr(batch, "last_of_step", None):
            self.grad_sync.arm()
        self.attention.activate(group, batch.cu_seqlens, batch)
        self._set_recompute(batch.layout.recompute)
        try:
            yield MicroBatchContext(self, batch)
        except torch.OutOfMemoryError as exc:
            if getattr(batch, "step", None) is None:  # the profiler probes layouts until they fail
                raise
            abort_on_oom(exc, step=batch.step, epoch=self.epoch, layout=batch.layout, ranks=batch.ranks,
                         sample_ids=batch.sample_ids, seq_len=batch.seq_len)
        finally:
            self.attention.deactivate()
            self._set_recompute(Recompute.none())

    # ------------------------------------------------------------------ per step

    def sync_gradients(self) -> float:
        """The step's one reduction: sums gradients, losses and target counts over the world
        in fixed buckets (every rank calls it exactly once per step; buckets the last
        backward already launched are only waited for), divides the gradients by the global
        target count and exposes them as ``p.grad``. Returns the step's mean loss."""
        return self.grad_sync.finish()

    def optimizer(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> ZeroAdamW:
        """The default optimizer: AdamW with ZeRO-1 sharded fp32 state."""
        return ZeroAdamW(self, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
