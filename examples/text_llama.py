"""The ten lines on the reference LM: profile (cached), plan every step, train.

    torchrun --standalone --nproc-per-node 2 examples/text_llama.py

Runs on CPU (gloo) and on GPUs (NCCL, one process per GPU) as it is.
"""

from datetime import timedelta

import torch

import dcparallel
from dcparallel.data.synthetic import SyntheticText, builtin_lengths
from dcparallel.models.llama import Llama, LlamaConfig

torch.set_num_threads(1)
launch = dcparallel.init_distributed(timeout=timedelta(seconds=120))  # process group, device
torch.manual_seed(0)
model = Llama(LlamaConfig(vocab_size=256, hidden=128, num_layers=4, num_heads=4, ffn_hidden=352)).to(launch.device)
lengths = builtin_lengths(num_samples=160)
dataset = SyntheticText(lengths)  # dataset[i]: a 1-D tensor of lengths[i] token ids

# --- the ten lines --------------------------------------------------------------------------
dc = dcparallel.DataCentricParallel(model, policy="dcp", memory_bytes=64 * 2**20)  # finds the model's adapter
loader = dc.prepare(dataset, lengths=lengths, tokens_per_step=8192, profile_path="runs/examples/text_llama.json")
opt = dc.optimizer(lr=3e-3)
for step in loader:  # this rank's Batches of one optimizer step
    for batch in step:
        with dc.micro_batch(batch) as ctx:  # SP group, recompute, per-sample RNG
            ctx.backward(ctx.lm_loss(model(batch.inputs, batch.positions)))  # summed next-token loss
    loss = dc.sync_gradients()  # the step's one all-reduce; exact mean over targets
    opt.step()
    # ---------------------------------------------------------------------------------------------
    if dc.rank == 0:
        print(f"step {step.index}: loss {loss:.3f}, SP degrees {sorted({g.sp for g in step.plan.groups})}")
