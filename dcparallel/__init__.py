"""dcparallel: Data-Centric Parallel training for variable-length sequences."""

__version__ = "0.1.0"

__all__ = ["DataCentricParallel", "empty_init", "init_distributed"]


def __getattr__(name: str):
    # torch is imported only when the training object is asked for: the planner, cost
    # models and simulator stay importable without it
    if name == "DataCentricParallel":
        from dcparallel.api import DataCentricParallel

        return DataCentricParallel
    if name == "empty_init":  # a model built without its weights (runtime/meta_init.py)
        from dcparallel.runtime.meta_init import empty_init

        return empty_init
    if name == "init_distributed":  # the process group and device of a torchrun launch (runtime/launch.py)
        from dcparallel.runtime.launch import init_distributed

        return init_distributed
    raise AttributeError(f"module 'dcparallel' has no attribute {name!r}")
