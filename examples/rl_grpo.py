"""GRPO with dcparallel: a small causal LM learns a rule from its own rollouts.

    torchrun --standalone --nproc-per-node 2 examples/rl_grpo.py     # or: python examples/rl_grpo.py

Each step every rank generates groups of completions for its own prompts with transformers'
``generate`` (on a plain copy of the policy, as RL frameworks sample on an inference engine),
scores them with a rule (the toy task: the share of even tokens in the completion), turns
the scores into GRPO advantages within each group, and trains on the rollouts it and the
other ranks generated: old-policy and reference log-probs come from forward-only passes, the
update's loss has the clipped ratio, the KL to the reference and an entropy bonus, normalized
per token over the step. Rollouts differ in length (prompts of 4-40 tokens, completions up
to 48); dcparallel plans each step from the lengths and moves each rollout to the ranks that
run it. The lines dcparallel adds are marked `# dcparallel` (counted by
tests/e2e/test_examples.py). The model is built from a config: nothing is downloaded.
"""

import copy
import os
from datetime import timedelta

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dcparallel  # dcparallel
from dcparallel.loss import per_token_loss  # dcparallel

PAD, EOS, VOCAB = 0, 1, 32
PROMPTS, GROUP, MAX_NEW = 4, 4, 48  # per rank and step: 4 prompts x 4 completions
CLIP, KL_COEF, ENT_COEF = 0.2, 0.02, 0.001

torch.set_num_threads(1)
launch = dcparallel.init_distributed(timeout=timedelta(seconds=120))  # dcparallel: process group, device
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=EOS,
    pad_token_id=PAD,
)
model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(launch.device)
sampler, ref_model = copy.deepcopy(model), copy.deepcopy(model)  # generation copy; reference (never stepped)
prompts = torch.Generator().manual_seed(1 + launch.rank)  # each rank its own prompts


def rollouts_of_this_rank() -> tuple[list[dict], float]:
    """GROUP completions of each of PROMPTS prompts; rewards -> GRPO advantages per group."""
    out, rewards = [], []
    for _ in range(PROMPTS):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(4, 41, (), generator=prompts)),), generator=prompts)
        with torch.no_grad():
            seqs = sampler.generate(
                prompt.repeat(GROUP, 1).to(launch.device),
                do_sample=True,
                top_k=0,
                max_new_tokens=MAX_NEW,
                eos_token_id=EOS,
                pad_token_id=PAD,
            ).cpu()
        group = []
        for seq in seqs:
            done = (seq[len(prompt) :] == EOS).nonzero()
            completion = seq[len(prompt) :][: int(done[0]) + 1 if len(done) else MAX_NEW]
            words = completion[completion != EOS]
            group.append(float((words % 2 == 0).float().mean()) if len(words) else 0.0)
            ids = torch.cat([prompt, completion])
            out.append({"input_ids": ids, "loss_mask": torch.arange(len(ids)) >= len(prompt)})  # train the completion
        r = torch.tensor(group)
        for j, x in enumerate(((r - r.mean()) / (r.std() + 1e-4)).tolist()):
            out[-GROUP + j]["advantages"] = torch.full((len(out[-GROUP + j]["input_ids"]),), x)
        rewards += group
    return out, sum(rewards) / len(rewards)


def logprobs(model, batch):  # forward-only: the log-prob of each next token
    logits = model(input_ids=batch.inputs, position_ids=batch.positions, use_cache=False).logits
    return -per_token_loss(logits, batch.labels)[0]


def grpo_loss(model, batch):  # per token: clipped ratio x advantage, k3 KL to the reference, entropy bonus
    logits = model(input_ids=batch.inputs, position_ids=batch.positions, use_cache=False).logits
    logp, t = -per_token_loss(logits, batch.labels)[0], batch.per_token
    ratio = torch.exp(logp - t["old_logp"])
    pg = -torch.minimum(ratio * t["advantages"], torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * t["advantages"])
    kl = torch.exp(t["ref_logp"] - logp) - (t["ref_logp"] - logp) - 1
    lsm = torch.log_softmax(logits.float(), dim=-1)
    return pg + KL_COEF * kl + ENT_COEF * (lsm.exp() * lsm).sum(-1)


dc = dcparallel.DataCentricParallel(model, policy="dcp", memory_bytes=2 * 2**20)  # dcparallel
ref = dcparallel.DataCentricParallel(ref_model, policy="dcp", memory_bytes=2 * 2**20)  # dcparallel
dc.prepare_rollouts(max_tokens=40 + MAX_NEW, cost="analytic")  # dcparallel
ref.prepare_rollouts(max_tokens=40 + MAX_NEW, cost="analytic")  # dcparallel
opt = dc.optimizer(lr=3e-3)  # dcparallel
for it in range(int(os.environ.get("STEPS", 30))):
    sampler.load_state_dict(model.state_dict())  # the sampler generates with the current policy
    rollouts, reward = rollouts_of_this_rank()
    # old-policy and reference log-probs: forward-only passes, planned and balanced as such
    old, reference = dc.forward_batch(rollouts, logprobs), ref.forward_batch(rollouts, logprobs)  # dcparallel
    for r, o, f in zip(rollouts, old, reference):
        r["old_logp"], r["ref_logp"] = o, f
    step = dc.plan_batch(rollouts)  # dcparallel: lengths exchanged, planned, rollouts moved
    for batch in step:
        with dc.micro_batch(batch) as ctx:  # dcparallel
            ctx.backward(ctx.token_loss(grpo_loss(model, batch), batch.loss_mask))  # dcparallel
    loss = dc.sync_gradients()  # dcparallel: mean over the step's trained tokens
    opt.step()
    if dc.rank == 0:
        print(
            f"step {it}: reward {reward:.3f} (rank 0), loss {loss:.4f}, {step.num_samples} rollouts, "
            f"SP degrees {sorted({g.sp for g in step.plan.groups})}",
            flush=True,
        )
