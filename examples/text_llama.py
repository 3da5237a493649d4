"""The ten lines on the reference LM: profile (cached), plan every step, train.

    torchrun --standalone --nproc-per-node 2 examples/text_llama.py

Runs on CPU (gloo) as it is; on GPUs (NCCL) move the model to the device first.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import dcparallel
from dcparallel.demo import SyntheticText, builtin_lengths
from dcparallel.models.llama import Llama, LlamaConfig, per_token_loss

torch.set_num_threads(1)
if "RANK" in os.environ:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
torch.manual_seed(0)
model = Llama(LlamaConfig(vocab_size=256, hidden=128, num_layers=4, num_heads=4, ffn_hidden=352))
lengths = builtin_lengths(num_samples=160)
dataset = SyntheticText(lengths)                     # dataset[i]: a 1-D tensor of lengths[i] token ids

# --- the ten lines --------------------------------------------------------------------------
dc = dcparallel.DataCentricParallel(model, layers=model.layers, policy="dcp", memory_bytes=64 * 2**20)
loader = dc.prepare(dataset, lengths=lengths, tokens_per_step=8192, profile_path="runs/examples/text_llama_profile.json")
opt = dc.optimizer(lr=3e-3)
for step in loader:                                  # this rank's Batches of one optimizer step
    for batch in step:
        with dc.micro_batch(batch) as ctx:           # SP group, recompute, per-sample RNG
            logits = model(batch.inputs, batch.positions)
            ctx.backward(ctx.token_loss(per_token_loss(logits, batch.labels)[0], batch.loss_mask))
    loss = dc.sync_gradients()                       # the step's one all-reduce; exact mean over targets
    opt.step()
# ---------------------------------------------------------------------------------------------
    if dc.rank == 0:
        print(f"step {step.index}: loss {loss:.3f}, SP degrees {sorted({g.sp for g in step.plan.groups})}")
