"""Your own nn.Module with dcparallel: a small GPT written right here, with grouped-query
attention, trained on documents of very different lengths.

    torchrun --standalone --nproc-per-node 2 examples/custom_model.py     # or: python examples/custom_model.py

What the model does for dcparallel (its protocol, `dcparallel.adapters.protocol_adapter`):
its blocks call an attention function they are given (``set_attention(fn)``; ``fn(q, k, v,
pattern)`` with q (B, L, heads, D) and k, v (B, L, kv_heads, D) — the runtime's function
shards heads over the SP group, keeps packed documents apart and applies causality), the
blocks are ``model.layers``, each with ``attn_block`` and ``mlp_block`` (so attention and
MLP can be recomputed separately), and positions come in as an argument. The lines
dcparallel adds to the training loop are marked `# dcparallel`.
"""

import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

import dcparallel  # dcparallel
from dcparallel.data.synthetic import SyntheticText, builtin_lengths
from dcparallel.models.attention import AttnPattern, local_attention


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.attention = local_attention  # replaced by dcparallel's through set_attention

    def forward(self, x):
        b, n, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, self.head_dim).unbind(2)
        return self.out(self.attention(q, k, v, AttnPattern("causal")).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attn_block = Attention(dim, heads, kv_heads)
        self.mlp_block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn_block(x)
        return x + self.mlp_block(x)


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int = 256,
        dim: int = 128,
        num_layers: int = 4,
        heads: int = 4,
        kv_heads: int = 2,
        max_len: int = 4096,
    ):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(num_layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def set_attention(self, fn):
        for block in self.layers:
            block.attn_block.attention = fn

    def forward(self, ids, positions):
        x = self.embed(ids) + self.pos(positions)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


torch.set_num_threads(1)
launch = dcparallel.init_distributed(timeout=timedelta(seconds=120))  # dcparallel: process group, device
torch.manual_seed(0)
model = GPT().to(launch.device)
lengths = builtin_lengths(num_samples=int(os.environ.get("NUM_SAMPLES", 96)))
dataset = SyntheticText(lengths, vocab=256)
profile = os.path.join(os.environ.get("OUT_DIR", "runs/examples"), "custom_model_profile.json")


def loss_fn(model, batch, ctx):  # one micro-batch: forward + summed loss (the profiler runs it too)
    logits = model(batch.inputs, batch.positions)
    per_token = F.cross_entropy(
        logits.flatten(0, 1).float(), batch.labels.flatten(), reduction="none", ignore_index=-100
    ).view(batch.labels.shape)
    return ctx.token_loss(per_token, batch.loss_mask)  # dcparallel: summed over this shard's targets


dc = dcparallel.DataCentricParallel(model, num_heads=4, num_kv_heads=2, memory_bytes=96 * 2**20)  # dcparallel
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
