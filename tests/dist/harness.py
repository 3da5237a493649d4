"""Multi-process gloo workers, started once per test module.

Each worker initializes gloo through a file rendezvous (one thread, a 60 s collective
timeout unless the module asks for another, so a mismatched collective fails instead of
hanging), then runs commands: a module-level function + arguments, called on every rank at
once; results come back in rank order. A failure on any rank fails the test with every rank's traceback."""

from __future__ import annotations

import os
import queue
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

COMMAND_TIMEOUT_S = 150

#: what the fork server imports once, so that no worker imports it again: torch, and what most
#: modules' workers import next — torch._dynamo (any torch optimizer imports it on first use;
#: transformers imports it too), transformers' and diffusers' model base modules, the first
#: diffusers transformer (about 1.2 CPU-s: the attention, embedding and normalization modules
#: every other diffusers transformer then finds imported), dcparallel's engine and API (about
#: 0.3 CPU-s, in every worker). A missing one is skipped: the fork server ignores an ImportError
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "transformers.modeling_utils",
    "diffusers.models.modeling_utils",
    "diffusers.models.transformers.transformer_wan",
    "dcparallel.runtime.engine",
    "dcparallel.api",
    "tests.dist.harness",
]


def _worker(rank: int, world: int, init_file: str, commands, results, timeout_s: float = 60) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        while True:
            item = commands.get()
            if item is None:
                break
            fn, args, kwargs = item
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - reported to the test process
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Workers:
    """``daemon=False`` lets the workers start processes of their own (DataLoader workers);
    `close` still joins or kills them. ``timeout_s``: the default group's collective timeout."""

    def __init__(self, world: int, tmp: Path, daemon: bool = True, timeout_s: float = 60):
        self.world = world
        # a fork server that has imported torch once per test process: each worker forks
        # from it instead of starting an interpreter and importing torch (about 3 s of CPU
        # each on a CI core); the server itself never runs torch, so no thread state is forked.
        # The ranks share the server's hash seed: that plans do not depend on it is tested with
        # fresh interpreters (test_loader, test_dcp_scale) and by the torchrun launches
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        init_file = str(tmp / "rendezvous")
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, init_file, self.commands[r], self.results, timeout_s), daemon=daemon
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; its return values in rank order."""
        for q in self.commands:
            q.put((fn, args, kwargs))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        waited = 0
        while len(out) + len(errors) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=5)
            except queue.Empty:
                waited += 5
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or waited >= COMMAND_TIMEOUT_S:
                    raise RuntimeError(
                        f"{fn.__name__}: no answer from ranks "
                        f"{sorted(set(range(self.world)) - set(out) - set(errors))} "
                        f"(dead: {dead}, waited {waited} s)"
                    ) from None
                continue
            (out if ok else errors)[rank] = value
        if errors:
            raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
