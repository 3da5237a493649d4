"""The ten lines on the reference video DiT (factorized spatial/temporal attention, flow
matching), with samples of several resolutions and frame counts.

    torchrun --standalone --nproc-per-node 2 examples/video_dit.py
"""

import math
from datetime import timedelta

import torch

import dcparallel
from dcparallel.models.dit import DiT, DiTConfig, draw_flow, flow_matching_loss, patchify

torch.set_num_threads(1)
launch = dcparallel.init_distributed(timeout=timedelta(seconds=120))  # process group, device
torch.manual_seed(0)
cfg = DiTConfig(hidden=64, num_layers=4, num_heads=4, freq_dim=32, attention="factorized")
model = DiT(cfg).to(launch.device)


class Videos:
    """Synthetic latent videos: sample i has the pixel shape shapes[i] = (frames, height, width);
    its latent is (4 channels, frames*5//17 frames, 2*ceil(h/16), 2*ceil(w/16)), Open-Sora's rule."""

    def __init__(self, shapes):
        self.shapes = shapes

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, i):
        f, h, w = self.shapes[i]
        t = 1 if f == 1 else f * 5 // 17
        g = torch.Generator().manual_seed(i)
        latent = torch.randn(4, t, 2 * math.ceil(h / 16), 2 * math.ceil(w / 16), generator=g)
        tokens, positions, (frames, _) = patchify(latent, cfg.patch)
        return {"tokens": tokens, "positions": positions, "frames": frames}


shapes = [(1, 64, 64)] * 24 + [(17, 64, 96)] * 12 + [(34, 128, 128)] * 6 + [(51, 128, 224)] * 2
dataset = Videos(shapes)

# --- the ten lines --------------------------------------------------------------------------
dc = dcparallel.DataCentricParallel(model, policy="dcp", memory_bytes=48 * 2**20)
loader = dc.prepare(dataset, lengths=shapes, samples_per_step=16, profile_path="runs/examples/video_dit_profile.json")
opt = dc.optimizer(lr=1e-3)
for step in loader:
    for batch in step:
        with dc.micro_batch(batch) as ctx:
            # per-sample timestep and noise from (seed, epoch, sample id): identical on every rank of the group
            draws = [draw_flow(ctx.generator(s), batch.seq_len, cfg.patch_dim) for s in batch.sample_ids]
            t = torch.stack([d[0] for d in draws])
            noise = torch.stack([batch.shard_sample(d[1]) for d in draws])
            ptl = flow_matching_loss(model, batch.inputs, batch.positions, t, noise, batch.frames)
            ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
    loss = dc.sync_gradients()
    opt.step()
    # ---------------------------------------------------------------------------------------------
    if dc.rank == 0:
        print(f"step {step.index}: loss {loss:.3f}, SP degrees {sorted({g.sp for g in step.plan.groups})}")
