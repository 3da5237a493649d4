"""Proof that the attention dcparallel installed runs in every block.

An adapter installs the runtime's attention into the model's blocks; a block that mixes
tokens another way (an attention module that calls its kernel itself, a linear-attention
layer that keeps an attention's name) would never call it, and would silently attend over
the rank's shard only and across packed documents. The engine installs `AttentionProbe`, a
stand-in that forwards every call (and attribute) to the real attention. Until one forward
has run every block, each micro-batch arms it (`start`): forward hooks on the blocks tell it
which block is running and it records the blocks that called it (or read its micro-batch
state, as an attention that runs Ulysses itself does). `finish` removes the hooks
and raises for a block that ran without calling it; once every block was seen calling it,
it is never armed again, and a call costs one Python frame more than the bare attention.
A block the profiler passes through (``forward.skips_block``) is not judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn


class AttentionProbe:
    """The runtime attention, recording which blocks call it (see the module docstring)."""

    def __init__(self, attention: Any, blocks: Sequence[nn.Module]):
        object.__setattr__(self, "_attention", attention)
        self._blocks = list(blocks)
        self._stack: list[int] = []
        self.ran: set[int] = set()
        self.called: set[int] = set()
        self._handles: list[Any] = []

    def start(self) -> None:
        """Arms the probe for one micro-batch: block hooks on, records cleared."""
        self.remove()
        self._stack, self.ran, self.called = [], set(), set()
        for i, b in enumerate(self._blocks):
            self._handles.append(b.register_forward_pre_hook(self._enter(i)))
            self._handles.append(b.register_forward_hook(self._leave))

    def _enter(self, i: int):
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(i)
            # the profiler runs a stack of the first layers, passing the others through
            if not getattr(module.__dict__.get("forward"), "skips_block", False):
                self.ran.add(i)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._stack:
            self.called.add(self._stack[-1])
        return self._attention(*args, **kwargs)

    def state(self) -> Any:
        """The real attention's micro-batch state. An attention that runs Ulysses itself from
        it (a joint text + image attention reading the group) counts as a call."""
        if self._stack:
            self.called.add(self._stack[-1])
        return self._attention.state()

    def __getattr__(self, name: str) -> Any:  # longest_document, ... of the real attention
        return getattr(self._attention, name)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack = []

    def verify(self, model_name: str) -> bool:
        """True when the forward ran every block and each called the attention; False when no
        block ran (nothing to judge yet); raises when a block ran without calling it."""
        if not self.ran:
            return False
        missing = [i for i in range(len(self._blocks)) if i in self.ran and i not in self.called]
        if missing:
            i = missing[0]
            raise RuntimeError(
                f"{model_name}: block {i} ({type(self._blocks[i]).__name__}) ran without calling the "
                f"attention dcparallel installed (blocks {missing} of {len(self._blocks)}); it mixes "
                f"tokens some other way, which under sequence parallelism sees only its rank's "
                f"shard and, packed, attends across documents. Refusing to train it: give the "
                f"adapter the block's real attention (attn_modules=) or use a model whose every "
                f"block attends through the installed attention"
            )
        return len(self.ran) == len(self._blocks)
