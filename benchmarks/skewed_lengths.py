"""Write a skewed text lengths file for `dcparallel demo --lengths FILE`.

Token counts drawn from a log-normal (median 90 tokens, sigma 1.15: most samples short, a
heavy tail of long ones), rounded and clipped to 16..3000, one per line. The draw is seeded,
so the same command writes the same file:

    python benchmarks/skewed_lengths.py --out benchmarks/skewed600.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def skewed_lengths(
    n: int, seed: int, median: float = 90.0, sigma: float = 1.15, lo: int = 16, hi: int = 3000
) -> list[int]:
    rng = np.random.default_rng(seed)
    x = np.rint(rng.lognormal(np.log(median), sigma, n))
    return np.clip(x, lo, hi).astype(int).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/skewed600.txt")
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--seed", type=int, default=20261203)
    args = ap.parse_args()
    lengths = skewed_lengths(args.samples, args.seed)
    header = (
        f"# {args.samples} token counts, log-normal (median 90, sigma 1.15), clipped to 16..3000, "
        f"seed {args.seed}; written by benchmarks/skewed_lengths.py\n"
    )
    Path(args.out).write_text(header + "\n".join(map(str, lengths)) + "\n")
    print(
        f"{args.out}: {len(lengths)} samples, {sum(lengths)} tokens, max {max(lengths)}, "
        f"median {sorted(lengths)[len(lengths) // 2]}"
    )


if __name__ == "__main__":
    main()
