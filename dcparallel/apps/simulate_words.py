"""`dcparallel simulate`'s table in words: each policy's layout said plainly, and one line
under the table saying whether `dcp` beat the best static layout here and why, from what the
plans did (the tokens' mean SP degree, the share of micro-batches that recompute, idle ranks).

    dcp: 1.08x faster than the best static layout here (packed: SP 8 for every sample, recompute
    mlp, bins of 226,996 tokens), because its tokens ran at SP 5.1 on average against 8.0, 4% of
    its micro-batches recompute against 100%, and ranks sat idle 0.2% of the time against 0.0%
"""

from __future__ import annotations

from collections.abc import Sequence

from dcparallel.plan.policies import COMPARED
from dcparallel.plan.types import StepPlan

#: the static layouts `dcp` is measured against
STATIC = ("bucket", "packed")
#: what `simulate` runs without --policy / --all: the policies users choose from
USER_POLICIES = COMPARED


def plan_stats(plans: Sequence[StepPlan], tokens: Sequence[int]) -> dict:
    """The tokens' mean SP degree, the share of micro-batches that recompute anything, and
    the micro-batches run under ring attention by split ("SP 64 = 8u×8r" -> how many)."""
    weighted = total = recomputing = count = 0
    rings: dict[str, int] = {}
    for p in plans:
        for mb in p.micro_batches():
            if mb.layout.ring > 1:
                rings[mb.layout.sp_words()] = rings.get(mb.layout.sp_words(), 0) + 1
            n = sum(tokens[i] for i in mb.sample_ids)
            weighted += n * mb.layout.sp
            total += n
            recomputing += bool(mb.layout.recompute.attn or mb.layout.recompute.mlp)
            count += 1
    out = {
        "sp_mean_per_token": round(weighted / total, 3) if total else 0.0,
        "recompute_share": round(recomputing / count, 4) if count else 0.0,
    }
    return {**out, "ring_splits": rings} if rings else out


def ring_words(policies: dict[str, dict]) -> str | None:
    """One line on the policies whose plans ran micro-batches under ring attention: how many
    at each split ("dcp ran 5 micro-batches at SP 64 = 8u×8r, ..."); None where none did."""
    runs = [
        f"{k} ran " + ", ".join(f"{n} micro-batch{'es' * (n != 1)} at {w}" for w, n in v["ring_splits"].items())
        for k, v in policies.items()
        if v.get("ring_splits")
    ]
    return "ring attention: " + "; ".join(runs) if runs else None


def layout_words(policy: str, settings: dict) -> str:
    """A policy's settings as a phrase: the static ones' SP degree and recompute mode, the
    rest chosen per step."""
    if "sp" in settings and "recompute" in settings:
        words = f"SP {settings['sp']} for every sample, recompute {settings['recompute']}"
        if "capacity_tokens" in settings:
            words += f", bins of {settings['capacity_tokens']:,} tokens"
        return words
    if policy == "dcp" or policy.startswith("dcp-"):
        return "chosen per step: SP degree per sample, micro-batches per group, recompute per micro-batch"
    return ", ".join(f"{k} {v}" for k, v in settings.items() if k != "tried_s") or "-"


def verdict(policies: dict[str, dict]) -> str | None:
    """One line on `dcp` against the best static layout that ran (None unless both ran)."""
    static = [k for k in STATIC if k in policies]
    if "dcp" not in policies or not static:
        return None
    best = min(static, key=lambda k: policies[k]["epoch_time_s"])
    d, s = policies["dcp"], policies[best]
    ratio = s["epoch_time_s"] / d["epoch_time_s"] if d["epoch_time_s"] else float("nan")
    why = (
        f"its tokens ran at SP {d['sp_mean_per_token']:.1f} on average against {s['sp_mean_per_token']:.1f}, "
        f"{100 * d['recompute_share']:.0f}% of its micro-batches recompute against "
        f"{100 * s['recompute_share']:.0f}%, and ranks sat idle {100 * d['idle_fraction']:.1f}% of the time "
        f"against {100 * s['idle_fraction']:.1f}%"
    )
    where = f"the best static layout here ({best}: {layout_words(best, s['settings'])})"
    if ratio >= 1.005:
        return f"dcp: {ratio:.2f}x faster than {where}, because {why}"
    return f"dcp: not faster than {where} ({ratio:.2f}x): {why}; one layout suits these samples"
