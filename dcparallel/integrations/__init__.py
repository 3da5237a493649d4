"""Integrations with other trainers; each imports its framework only when used.

from dcparallel.integrations import DataCentricTrainer, DataCentricArguments   # transformers
from dcparallel.integrations import DataCentricSFTTrainer                        # TRL
"""

from typing import Any

__all__ = ["DataCentricArguments", "DataCentricSFTTrainer", "DataCentricTrainer"]


def __getattr__(name: str) -> Any:
    if name == "DataCentricSFTTrainer":
        from dcparallel.integrations import trl_sft

        return trl_sft.DataCentricSFTTrainer
    if name in __all__:
        from dcparallel.integrations import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'dcparallel.integrations' has no attribute {name!r}")
