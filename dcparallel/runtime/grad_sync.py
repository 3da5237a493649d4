"""The flat parameter and gradient buffers, and the step's gradient sync over the gradient buffer.

The sync: one fp32 buffer, summed over the ranks in fixed buckets, overlapped with the last
backward; all-reduced, or, under ZeRO-1, each bucket reduced to the one rank whose shard it is.

``flat_param``: the trainable parameters (in parameter order, their dtype), padded to a
multiple of the world size; each parameter's storage becomes a view of it (names and
state_dict are unchanged), so the ZeRO-1 optimizer (`runtime.zero`) updates a shard of it
and all-gathers.

Layout of ``flat_grad``: the trainable parameters' gradients (in parameter order) | padding
to a multiple of the world size | this rank's summed loss | its target count. Each
parameter's post-accumulate-grad hook adds its gradient into its view of the buffer, so the
buffer accumulates over any number of micro-batches (so it is held whole on every rank, also
under ZeRO-1: a micro-batch's gradient reaches every element).

Buckets: fixed-size element ranges of the whole buffer (by default
`cost.overlap.default_bucket_bytes`: at least 25 MiB, at most 64 buckets, larger as the world
grows so the ring latency each collective pays stays small), taken from its end (the last
parameters get their gradients first in backward), so bucket 0 holds the loss and the count.
Replicated (a torch optimizer reading ``p.grad``), each bucket is all-reduced. Sharded
(`set_sharded`, turned on by `runtime.zero.ZeroAdamW` with several ranks: its step reads only
elements ``[r S, (r + 1) S)`` of rank r): bucket 0 is the two statistics slots alone
(all-reduced: every rank needs the loss and the count), then each shard is cut from its end,
the last shard first, so every bucket lies in one rank's shard and is reduced (summed) into
that rank alone. Each rank receives 4 S bytes of gradient instead of the whole buffer: the
step's reductions together are a reduce-scatter of the buffer along the optimizer's shards,
split into buckets that keep the backward order. (One reduce-scatter per bucket would need
every rank's piece in each bucket: with contiguous shards the first bucket would then wait
for the first shard's parameters, the last ones backward reaches, and nothing would overlap.)
The other shards' elements are left unspecified on this rank: ``p.grad`` is None after a
sharded sync, and `runtime.synced_grads` reads (all-gathers) and clips the shards.

Every rank has the same buckets and launches them in the same order on a process group used
for nothing else (``group``): a bucket's asynchronous collective starts when it and every
bucket before it are final. They are final only during this rank's last micro-batch of the
step (`arm` is called when it begins): a bucket is launched as soon as every parameter
touching it is final: its hook has run in that backward, or that backward cannot reach it
(`skip_unreached`: an expert no token of the micro-batch was routed to adds nothing, so it
must not hold back its bucket and every bucket after it). `finish` launches what is left
(all of it on a rank that ran no micro-batch, or when the last micro-batch was not
announced), waits, and divides by the global target count.

Exactness: each element is summed over the ranks by one collective, as one unbucketed call
would sum it, so with two ranks (a + b = b + a) the result is bitwise the same, and the same
as an all-reduce's; with more ranks the order of additions for an element can depend on its
position in the message and on the collective, so bucketing or reducing may change the
result by fp32 rounding (tests: bitwise at world 2, <= 1e-6 relative at world 4).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dcparallel.cost.overlap import default_bucket_bytes
from dcparallel.runtime import comm


class GradSync:
    """Owns ``flat_param`` and ``flat_grad``, the per-parameter views and hooks, the loss /
    target statistics and the bucketed sum over the ranks (all-reduce, or reduce to each
    shard's owner when ``sharded``). Rank ``rank`` of ``world_size`` owns
    elements ``[rank * shard_numel, (rank + 1) * shard_numel)`` of the flat parameters.
    ``bucket_bytes``: fp32 bytes per bucket (0: one bucket for the whole buffer; None: chosen
    from the buffer's size and the world's, `cost.overlap.default_bucket_bytes`). ``overlap``:
    launch buckets during the last backward (False: all in `finish`).

    Read by the micro-batch context and the optimizer: ``params``, ``numel``, ``shard_numel``,
    ``rank``, ``flat_param``, ``flat_grad``, ``views``, ``stats`` (this rank's summed loss and
    targets of the step), ``synced`` (the step's sync is done), `add_stats`, `begin`, `zero_grad`.
    ``materialize_grads``: low-precision parameters get ``p.grad`` copies after the sync
    (`expose_grads`)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        world_size: int = 1,
        rank: int = 0,
        group=None,
        bucket_bytes: int | None = None,
        overlap: bool = True,
    ):
        self.params = list(params)
        device = self.params[0].device
        self.rank, self.world_size = rank, world_size
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = math.ceil(self.numel / world_size)
        padded_numel = self.shard_numel * world_size
        self.flat_param = torch.zeros(padded_numel, dtype=self.params[0].dtype, device=device)
        off = 0
        for p in self.params:
            n = p.numel()
            self.flat_param[off : off + n].copy_(p.detach().reshape(-1))
            p.data = self.flat_param[off : off + n].view_as(p)
            off += n
        self.group = group
        self.overlap = overlap
        self.flat_grad = torch.zeros(padded_numel + 2, dtype=torch.float32, device=device)
        self.views: list[Tensor] = []
        self._ranges: list[tuple[int, int]] = []
        off = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            view = self.flat_grad[off : off + n].view_as(p)
            self.views.append(view)
            self._ranges.append((off, off + n))
            p.register_post_accumulate_grad_hook(self._make_hook(i, view))
            off += n
        # this rank's (summed loss, targets), on the gradients' device: no host sync per micro-batch
        self.stats = torch.zeros(2, dtype=torch.float64, device=device)
        self.synced = False
        # low-precision parameters get a p.grad copy of their fp32 gradient after the sync
        # (2 bytes a parameter for bf16); `ZeroAdamW` reads the buffer and turns this off
        self.materialize_grads = True
        self.last_loss = float("nan")
        self.last_count = 0.0
        self.last_overlapped = 0
        self._armed = False
        self._final = [False] * len(self.params)  # armed: parameter i is final for the step
        self._walked = False  # armed: the last backward's graph was searched (`skip_unreached`)
        self._unreached: set[int] = set()  # armed: parameters that search found unreached
        self._next = 0  # buckets [0, _next) are launched
        self._works: list = []
        self.sharded = False  # `set_sharded`: each rank receives only its shard's sum
        self.set_bucket_bytes(bucket_bytes)

    # ------------------------------------------------------------------ buckets

    def set_bucket_bytes(self, bucket_bytes: int | None) -> None:
        """Re-cuts the buckets (only between steps; every rank must use the same size). None:
        the default for this buffer and world (`cost.overlap.default_bucket_bytes`)."""
        total = self.flat_grad.numel()
        if bucket_bytes is None:
            bucket_bytes = default_bucket_bytes(4 * total, self.world_size)
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0 (0: one bucket); got {bucket_bytes}")
        assert not self._works and not self._armed, "re-bucketing in the middle of a step"
        size = total if bucket_bytes == 0 else max(1, bucket_bytes // 4)
        self.bucket_bytes = bucket_bytes
        cut = self._cut(size)
        self.buckets: list[tuple[int, int]] = [(lo, hi) for lo, hi, _ in cut]
        self.bucket_owners: list[int | None] = [owner for _, _, owner in cut]  # None: all-reduced
        # the buckets tile [0, total) from its end: the bucket of an element by the starts
        starts = [lo for lo, _ in reversed(self.buckets)]
        last = len(self.buckets) - 1
        self._param_buckets: list[tuple[int, ...]] = []
        counts = [0] * len(self.buckets)
        for lo, hi in self._ranges:
            ks = (
                tuple(range(last - bisect_right(starts, hi - 1) + 1, last - bisect_right(starts, lo) + 2))
                if hi > lo
                else ()
            )
            for k in ks:
                counts[k] += 1
            self._param_buckets.append(ks)
        self._num_params_in = counts
        self._pending = list(counts)

    def _cut(self, size: int) -> list[tuple[int, int, int | None]]:
        """The buckets ``(lo, hi, owner)`` in launch order, from the buffer's end. Owner None:
        all-reduced. Sharded (`set_sharded`): the statistics' two slots first (all-reduced),
        then each rank's shard from its end, the last shard first, cut in ``size`` pieces, each
        reduced to the rank that owns it."""
        total = self.flat_grad.numel()
        if not self.sharded:
            return [(max(0, hi - size), hi, None) for hi in range(total, 0, -size)]
        s = self.shard_numel
        out: list[tuple[int, int, int | None]] = [(total - 2, total, None)]
        for r in reversed(range(self.world_size)):
            out += [(max(r * s, hi - size), hi, r) for hi in range((r + 1) * s, r * s, -size)]
        return out

    def set_sharded(self, sharded: bool) -> None:
        """ZeRO-1 (`runtime.zero.ZeroAdamW`) reads only this rank's shard: with ``sharded``
        (and more than one rank) each bucket lies in one rank's shard and is reduced to that
        rank alone; the others' shards are not summed here (``p.grad`` is None after the sync,
        `runtime.synced_grads.gathered` gathers them). Between steps only."""
        self.sharded = bool(sharded) and self.world_size > 1
        self.set_bucket_bytes(self.bucket_bytes)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)

    def _launch(self, k: int) -> None:
        if k == 0:  # bucket 0 holds the loss and the count: final once the last backward runs
            self.flat_grad[-2:] = self.stats.to(self.flat_grad)
        (lo, hi), owner = self.buckets[k], self.bucket_owners[k]
        part = self.flat_grad[lo:hi]
        self._works.append(
            comm.all_reduce_sum_async(part, self.group)
            if owner is None
            else comm.reduce_sum_async(part, owner, self.group)
        )
        self._next = k + 1

    def _set_final(self, i: int) -> None:
        """Parameter i adds nothing more this step: its buckets wait for one parameter less."""
        if not self._final[i]:
            self._final[i] = True
            for k in self._param_buckets[i]:
                self._pending[k] -= 1

    def _make_hook(self, i: int, view: Tensor):
        def hook(p: Tensor) -> None:
            ks = self._param_buckets[i]
            if ks and ks[0] < self._next:
                why = (
                    "the last backward's graph did not reach it (a parameter used through a function that "
                    "hides it from autograd's graph, such as reentrant checkpointing: call loss.backward() "
                    "yourself in the last micro-batch)"
                    if i in self._unreached
                    else "the step's last micro-batch must run exactly one backward (call ctx.backward once, "
                    "or pass last=False to micro_batch)"
                )
                raise RuntimeError(
                    f"a gradient of parameter {i} {tuple(p.shape)} arrived after its bucket's "
                    f"all-reduce was launched: {why}"
                )
            view.add_(p.grad)
            p.grad = None
            if self._armed:
                self._set_final(i)
                self._launch_ready()

        return hook

    def skip_unreached(self, loss: Tensor) -> None:
        """The armed micro-batch's one backward, of ``loss``, is about to run: the trainable
        parameters its autograd graph does not reach get no hook in it, so they are final now
        (their gradient of this micro-batch is zero; earlier micro-batches' are in the buffer),
        and the buckets this completes are launched. Every rank still launches every bucket in
        the same order: only the moment differs. Searches the graph once, on the armed
        micro-batch only; a backward run outside `MicroBatchContext.backward` leaves the
        unreached parameters' buckets to `finish`."""
        if not self._armed or self._walked or self._next > 0:
            return
        self._walked = True
        reached = reached_leaves(loss)
        if reached is None:
            return
        for i, p in enumerate(self.params):
            if id(p) not in reached:
                self._unreached.add(i)
                self._set_final(i)
        self._launch_ready()

    # ------------------------------------------------------------------ per step

    def add_stats(self, loss_sum: Tensor, count: Tensor) -> None:
        """Adds a micro-batch's summed loss and target count (device tensors) to the step's."""
        if self._next > 0:
            raise RuntimeError(
                "a loss was counted after the step's gradient sync began; count every "
                "loss of the step (ctx.token_loss) before the last micro-batch's backward"
            )
        self.stats += torch.stack([loss_sum.detach().double(), count.detach().double()])

    def begin(self, last: bool | None = None) -> None:
        """A micro-batch starts: the first after `finish` starts a new step (`zero_grad`).
        ``last`` (whether it is the step's last here) is for `ShardedGrads.begin`."""
        if self.synced:
            self.check_params_in_buffer()
            self.zero_grad()

    def check_params_in_buffer(self) -> None:
        """Every parameter must still be a view of ``flat_param``: ``model.to(...)``, ``.cuda()``
        or ``.half()`` after wrapping gives it new storage, and the optimizer would then update
        a buffer the model no longer reads — silently. A RuntimeError naming the fix instead."""
        base = self.flat_param.untyped_storage().data_ptr()
        for i, p in enumerate(self.params):
            if p.untyped_storage().data_ptr() != base:
                raise RuntimeError(
                    f"parameter {i} (shape {tuple(p.shape)}, {p.dtype} on {p.device}) no longer lives in dcparallel's "
                    f"flat buffer ({self.flat_param.dtype} on {self.flat_param.device}): the model was moved or cast "
                    f"after DataCentricParallel(model) (model.to / .cuda / .half), so the optimizer would update a "
                    f"copy the model does not read. Move and cast the model before wrapping it"
                )

    def arm(self) -> None:
        """This rank's last micro-batch of the step begins: its backward launches each bucket
        once it is final (no bucket goes out before that backward begins)."""
        if self.synced:
            self.zero_grad()
        if not self.overlap or self._armed:
            return
        self._pending = list(self._num_params_in)
        self._final = [False] * len(self.params)
        self._walked = False
        self._unreached = set()
        self._armed = True

    def zero_grad(self) -> None:
        """Starts a new step's accumulation: gradients, statistics and buckets cleared."""
        self._wait()
        self.flat_grad.zero_()
        self.stats.zero_()
        for p in self.params:
            p.grad = None
        self._armed = False
        self._next = 0
        self.synced = False

    def _wait(self) -> None:
        for w in self._works:
            comm.wait(w)
        self._works = []

    def finish(self, normalizer: float | None = None) -> float:
        """Launches the buckets not yet launched (in order), waits for all, divides by the
        global target count (or by ``normalizer``, a fixed constant) and exposes the gradients
        (`expose_grads`). Returns the mean loss."""
        if self.synced:  # this rank ran no micro-batch since the last step
            self.zero_grad()
        self.last_overlapped = self._next  # buckets the last backward launched
        while self._next < len(self.buckets):
            self._launch(self._next)
        self._wait()
        self._armed = False
        loss_sum, count = self.flat_grad[-2:].tolist()  # one device-to-host read
        if not count > 0:
            raise ValueError(
                f"the step has {count} targets over all ranks: nothing to normalize by; check the labels / loss masks"
            )
        divisor = count if normalizer is None else check_normalizer(normalizer)
        self.last_loss = loss_sum / divisor
        self.last_count = count
        self.owned_grad().div_(divisor)
        self.expose_grads()
        self.synced = True
        return self.last_loss

    def owned_grad(self) -> Tensor:
        """The part of the gradient buffer the sync sums on this rank: its shard when
        ``sharded``, else every gradient (and the padding)."""
        if self.sharded:
            return self.flat_grad[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
        return self.flat_grad[:-2]

    def expose_grads(self) -> None:
        """Sets each ``p.grad`` to the synced gradient: fp32 parameters get their view of the
        buffer itself; lower-precision ones a copy in their dtype if ``materialize_grads``
        (for an optimizer outside the engine, which reads ``p.grad``), else None. A copy
        already there is refreshed in place. None for every parameter when ``sharded``: no
        rank holds whole gradients (`runtime.synced_grads.gathered`)."""
        for p, view in zip(self.params, self.views, strict=True):
            if self.sharded:
                p.grad = None
            elif view.dtype == p.dtype:
                p.grad = view
            elif not self.materialize_grads:
                p.grad = None
            elif p.grad is not None and p.grad.shape == view.shape and p.grad.dtype == p.dtype:
                p.grad.copy_(view)
            else:
                p.grad = view.to(p.dtype)


#: autograd nodes that run a backward of their own over parameters their graph does not show
_OPAQUE_NODES = ("CheckpointFunctionBackward",)


def check_normalizer(normalizer: float) -> float:
    """A fixed divisor of the step's summed gradients (Dr. GRPO's constant): a positive number."""
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)) or not normalizer > 0:
        raise ValueError(
            f"normalizer={normalizer!r}: give a positive number to divide the step's summed loss "
            f"and gradients by (None: the step's global target count)"
        )
    return float(normalizer)


def reached_leaves(loss: Tensor) -> set[int] | None:
    """The ids of the leaf tensors (parameters) whose AccumulateGrad node ``loss``'s backward
    graph reaches, as DDP's find_unused_parameters searches it; None when the graph holds a
    node that may reach parameters it does not show (reentrant checkpointing)."""
    leaves: set[int] = set()
    seen: set = set()  # the nodes themselves: holding them keeps their Python wrappers (and ids) alive
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ in _OPAQUE_NODES:
            return None
        var = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if var is not None:
            leaves.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return leaves
