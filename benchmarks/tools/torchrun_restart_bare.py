"""A bare torch script under `torchrun --standalone --nproc-per-node 2 --max-restarts 1`:
rank 1 dies in attempt 0; on torch 2.13 (CPU, gloo) attempt 1 fails in init_process_group
with "Gloo connectFullMesh failed ... Connection refused" (see reliability_cpu_2026-12-07.md).
With --prefix, the store keys of each attempt get their own prefix and attempt 1 succeeds."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

timeout = timedelta(seconds=20)
if "--prefix" in sys.argv:
    from dcparallel.runtime.launch import init_distributed

    init_distributed("cpu", timeout=timeout)
else:
    dist.init_process_group("gloo", timeout=timeout)
t = torch.ones(1)
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} rank {dist.get_rank()} ok {t.item()}", flush=True)
if attempt == 0 and dist.get_rank() == 1:
    os._exit(3)
dist.barrier()
dist.destroy_process_group()
