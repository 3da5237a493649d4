"""torchrun worker for test_oom_torchrun: rank 1 runs out of memory inside layer 1's
forward of an SP=2 micro-batch of step 3, while rank 0 goes on into that layer's
all-to-all. The collective timeout is 10 minutes, so only the abort can end rank 0 soon."""

import dataclasses
from datetime import timedelta

import torch

from dcparallel.data.collate import text_batch
from dcparallel.loss import per_token_loss
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from dcparallel.runtime.launch import init_distributed, record_ooms_in
from dcparallel.spec import Layout

torch.set_num_threads(1)
launch = init_distributed(device="cpu", timeout=timedelta(seconds=600))
record_ooms_in(".")  # as the trainer does with its out_dir: the restart lowers its budget
torch.manual_seed(0)
model = Llama(LlamaConfig.tiny(vocab_size=64, hidden=32, num_layers=2, num_heads=4, ffn_hidden=48))
dc = Engine(model, layers=model.layers, num_heads=4)
if launch.rank == 1:

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    model.layers[1].forward = fail
docs = {7: torch.arange(40) % 64, 9: torch.arange(24) % 64}
batch = text_batch(MicroBatch((7, 9), Layout(2, 2)), (0, 1), launch.rank, docs)
batch = dataclasses.replace(batch, step=3, last_of_step=True)  # as the loader hands it
with dc.micro_batch(batch) as ctx:
    ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
    ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
dc.sync_gradients()
print("unreachable: rank", launch.rank, "finished the step")
