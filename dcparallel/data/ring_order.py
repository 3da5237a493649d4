"""Which columns of a padded row each rank of a Ulysses × ring SP group holds.

A group of k = u × r ranks (Ulysses degree u, ring degree r; `Layout.ring`) runs ring
attention between r sub-groups of u consecutive ranks. Causal attention is load-balanced by
the zigzag order: the padded row is cut into 2r equal chunks and ring block j holds chunks
j and 2r-1-j, so every block sees as many earlier keys as any other. Block j is spread over
the sub-group's u ranks in order: group slot ``j * u + i`` holds the i-th of u equal pieces
of block j, so the sub-group's Ulysses all-to-all (which gathers the sequence in rank
order) hands each of its ranks exactly block j, for its share of the heads.

With r = 1 this is the plain contiguous sharding (slot s holds columns s * L/k ...), the
layout of Ulysses alone. Pure python: the collation, the batch and the ring op agree here.
"""

from __future__ import annotations


def ring_padded_length(seq_len: int, sp: int, ring: int = 1) -> int:
    """The padded row length: a multiple of sp, and of 2 sp under ring (2r chunks, each
    cut into u pieces)."""
    unit = sp if ring == 1 else 2 * sp
    return -(-seq_len // unit) * unit


def block_columns(padded_len: int, ring: int, block: int) -> list[int]:
    """The columns of ring block ``block`` (0 <= block < ring), in the order its sub-group's
    all-to-all gathers them: chunk ``block`` then chunk ``2 ring - 1 - block``."""
    if ring == 1:
        return list(range(padded_len))
    if padded_len % (2 * ring):
        raise ValueError(
            f"a row of {padded_len} columns does not cut into 2 x {ring} equal chunks; pad it with ring_padded_length"
        )
    c = padded_len // (2 * ring)
    late = 2 * ring - 1 - block
    return list(range(block * c, (block + 1) * c)) + list(range(late * c, (late + 1) * c))


def shard_columns(padded_len: int, sp: int, ring: int, slot: int) -> list[int]:
    """The columns group slot ``slot`` holds (see the module docstring)."""
    u = sp // ring
    if ring < 1 or sp % ring or not 0 <= slot < sp:
        raise ValueError(
            f"slot {slot} of an SP group of {sp} ranks with ring degree {ring}: the ring degree must "
            f"divide sp and the slot lie in 0..{sp - 1}"
        )
    n = padded_len // sp
    j, i = divmod(slot, u)
    return block_columns(padded_len, ring, j)[i * n : (i + 1) * n]
