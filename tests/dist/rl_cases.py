"""What the gloo workers run for the RL tests: steps planned from rollouts the ranks hold.

Every rank builds the same rollouts (token ids with a prompt part that is not trained,
per-token advantages, old-policy and reference log-probs) and keeps only its holding:
rank 0 holds most of the long ones (500-580 tokens, which need SP >= 2 under the 1.2 MB
budget), the others hold short ones unevenly, and at world 4 the last rank holds none.
The reference is a single process running the unmodified model on each rollout alone."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import dcparallel
from dcparallel.loss import per_token_loss
from tests.dist.cases import groups
from tests.support import make_model, rel_err

VOCAB = 64
#: the analytic model of the fp32 tiny Llama: rollouts of 500-580 tokens need SP 2, the rest fit one rank
MEMORY_BYTES = 1_900_000
#: the forward pass keeps no activations: under this budget its long rollouts still need SP >= 2
FORWARD_MEMORY_BYTES = 1_850_000
NUM_ROLLOUTS = 14
CLIP, KL_COEF, ENT_COEF = 0.2, 0.05, 0.01
#: Dr. GRPO's fixed normalizer: rollouts x the longest completion allowed
DR_GRPO_CONSTANT = NUM_ROLLOUTS * 600.0


def make_rollouts(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rollouts 0-3 are long; prompts are the first 10-40 tokens (not trained)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(NUM_ROLLOUTS):
        n = rng.randint(500, 580) if i < 4 else rng.randint(12, 200)
        prompt = min(n - 2, rng.randint(10, 40))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[prompt:] = True
        out.append(
            {
                "input_ids": torch.randint(0, VOCAB, (n,), generator=g),
                "loss_mask": mask,
                "advantages": torch.randn(n, generator=g),
                "old_logp": -4.2 + 0.3 * torch.randn(n, generator=g),
                "ref_logp": -4.2 + 0.3 * torch.randn(n, generator=g),
            }
        )
    return out


def holding(rank: int, world: int) -> list[int]:
    """Uneven holdings: rank 0 the long rollouts but one, and two short ones; the rest of
    the short ones dealt to ranks 1.. in growing shares; at world 4 rank 3 holds none."""
    if world == 1:
        return list(range(NUM_ROLLOUTS))
    others = [r for r in range(1, world) if not (world == 4 and r == 3)]
    mine = {0: [0, 1, 2, 4, 5]}
    rest = [3] + list(range(6, NUM_ROLLOUTS))
    for k, i in enumerate(rest):
        mine.setdefault(others[k % len(others)], []).append(i)
    return mine.get(rank, [])


def grpo_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, adv: torch.Tensor, old: torch.Tensor, ref: torch.Tensor
) -> torch.Tensor:
    """Per-token GRPO loss: clipped ratio x advantage, k3 KL to the reference, minus entropy."""
    logp = -per_token_loss(logits, labels)[0]
    ratio = torch.exp(logp - old)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    lsm = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    return pg + KL_COEF * kl - ENT_COEF * entropy


def reference_step(rollouts: list[dict[str, torch.Tensor]], norm: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Single process, each rollout alone through the unmodified model: logits at t predict
    token t + 1, whose per-token values and mask are read at t + 1 here (no shift helper)."""
    model = make_model("llama")
    total, tokens = [], 0
    for r in rollouts:
        ids = r["input_ids"]
        logits = model(ids[None])[0, :-1]
        keep = r["loss_mask"][1:]
        per = grpo_token_loss(logits, ids[1:], r["advantages"][1:], r["old_logp"][1:], r["ref_logp"][1:])
        s = per[keep].sum()
        total.append(s / keep.sum() if norm == "sequence" else s)
        tokens += int(keep.sum())
    divisor = {"token": tokens, "sequence": len(rollouts), "constant": DR_GRPO_CONSTANT}[norm]
    loss = torch.stack(total).sum() / divisor
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


NORMS = ("token", "sequence", "constant")


def case_rl_step(policy: str = "dcp") -> dict:
    """One GRPO step planned from the ranks' uneven holdings (`plan_batch`), its micro-batches
    run once per normalization (`NORMS`): "token" (over the step's trained tokens),
    "sequence" (per rollout mean, then the mean over rollouts), "constant" (Dr. GRPO). Rank 0
    compares each synced gradient with the single process's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rollouts = make_rollouts()
    mine = holding(rank, world)
    model = make_model("llama")
    dc = dcparallel.DataCentricParallel(model, policy=policy, research=True, memory_bytes=MEMORY_BYTES, groups=groups())
    dc.prepare_rollouts(max_tokens=600, cost="analytic", check_plans=1)
    step = dc.plan_batch([rollouts[i] for i in mine])
    out = {
        "mine": [step.local_ids[j] for j in range(len(mine))],
        "held": mine,
        "origin": list(step.origin),
        "num_targets": step.num_targets,
        "work": [(list(b.ranks), list(b.sample_ids), b.sp) for b in step],
        "plan_groups": [(list(g.ranks), [list(mb.sample_ids) for mb in g.micro_batches]) for g in step.plan.groups],
    }
    for norm in NORMS:
        out[norm] = _run_step(dc, model, step, norm)
        if rank == 0:
            ref_loss, ref_grads = reference_step(rollouts_in_global_order(rollouts, world), norm)
            grads = dc.gradients()
            out[norm]["ref_loss"] = ref_loss
            out[norm]["rel"] = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    return out


def _run_step(dc, model, step, norm: str) -> dict:
    for batch in step:
        with dc.micro_batch(batch) as ctx:
            pt = batch.per_token
            per = grpo_token_loss(
                model(batch.inputs, batch.positions), batch.labels, pt["advantages"], pt["old_logp"], pt["ref_logp"]
            )
            weights = batch.sample_mean_weights() if norm == "sequence" else None
            ctx.backward(ctx.token_loss(per, batch.loss_mask, weights))
    loss = dc.sync_gradients(DR_GRPO_CONSTANT if norm == "constant" else None)
    return {"loss": loss, "count": dc.last_count}


def rollouts_in_global_order(rollouts: list[dict[str, torch.Tensor]], world: int) -> list[dict[str, torch.Tensor]]:
    """The rollouts in global-id order (rank-major over the holdings)."""
    return [rollouts[i] for r in range(world) for i in holding(r, world)]


def _label_logprobs(model, batch) -> torch.Tensor:
    return -per_token_loss(model(batch.inputs, batch.positions), batch.labels)[0]


def case_forward_logprobs() -> dict:
    """A forward-only pass over the uneven holdings (`forward_batch`): the log-prob of every
    next token, back on the rank that holds the rollout, in its order. Each rank compares
    with the unmodified model run on each of its rollouts alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rollouts = [{k: v for k, v in r.items() if k != "loss_mask"} for r in make_rollouts()]
    mine = holding(rank, world)
    model = make_model("llama")
    dc = dcparallel.DataCentricParallel(model, memory_bytes=FORWARD_MEMORY_BYTES, groups=groups())
    dc.prepare_rollouts(max_tokens=600, cost="analytic", check_plans=1)
    got = dc.forward_batch([rollouts[i] for i in mine], _label_logprobs)
    ref_model = make_model("llama")
    rel, exact_first = [], True
    with torch.no_grad():
        for i, out in zip(mine, got, strict=True):
            ids = rollouts[i]["input_ids"]
            ref = torch.log_softmax(ref_model(ids[None])[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
            rel.append(rel_err(out[1:], ref))
            exact_first &= out.shape == ids.shape and float(out[0]) == 0.0
    fwd = dc.forward_pass.last_step.plan
    return {
        "rel": rel,
        "exact_first": exact_first,
        "num": len(got),
        "sps": sorted({mb.layout.sp for mb in fwd.micro_batches()}),
        "recompute": sorted({(mb.layout.recompute.attn, mb.layout.recompute.mlp) for mb in fwd.micro_batches()}),
    }
