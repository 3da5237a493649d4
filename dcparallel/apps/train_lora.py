"""`dcparallel train`'s ``[lora]`` section: LoRA adapters through PEFT on the run's model, and
their export.

Config (every key optional)::

    [lora]
    rank = 0                # LoRA rank; 0: no LoRA (every parameter trains)
    alpha = 0.0             # scaling alpha / rank; 0: alpha = rank
    target_modules = []     # module names to adapt; []: the attention projections
                            # (transformers: q/k/v/o_proj; diffusers: to_q/to_k/to_v/to_out.0)
    dropout = 0.0           # LoRA dropout (each rank draws its own masks)
    use_dora = false        # weight-decomposed LoRA (DoRA)
    export_merged = false   # also export the base with the adapters merged in (export_dir/merged)

With ``rank`` > 0 the loaded model is wrapped by ``peft.get_peft_model`` (transformers and
diffusers alike) before the engine wraps it: the base is frozen, the adapters (fp32 on a bf16
base: PEFT's adapter dtype autocast) are the only parameters the gradient sync, the optimizer
and the checkpoints' optimizer state hold. The export is the PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``, what ``PeftModel.save_pretrained``
writes and ``PeftModel.from_pretrained`` loads) in the export directory, with the tokenizer;
``export_merged`` adds the merged model (``merge_and_unload`` + ``save_pretrained``) under
``merged/``. With shard_size > 1 both are made from the gathered full state dict on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a model is adapted: `simulate` and `plan` import this module
    import torch
    from torch import nn

#: the attention projections adapted when target_modules is empty, per family
DEFAULT_TARGETS = {
    "transformers": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "diffusers": ["to_q", "to_k", "to_v", "to_out.0"],
}


def _opt(default: Any, **meta: Any) -> Any:
    return field(default=default, metadata={"lo": None, "gt": None, "choices": (), "resume": True, **meta})


@dataclass(kw_only=True)
class LoraConfig:
    """The ``[lora]`` section (module docstring); validated with the other sections."""

    rank: int = _opt(0, lo=0)
    alpha: float = _opt(0.0, lo=0)
    target_modules: list | tuple = _opt(())  # TOML gives a list
    dropout: float = _opt(0.0, lo=0)
    use_dora: bool = _opt(False)
    export_merged: bool = _opt(False, resume=False)

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, tuple):  # a list, as a checkpoint's saved config reads back
            self.target_modules = list(self.target_modules)

    def check(self, where: str) -> None:
        if not isinstance(self.target_modules, (list, tuple)) or not all(
            isinstance(t, str) and t for t in self.target_modules
        ):
            raise ValueError(
                f"{where}: [lora] target_modules = {self.target_modules!r} must be a list of module "
                f'names, e.g. ["q_proj", "v_proj"]'
            )
        if not self.dropout < 1:
            raise ValueError(f"{where}: [lora] dropout = {self.dropout} must be < 1 (e.g. 0.05)")
        if not self.rank and (self.target_modules or self.use_dora or self.export_merged):
            raise ValueError(f"{where}: [lora] sets options but rank = 0 (no LoRA); set rank (e.g. 16)")

    def check_family(self, where: str, family: str) -> None:
        if self.rank and family == "reference":
            raise ValueError(
                f"{where}: [lora] rank = {self.rank} needs a transformers or diffusers model ([model] "
                f"pretrained or family); the reference model trains without LoRA"
            )


def apply_lora(model: nn.Module, lora: LoraConfig, family: str, seed: int = 0) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with the section's adapters (``rank`` > 0),
    else ``model``; a target module the model lacks is PEFT's ValueError, naming it. The
    adapters' random initialization draws from ``seed``, so every rank builds the same ones
    (replicas that started apart would train on different weights)."""
    if not lora.rank:
        return model
    try:
        from peft import LoraConfig as PeftLora
        from peft import get_peft_model
    except ImportError:
        raise ValueError("[lora] rank > 0 needs the peft package: pip install 'dcparallel[lora]'") from None
    targets = list(lora.target_modules) or DEFAULT_TARGETS[family]
    config = PeftLora(
        r=lora.rank,
        lora_alpha=lora.alpha or lora.rank,
        target_modules=targets,
        lora_dropout=lora.dropout,
        use_dora=lora.use_dora,
    )
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    from dcparallel.adapters.peft import is_peft_model

    return is_peft_model(model)


def write_lora_export(
    model: nn.Module,
    path: Path,
    tokenizer: Any = None,
    state: dict[str, torch.Tensor] | None = None,
    merged: bool = False,
) -> None:
    """The PEFT adapter folder of ``model`` (a ``PeftModel``) at ``path`` (+ tokenizer), and with
    ``merged`` the merged model at ``path / "merged"`` (one process). ``state``: the model's full
    state dict (gathered from shards), else the model's own."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = state if state is not None else model.state_dict()
    adapters = get_peft_model_state_dict(model, state_dict=state)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in adapters.items()}, path / "adapter_model.safetensors")
    config = model.peft_config["default"]
    config.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if merged:
        _merged(model, state).save_pretrained(path / "merged")
        if tokenizer is not None:
            tokenizer.save_pretrained(path / "merged")


def _merged(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU copy of ``model``'s base with the adapters of ``state`` merged into its weights."""
    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FSDPModule

    base = model.get_base_model()
    cls = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        shell = cls._from_config(base.config) if hasattr(cls, "_from_config") else cls.from_config(base.config)
    peft = get_peft_model(shell, model.peft_config["default"])
    peft.load_state_dict({k: v.detach().cpu().clone() for k, v in state.items()}, strict=False, assign=True)
    for n, b in list(peft.named_buffers()):  # non-persistent buffers (rotary tables): the model's own
        if b.is_meta:
            owner, _, leaf = n.rpartition(".")
            peft.get_submodule(owner).register_buffer(
                leaf, model.get_buffer(n).detach().cpu().clone(), persistent=False
            )
    left = [n for n, p in peft.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"the state dict lacks {left[:5]}: cannot merge the adapters into the base")
    return peft.merge_and_unload()
