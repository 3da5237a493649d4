"""Models adapted by PEFT: seen through to the model the family adapters drive.

A ``PeftModel`` (``peft.get_peft_model``) wraps its base model; a diffusers model given LoRA
by ``add_adapter`` holds PEFT's layers in place. Either way the base model's blocks, attention
modules and config are unchanged (PEFT replaces linear and embedding layers by layers that add
the adapter's term to the base layer's output, token by token), so the family adapter of the
base model drives it: the runtime installs its attention in the same modules, and the engine's
check that every block calls it (`runtime.attention_check`) runs as for the bare model. The
wrapper itself is what the loss function calls: ``PeftModel.forward`` passes its arguments to
the base model. The frozen base is no concern of the adapter: the engine trains the parameters
with ``requires_grad`` (`runtime.engine`).

Handled exactly (parity tests: tests/dist/test_dist_lora.py): LoRA on linear layers, on
embeddings, and with weight decomposition (DoRA), any rank / alpha / rsLoRA scaling, with
``modules_to_save``. Refused, naming the adapter type: every other PEFT method (prompt
learning adds virtual tokens to each sequence, which would change the samples' lengths the
plans are made of; the others are not tested here), and LoRA's ``layer_replication`` (it
repeats blocks that then share weights). LoRA dropout draws its masks from each rank's own
generator: the gradient is exact for the masks drawn, which differ from a single process's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: PEFT methods whose adapted layers are tested to train exactly (tests/dist/test_dist_lora.py)
SUPPORTED = ("LORA",)


def is_peft_model(model: nn.Module) -> bool:
    """A ``peft.PeftModel`` (any task type), without importing peft unless the type is PEFT's."""
    if not type(model).__module__.startswith("peft."):
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _type_name(config: Any) -> str:
    t = getattr(config, "peft_type", None)
    return str(getattr(t, "value", t))


def check_configs(model: nn.Module) -> None:
    """Refuses a PEFT adapter the runtime does not train exactly (module docstring), naming
    the adapter, its type and the fix. ``model``: a ``PeftModel`` or a model whose layers PEFT
    adapted in place (``peft_config``: adapter name -> config)."""
    configs = getattr(model, "peft_config", None) or {}
    for name, cfg in configs.items():
        kind = _type_name(cfg)
        if kind not in SUPPORTED:
            why = (
                "prompt learning adds virtual tokens to every sequence, so a sample's length would not be the "
                "one it was planned with"
                if getattr(cfg, "is_prompt_learning", False)
                else "only LoRA (linear layers, embeddings, DoRA) is tested to train exactly"
            )
            raise ValueError(
                f"PEFT adapter {name!r} is of type {kind}, which dcparallel does not train: {why}; "
                f"use a LoraConfig (use_dora=True for DoRA)"
            )
        if getattr(cfg, "layer_replication", None):
            raise ValueError(
                f"PEFT adapter {name!r} sets layer_replication={cfg.layer_replication!r}: its repeated "
                f"blocks share weights, which the block-wise runtime does not handle; train without "
                f"layer_replication"
            )


def base_model(model: nn.Module) -> nn.Module:
    """The model the family adapters drive: a ``PeftModel``'s base model (after checking its
    adapters), else ``model`` itself (its in-place PEFT layers, if any, checked)."""
    check_configs(model)
    if is_peft_model(model):
        return model.get_base_model()
    return model
