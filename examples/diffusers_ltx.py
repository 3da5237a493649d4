"""A diffusers LTXVideoTransformer3DModel (LTX-Video: full 3D attention, cross-attention to
text) trained with dcparallel by flow matching on latent videos of many resolutions and
frame counts.

    torchrun --standalone --nproc-per-node 2 examples/diffusers_ltx.py     # or: python examples/diffusers_ltx.py

An ordinary PyTorch training loop; the lines dcparallel adds are marked `# dcparallel`
(counted by tests/e2e/test_examples.py). Sample sizes are latent shapes (frames, height,
width); with patch size 1 every latent position is one token. The model shards its tokens
where its own context-parallel plan says; the text stays whole on every rank. The model is
built from its constructor arguments: nothing is downloaded.
"""

import os
import random
from datetime import timedelta

import torch
from diffusers import LTXVideoTransformer3DModel

import dcparallel  # dcparallel
from dcparallel.data.synthetic import SyntheticLatents

torch.set_num_threads(1)
launch = dcparallel.init_distributed(timeout=timedelta(seconds=120))  # dcparallel: process group, device
torch.manual_seed(0)
model = LTXVideoTransformer3DModel(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    cross_attention_dim=64,
    num_layers=4,
    caption_channels=32,
).to(launch.device)
rng = random.Random(0)  # latent frames 1 (images) to 5, resolutions from 4x4 to 8x12 latent pixels
shapes = [
    (rng.choice([1, 1, 2, 3, 5]), *rng.choice([(4, 4), (4, 6), (6, 4), (6, 8), (8, 12)]))
    for _ in range(int(os.environ.get("NUM_SAMPLES", 48)))
]
dataset = SyntheticLatents(shapes, channels=4, text_dim=32, text_tokens=8)  # {"latents", "encoder_hidden_states"}
profile = os.path.join(os.environ.get("OUT_DIR", "runs/examples"), "diffusers_ltx_profile.json")


def loss_fn(model, batch, ctx):  # rectified flow: one micro-batch, forward + summed loss
    x0 = batch.inputs  # (B, C, F, H, W) latents
    gens = [ctx.generator(s) for s in batch.sample_ids]  # dcparallel: per-sample RNG
    t = torch.stack([torch.sigmoid(torch.randn((), generator=g)) for g in gens]).to(x0.device)
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens]).to(x0)
    xt = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    f, h, w = x0.shape[2:]
    pred = (
        model(
            xt.flatten(2).transpose(1, 2),
            encoder_hidden_states=batch.extras["encoder_hidden_states"],
            timestep=t * 1000,
            encoder_attention_mask=None,
            num_frames=f,
            height=h,
            width=w,
            return_dict=False,
        )[0]
        .transpose(1, 2)
        .reshape(x0.shape)
    )  # tokens back to (B, C, F, H, W)
    return ctx.dense_loss((pred.float() - (noise - x0).float()).pow(2).mean(1))  # dcparallel: summed loss


dc = dcparallel.DataCentricParallel(model, policy="dcp", context_tokens=8, memory_bytes=64 * 2**20)  # dcparallel
loader = dc.prepare(dataset, lengths=shapes, samples_per_step=16, loss_fn=loss_fn, profile_path=profile)  # dcparallel
opt = dc.optimizer(lr=1e-3)  # dcparallel
for epoch in range(int(os.environ.get("EPOCHS", 2))):
    dc.set_epoch(epoch)  # dcparallel: new shuffle and noise each epoch
    for step in loader:  # dcparallel: this rank's micro-batches of one step
        for batch in step:
            with dc.micro_batch(batch) as ctx:  # dcparallel: SP group, recompute, per-sample RNG
                ctx.backward(loss_fn(model, batch, ctx))  # dcparallel
        loss = dc.sync_gradients()  # dcparallel: one all-reduce, exact mean
        opt.step()
        if dc.rank == 0:
            print(
                f"epoch {epoch} step {step.index}: loss {loss:.4f}, SP degrees "
                f"{sorted({g.sp for g in step.plan.groups})}",
                flush=True,
            )
