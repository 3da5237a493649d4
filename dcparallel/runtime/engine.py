"""`DataCentricParallel`: runs this rank's part of a `StepPlan`.

Per micro-batch (`micro_batch`): the batch's SP group drives the model's attention
(Ulysses), recomputation is set per layer from the layout, each sample gets a generator
seeded by (seed, epoch, sample id), and the loss helper returns the shard's summed loss
while counting its targets. Gradients go, as they are accumulated, into one flat fp32
buffer whose last two elements are this rank's summed loss and target count;
`sync_gradients` all-reduces that buffer once over the whole world, on every rank (also
ranks that ran nothing), and divides by the global count. Not DDP: DESIGN "Exact gradient".

    dc = DataCentricParallel(model, layers=model.layers, num_heads=cfg.num_heads)
    opt = dc.optimizer(lr=3e-4)                      # ZeRO-1 AdamW (or any torch.optim)
    for step_batches in loader:                      # this rank's Batches of one step
        for batch in step_batches:
            with dc.micro_batch(batch) as ctx:
                ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
                ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
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

from dcparallel.data.batch import Batch
from dcparallel.runtime import comm
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.ulysses import Kernel, UlyssesAttention, check_heads
from dcparallel.runtime.zero import ZeroAdamW
from dcparallel.spec import ClusterSpec, Recompute


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed, a pure function of (seed, epoch, sample id)."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(sample_id)]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


class _LayerRecompute:
    """Per layer: "none", "attn", "mlp" or "full" (whole layer), read by the patched forwards."""

    def __init__(self, layer: nn.Module, attention: UlyssesAttention):
        self.mode = "none"
        self.attention = attention
        self.has_blocks = hasattr(layer, "attn_block") and hasattr(layer, "mlp_block")
        self._wrap(layer, "full")
        if self.has_blocks:
            self._wrap(layer.attn_block, "attn")
            self._wrap(layer.mlp_block, "mlp")

    def _wrap(self, module: nn.Module, mode: str) -> None:
        inner = module.forward
        attention = self.attention

        def forward(*args, **kwargs):
            if self.mode == mode and torch.is_grad_enabled():
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
        self.dc._stats += torch.stack([loss.detach().double(), w.sum().double()])  # stays on the device
        return loss

    def backward(self, summed_loss: Tensor) -> None:
        """Backward of the shard's summed loss. Every rank of the batch's group must call it
        for the same micro-batch (backward runs the mirrored all-to-alls in that group);
        recomputed forwards get the batch's group back even after the block has exited."""
        summed_loss.backward()


class DataCentricParallel:
    """Wraps a single-device model (it must have ``set_attention``) for data-centric steps.

    ``layers``: the repeated blocks where recomputation applies; each should expose
    ``attn_block`` and ``mlp_block`` (for attention-/MLP-only recompute; without them only
    full recompute is possible). ``num_heads``: attention heads (SP degrees must divide it).
    Trainable parameters are moved into one flat buffer (their storage becomes views of it;
    names and state_dict are unchanged) so the ZeRO-1 optimizer can update a shard and
    all-gather it."""

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Sequence[nn.Module],
        num_heads: int,
        cluster: ClusterSpec | None = None,
        seed: int = 0,
        kernel: Kernel | None = None,
        groups: ProcessGroups | None = None,
    ):
        if not hasattr(model, "set_attention"):
            raise ValueError(
                f"{type(model).__name__} has no set_attention(fn): the runtime installs "
                f"Ulysses attention through it"
            )
        self.model = model
        self.layers = list(layers)
        self.num_heads = num_heads
        self.seed = seed
        self.epoch = 0
        self.groups = groups if groups is not None else ProcessGroups(num_heads, cluster)
        self.rank, self.world_size = comm.world_rank(), comm.world_size()
        self.attention = UlyssesAttention(kernel)
        model.set_attention(self.attention)
        self._recompute = [_LayerRecompute(layer, self.attention) for layer in self.layers]

        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; cast the model to one dtype"
            )
        device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = math.ceil(self.numel / self.world_size)
        padded = self.shard_numel * self.world_size
        self.flat_param = torch.zeros(padded, dtype=self.params[0].dtype, device=device)
        # gradients (fp32) | padding | summed loss | target count
        self.flat_grad = torch.zeros(padded + 2, dtype=torch.float32, device=device)
        self._grad_views: list[Tensor] = []
        off = 0
        for p in self.params:
            n = p.numel()
            self.flat_param[off : off + n].copy_(p.detach().reshape(-1))
            p.data = self.flat_param[off : off + n].view_as(p)
            view = self.flat_grad[off : off + n].view_as(p)
            self._grad_views.append(view)
            p.register_post_accumulate_grad_hook(self._make_hook(view))
            off += n
        # this rank's (summed loss, targets), on the gradients' device: no host sync per micro-batch
        self._stats = torch.zeros(2, dtype=torch.float64, device=self.flat_grad.device)
        self._synced = False
        self.last_loss = float("nan")
        self.last_count = 0.0

    @staticmethod
    def _make_hook(view: Tensor):
        def hook(p: Tensor) -> None:
            view.add_(p.grad)
            p.grad = None

        return hook

    # ------------------------------------------------------------------ per micro-batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def zero_grad(self) -> None:
        """Starts a new step's accumulation (done automatically after `sync_gradients`)."""
        self.flat_grad.zero_()
        self._stats.zero_()
        for p in self.params:
            p.grad = None
        self._synced = False

    def _set_recompute(self, rc: Recompute) -> None:
        for i, state in enumerate(self._recompute):
            attn, mlp = i < rc.attn, i < rc.mlp
            mode = "full" if attn and mlp else "attn" if attn else "mlp" if mlp else "none"
            if mode in ("attn", "mlp") and not state.has_blocks:
                raise ValueError(
                    f"layer {i} has no attn_block / mlp_block, so it cannot recompute "
                    f"{mode} alone ({rc}); expose the sub-blocks or use full recompute"
                )
            state.mode = mode

    @contextlib.contextmanager
    def micro_batch(self, batch: Batch) -> Iterator[MicroBatchContext]:
        """Runs one micro-batch on this rank: activates the batch's SP group in attention and
        the layout's recomputation. Forward and `ctx.backward` both go inside the block."""
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
        self.attention.activate(group, batch.cu_seqlens)
        self._set_recompute(batch.layout.recompute)
        try:
            yield MicroBatchContext(self, batch)
        finally:
            self.attention.deactivate()
            self._set_recompute(Recompute.none())

    # ------------------------------------------------------------------ per step

    def sync_gradients(self) -> float:
        """The step's one collective: sums gradients, losses and target counts over the world
        (every rank calls it exactly once per step), divides the gradients by the global
        target count and exposes them as ``p.grad``. Returns the step's mean loss."""
        if self._synced:  # this rank ran no micro-batch since the last step
            self.zero_grad()
        self.flat_grad[-2:] = self._stats.to(self.flat_grad)
        comm.all_reduce_sum_(self.flat_grad)
        loss_sum, count = self.flat_grad[-2:].tolist()  # one device-to-host read
        if not count > 0:
            raise ValueError(
                f"the step has {count} targets over all ranks: nothing to normalize by; "
                f"check the labels / loss masks"
            )
        self.last_loss = loss_sum / count
        self.last_count = count
        self.flat_grad[:-2].div_(count)
        for p, view in zip(self.params, self._grad_views, strict=True):
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
        self._synced = True
        return self.last_loss

    def optimizer(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> ZeroAdamW:
        """The default optimizer: AdamW with ZeRO-1 sharded fp32 state."""
        return ZeroAdamW(self, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
