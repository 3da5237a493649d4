"""Integrations with other trainers; each imports its framework only when used.

    from dcparallel.integrations import DataCentricTrainer, DataCentricArguments   # transformers
"""

from typing import Any

__all__ = ["DataCentricArguments", "DataCentricTrainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dcparallel.integrations import hf_trainer
        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'dcparallel.integrations' has no attribute {name!r}")
