"""What the planner says when memory cannot hold the run: whether the model's own states or a
sample do not fit, by how much, and the fix for both ways of running (`dcparallel train`'s
TOML keys and the Python API's arguments), so that the suggested fix works where it is read."""

from __future__ import annotations

from dcparallel.spec import Size, format_bytes


def states_do_not_fit(states: float, budget: float, shard_size: int) -> str:
    """The model states alone exceed the memory budget: no sample is to blame."""
    return (
        f"the model's own states (parameters, gradients, optimizer shards) need {format_bytes(states)} per rank, "
        f"{format_bytes(states - budget)} more than the {format_bytes(budget)} usable, before any sample: use "
        f"more memory per rank (dcparallel train: [train] memory_mib; DataCentricParallel(memory_bytes=...)), "
        f"more ranks, or a larger shard size (shard_size, now {shard_size}: 'auto' picks one that fits)"
    )


def sample_does_not_fit(
    sample_id: int,
    size: Size,
    tokens: int,
    sp: int,
    need: float,
    states: float,
    budget: float,
    num_bad: int,
    shard_size: int,
) -> str:
    """The largest sample that fits no layout, with what it needs beyond the model states."""
    return (
        f"sample {sample_id} (size {size!r}, {tokens} tokens) fits no layout: even at SP={sp} with full "
        f"recomputation it needs {format_bytes(need)} per rank (model states {format_bytes(states)} + this "
        f"sample {format_bytes(need - states)}), {format_bytes(need - budget)} more than the "
        f"{format_bytes(budget)} usable; {num_bad} sample(s) are too large. Use more memory, a larger SP degree "
        f"or a larger shard size (shard_size, now {shard_size}: 'auto' picks one that fits); or cut long samples "
        f"(dcparallel train: [data] max_tokens; text_dataset(max_tokens=...)); or skip and report them "
        f"(dcparallel train: [data] skip_oversize = true; dc.prepare(..., skip_oversize=True))"
    )
