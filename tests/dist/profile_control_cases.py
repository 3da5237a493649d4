"""Profiler runs with a slow rank, an out-of-memory or an error on one rank of an SP group
(module level so that the gloo workers can run them; `test_dist_profile_control`)."""

from __future__ import annotations

import os
import time

import torch

from dcparallel.models.llama import Llama
from dcparallel.profile import Profiler
from dcparallel.runtime import comm
from dcparallel.spec import Recompute
from tests.dist.profile_cases import tiny_profiler

#: the control groups' timeout in these workers: far above the default group's 5 s
CONTROL_TIMEOUT_S = "120"


def _profiler(make_inputs=None, **cfg) -> tuple[Profiler, Llama]:
    os.environ["DCPARALLEL_CONTROL_TIMEOUT_S"] = CONTROL_TIMEOUT_S  # read when the control group is made
    return tiny_profiler(make_inputs, **cfg)


def case_slow_rank(delay_s: float) -> dict:
    """Rank 1 builds its first SP-1 inputs ``delay_s`` late: rank 0, done with its own SP-1
    layout, waits for it before their SP-2 layouts."""

    def slow(model, inputs):
        late = [comm.world_rank() == 1]

        def make(size, layout, ranks, rank):
            if layout.sp == 1 and late[0]:
                late[0] = False
                time.sleep(delay_s)
            return inputs(size, layout, ranks, rank)

        return make

    prof, _ = _profiler(slow, modes=("none",), max_mbs=1)
    profile, _ = prof.run([16, 32])
    return profile.to_json()


def _active_layers(model: Llama) -> int:
    """How many blocks run now (the profiler's skipped blocks have a pass-through forward)."""
    return sum(not getattr(b.__dict__.get("forward"), "skips_block", False) for b in model.layers)


def failing(depth: int, where: str, exc: type[BaseException] = torch.OutOfMemoryError):
    """make_inputs whose SP-2 runs of the 32-token bucket without recompute fail on rank 1 in
    the run of ``depth`` layers, ``where``: "forward" (as block ``depth - 1`` starts, after the
    blocks before it ran their all-to-alls), "backward" (when the gradient reaches block
    ``depth - 1``'s input: its backward all-to-alls done, those of the blocks below to come) or
    "end" (at block 0's input gradient, after the run's last collective, as a device's check
    of its peak memory after a run would)."""

    def wrap(model, inputs):
        def make(size, layout, ranks, rank):
            out = inputs(size, layout, ranks, rank)
            if not (rank == 1 and layout.sp == 2 and size == 32 and layout.recompute == Recompute.none()):
                return out
            block = model.layers[0 if where == "end" else depth - 1]
            handles = []

            def fail(*_):
                raise exc(f"injected at depth {depth} ({where}) on rank 1")

            def pre(module, args):
                handles.pop().remove()
                if where == "forward":
                    fail()
                args[0].register_hook(fail)

            def loss(ctx):
                if _active_layers(model) == depth:
                    handles.append(block.register_forward_pre_hook(pre))
                return out.loss(ctx)

            return out._replace(loss=loss)

        return make

    return wrap


def case_fail(depth: int, where: str, error: bool = False) -> dict:
    """A profile whose rank 1 fails as `failing` says (an out-of-memory, or a ValueError with
    ``error``); the profile each rank ends with."""
    prof, _ = _profiler(failing(depth, where, ValueError if error else torch.OutOfMemoryError))
    profile, _ = prof.run([16, 32])
    return profile.to_json()
