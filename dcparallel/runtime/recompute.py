"""Recomputation per micro-batch: checkpoint wrappers on a model's blocks, switched by a layout's `Recompute`."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dcparallel.adapters.base import ModelAdapter
from dcparallel.runtime.ulysses import UlyssesAttention
from dcparallel.spec import Recompute


class Checkpointed:
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


class LayerRecompute:
    """The checkpoint wrappers of every block of an adapted model, and which are active.

    ``blocks``: per block of ``adapter.blocks``, (its planner layer, its wrappers: the full
    block, then its attention / MLP sub-modules). Recompute counts are planner layers: layer
    i is blocks ``i * blocks_per_layer ...`` of the adapter."""

    def __init__(self, adapter: ModelAdapter, attention: UlyssesAttention):
        self.adapter_name = adapter.name
        self.blocks: list[tuple[int, list[Checkpointed]]] = []
        for i, block in enumerate(adapter.blocks):
            wraps = [Checkpointed(block, "full", attention)]
            wraps += [Checkpointed(m, "attn", attention) for m in adapter.attn_modules(block)]
            wraps += [Checkpointed(m, "mlp", attention) for m in adapter.mlp_modules(block)]
            self.blocks.append((adapter.layer_of(i), wraps))

    def set(self, rc: Recompute) -> None:
        """Layer i (a planner layer: `adapter.blocks_per_layer` blocks) recomputes attention if
        i < rc.attn and its MLP if i < rc.mlp; both = the whole blocks."""
        for layer, wraps in self.blocks:
            attn, mlp = layer < rc.attn, layer < rc.mlp
            mode = "full" if attn and mlp else "attn" if attn else "mlp" if mlp else "none"
            if mode in ("attn", "mlp") and not any(w.mode == mode for w in wraps):
                raise ValueError(
                    f"{self.adapter_name}'s blocks expose no {mode} sub-module, so layer {layer} cannot "
                    f"recompute {mode} alone ({rc}); use full recompute, or give the adapter "
                    f"attn_modules and mlp_modules"
                )
            for w in wraps:
                w.active = w.mode == mode

    def modes(self) -> list[str]:
        """The mode of every block right now ("none", "attn", "mlp", "full")."""
        return [next((w.mode for w in wraps if w.active), "none") for _, wraps in self.blocks]
