"""A Hugging Face transformers Llama (grouped-query attention: 8 query heads, 2 key/value
heads) trained with dcparallel on documents of very different lengths.

    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py     # or: python examples/hf_llama.py

An ordinary PyTorch training loop; the lines dcparallel adds are marked `# dcparallel`
(counted by tests/e2e/test_examples.py). The same code takes a Qwen2/Qwen3 or Mistral
config. The model is built from a config: nothing is downloaded.
"""

import os
from datetime import timedelta

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dcparallel  # dcparallel
from dcparallel.data.synthetic import SyntheticText, builtin_lengths

torch.set_num_threads(1)
launch = dcparallel.init_distributed(timeout=timedelta(seconds=120))  # dcparallel: process group, device
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(launch.device)
lengths = builtin_lengths(num_samples=int(os.environ.get("NUM_SAMPLES", 96)))  # token counts, known up front
dataset = SyntheticText(lengths, vocab=config.vocab_size)  # dataset[i]: 1-D token ids
profile = os.path.join(os.environ.get("OUT_DIR", "runs/examples"), "hf_llama_profile.json")


def loss_fn(model, batch, ctx):  # one micro-batch: forward + summed loss (the profiler runs it too)
    logits = model(input_ids=batch.inputs, position_ids=batch.positions, use_cache=False).logits
    return ctx.lm_loss(logits)  # dcparallel: next-token loss, shifted before sharding, summed


dc = dcparallel.DataCentricParallel(model, policy="dcp", memory_bytes=96 * 2**20)  # dcparallel
loader = dc.prepare(dataset, lengths=lengths, tokens_per_step=8192, loss_fn=loss_fn, profile_path=profile)  # dcparallel
opt = dc.optimizer(lr=3e-3)  # dcparallel
for step in loader:  # dcparallel: this rank's micro-batches of one step
    for batch in step:
        with dc.micro_batch(batch) as ctx:  # dcparallel: SP group, recompute, per-sample RNG
            ctx.backward(loss_fn(model, batch, ctx))  # dcparallel
    loss = dc.sync_gradients()  # dcparallel: one all-reduce, exact mean over targets
    opt.step()
    if dc.rank == 0:
        print(f"step {step.index}: loss {loss:.3f}, SP degrees {sorted({g.sp for g in step.plan.groups})}", flush=True)
