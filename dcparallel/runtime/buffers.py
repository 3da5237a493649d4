"""The model's persistent buffers (BatchNorm's running statistics, a step counter, an EMA kept
as a buffer) across ranks: replicated, so every rank must hold the same values.

Every rank trains on its own samples, so a buffer a forward updates from them drifts apart
across ranks, and one checkpointed copy (`runtime.sharded_checkpoint` writes it once) could
not resume the others. Two checks: when the model is wrapped (`Engine`, world > 1), modules
that keep running statistics are refused by name (`refuse_running_stats`); in `prepare` and
before every checkpoint save, the persistent buffers' values are compared across ranks and
the first that differ are named (`check_buffers_agree`). A buffer a forward updates by other
means (a hook, the model's own code) is caught by the second check, at the latest when saved.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dcparallel.runtime import comm


def persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The model's persistent buffers (those its state dict holds) by name: its own tensors."""
    saved = model.state_dict(keep_vars=True).keys()
    return {n: b for n, b in model.named_buffers() if n in saved}


def refuse_running_stats(model: nn.Module) -> None:
    """ValueError naming the modules that update running statistics from each rank's own
    samples (``track_running_stats``: BatchNorm, InstanceNorm with it on) and their buffers,
    with the fix; nothing when there are none."""
    found = {
        name: [f"{name}.{b}" if name else b for b, _ in m.named_buffers(recurse=False)]
        for name, m in model.named_modules()
        if getattr(m, "track_running_stats", False) is True
    }
    if found:
        first = next(iter(found))
        raise ValueError(
            f"{type(model.get_submodule(first)).__name__} {first!r} keeps running statistics "
            f"({', '.join(found[first])}; all such modules: {list(found)[:5]}) that each rank would update "
            f"from its own samples, so they would differ across ranks and no checkpoint could hold them: "
            f"build it with track_running_stats=False (batch statistics), use a norm without running "
            f"statistics (LayerNorm, GroupNorm, RMSNorm), or freeze them as fixed buffers "
            f"(torchvision.ops.FrozenBatchNorm2d)"
        )


def check_buffers_agree(model: nn.Module, what: str, group=comm.WORLD) -> None:
    """ValueError on this rank unless every rank of ``group`` holds the same values in every
    persistent buffer (one object exchange of digests), naming the first that differ, the
    ranks and the fix; ``what``: where it is checked. Nothing to compare without a process
    group."""
    if not comm.is_distributed():
        return
    buffers = persistent_buffers(model)
    mine = {
        n: comm.digest(b.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()) for n, b in buffers.items()
    }
    every = comm.all_gather_object(mine, group)
    differ = [n for n in buffers if len({theirs[n] for theirs in every}) > 1]
    if differ:
        ranks = [r for r, theirs in enumerate(every) if theirs[differ[0]] != mine[differ[0]]]
        raise ValueError(
            f"{what}: the persistent buffer {differ[0]!r} differs across ranks (this rank {comm.world_rank()} "
            f"and ranks {ranks}; all differing: {differ[:5]}): replicated buffers must be identical on "
            f"every rank, or one saved copy resumes the other ranks wrong. Build the same values on every "
            f"rank (one seed, one checkpoint), update it from all-reduced values, or register it with "
            f"persistent=False"
        )
