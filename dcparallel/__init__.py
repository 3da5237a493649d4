"""dcparallel: Data-Centric Parallel training for variable-length sequences."""

__version__ = "0.1.0"
