"""The one home of fallbacks between torch releases (the floor is pyproject's ``torch>=``).

A name newer than the oldest supported release is reached only here, behind a ``hasattr``,
so tests/unit/test_torch_floor.py can hold the rest of the package to the floor's API.
It also holds the one way past a torch wrapper's cost that the package takes
(`unless_compiling`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

F = TypeVar("F", bound=Callable)


def all_gather_into_tensor(out, t, group) -> None:
    """All-gather equal 1-D ``t`` of every rank of ``group`` into ``out``, in rank order.
    Releases that have ``all_gather_single`` deprecate ``all_gather_into_tensor`` (a
    FutureWarning per call site); older ones have only the latter, the same collective."""
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single(out, t, group=group)
    else:
        dist.all_gather_into_tensor(out, t, group=group)


def efficient_attention_ops() -> tuple[object, object] | None:
    """torch's memory-efficient attention and its backward as aten ops (forward returns the
    log-sum-exp on request, backward takes an output and log-sum-exp of the caller's): private
    names, so reached only here; None where this build lacks them."""
    aten = torch.ops.aten
    if not (
        hasattr(aten, "_scaled_dot_product_efficient_attention")
        and hasattr(aten, "_scaled_dot_product_efficient_attention_backward")
    ):
        return None
    return aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward


def unless_compiling(fn: F) -> F:
    """``fn``, a torch function wrapped by torch's ``_disable_dynamo`` (`Optimizer.add_param_group`),
    without that wrapper while ``torch._dynamo`` is not imported. The wrapper imports
    torch._dynamo on its first call (0.9 processor seconds on a 2-core EPYC, 2 where FSDP and
    DTensor are not imported yet: it imports them) only to keep the compiler out of ``fn``; no
    frame is compiled before torch._dynamo is imported, so there the unwrapped function does
    the same. Once it is imported, ``fn`` as torch wrote it. (`torch.utils.checkpoint` reads
    torch._dynamo's config inside: recompute imports it anyway.)"""
    if "torch._dynamo" in sys.modules:
        return fn
    return getattr(fn, "__wrapped__", fn)
