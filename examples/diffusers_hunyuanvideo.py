"""A diffusers HunyuanVideoTransformer3DModel (text-to-video: dual-stream then single-stream
blocks, one joint attention over video and text tokens) trained with dcparallel by flow
matching on latent videos of many resolutions and frame counts, with padded captions.

    torchrun --standalone --nproc-per-node 2 examples/diffusers_hunyuanvideo.py   # or: python examples/...

An ordinary PyTorch training loop; the lines dcparallel adds are marked `# dcparallel`
(counted by tests/e2e/test_examples.py). Sample sizes are latent shapes (frames, height,
width): what the VAE gives, before the transformer's 1x2x2 patches. Inside an SP group the
video tokens are sharded and the text tokens replicated; each rank attends over all video
tokens and the caption for its share of the heads. The model is built from its constructor
arguments: nothing is downloaded.
"""

import os
import random
from datetime import timedelta

import torch
from diffusers import HunyuanVideoTransformer3DModel

import dcparallel  # dcparallel
from dcparallel.data.synthetic import SyntheticLatents

torch.set_num_threads(1)
launch = dcparallel.init_distributed(timeout=timedelta(seconds=120))  # dcparallel: process group, device
torch.manual_seed(0)
model = HunyuanVideoTransformer3DModel(
    in_channels=4,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    text_embed_dim=32,
    pooled_projection_dim=16,
    rope_axes_dim=(4, 6, 6),
    guidance_embeds=False,
).to(launch.device)
rng = random.Random(0)  # latent frames 1 (images) to 7, resolutions from 8x8 to 16x24 latent pixels
shapes = [
    (rng.choice([1, 1, 2, 3, 5, 7]), *rng.choice([(8, 8), (8, 12), (12, 8), (12, 16), (16, 24)]))
    for _ in range(int(os.environ.get("NUM_SAMPLES", 48)))
]
latents = SyntheticLatents(shapes, channels=4, text_dim=32, text_tokens=8)  # {"latents", "encoder_hidden_states"}


class Captioned(torch.utils.data.Dataset):  # + a caption mask (2-8 real tokens, the rest padding) and pooled text
    def __len__(self):
        return len(latents)

    def __getitem__(self, i):
        item = latents[i]
        mask = (torch.arange(8) < 2 + i % 7).long()
        return {**item, "encoder_attention_mask": mask, "pooled_projections": item["encoder_hidden_states"][0, :16]}


dataset = Captioned()
profile = os.path.join(os.environ.get("OUT_DIR", "runs/examples"), "diffusers_hunyuanvideo_profile.json")


def loss_fn(model, batch, ctx):  # rectified flow: one micro-batch, forward + summed loss
    x0, ex = batch.inputs, batch.extras  # (B, C, F, H, W) latents, captions
    gens = [ctx.generator(s) for s in batch.sample_ids]  # dcparallel: per-sample RNG
    t = torch.stack([torch.sigmoid(torch.randn((), generator=g)) for g in gens]).to(x0.device)
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens]).to(x0)
    xt = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    pred = model(
        xt,
        timestep=t * 1000,
        encoder_hidden_states=ex["encoder_hidden_states"],
        encoder_attention_mask=ex["encoder_attention_mask"],
        pooled_projections=ex["pooled_projections"],
        return_dict=False,
    )[0]
    return ctx.dense_loss((pred.float() - (noise - x0).float()).pow(2).mean(1))  # dcparallel: summed loss


dc = dcparallel.DataCentricParallel(model, policy="dcp", context_tokens=8, memory_bytes=64 * 2**20)  # dcparallel
loader = dc.prepare(  # dcparallel
    dataset,
    lengths=shapes,
    samples_per_step=16,
    loss_fn=loss_fn,
    profile_path=profile,
    profiler_config={"repeats": 1, "max_repeats": 2, "modes": ("none", "full")},  # a short profile
)
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
