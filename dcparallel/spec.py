"""What the planner reasons about: samples, models, layouts and clusters (plain data, no torch).

The geometry of groups on a cluster (allowed SP sizes, tilings) is `dcparallel.topology`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Union

from dcparallel.vision_spec import VisionSize, VisionTower

#: A sample's size as known before loading: a token count (text; a `VisionSize` for a
#: vision-language sample) or a video shape ``(frames, height, width)`` in pixels, turned
#: into tokens by `ModelSpec.tokens`.
Size = Union[int, tuple[int, int, int]]

AttentionPattern = Literal["causal", "full", "factorized"]

#: The whole-model recompute settings, by name — the one table the planners, the profiler,
#: the cost models and the adapters share. A setting recomputes the named part of every
#: layer: "attn" the attention sub-block, "mlp" the MLP, "full" the whole block.
StaticMode = Literal["none", "attn", "mlp", "full"]
STATIC_MODES: tuple[StaticMode, ...] = ("none", "attn", "mlp", "full")

GiB = 1024**3


def check_size(size: Size, index: int | None = None) -> Size:
    """Validates one sample size and returns it in canonical form (int or 3-tuple of ints)."""
    where = "" if index is None else f"sample {index}: "
    if isinstance(size, (tuple, list)):
        if len(size) != 3:
            raise ValueError(
                f"{where}a video size is (frames, height, width); got {tuple(size)!r} with {len(size)} values"
            )
        out = []
        for v in size:
            if isinstance(v, bool) or int(v) != v or int(v) <= 0:
                raise ValueError(f"{where}video size {tuple(size)!r} must be three positive integers")
            out.append(int(v))
        return tuple(out)  # type: ignore[return-value]
    if isinstance(size, bool) or not float(size).is_integer() or int(size) <= 0:
        raise ValueError(f"{where}a text size is a positive integer token count; got {size!r}")
    return size if isinstance(size, VisionSize) else int(size)


@dataclass(frozen=True, slots=True, order=True)
class Recompute:
    """How many of the model's layers recompute each sub-block kind in backward.

    ``attn=0, mlp=0`` keeps every activation; ``attn=mlp=num_layers`` is full recomputation.
    The runtime recomputes the sub-block in layers ``0 .. attn-1`` (resp. ``mlp-1``).
    """

    attn: int = 0
    mlp: int = 0

    @staticmethod
    def none() -> Recompute:
        return Recompute(0, 0)

    @staticmethod
    def full(num_layers: int) -> Recompute:
        return Recompute(num_layers, num_layers)

    @staticmethod
    def static(mode: str, num_layers: int) -> Recompute:
        """The counts of a whole-model setting of `STATIC_MODES` on `num_layers` layers."""
        if mode not in STATIC_MODES:
            raise ValueError(f"recompute setting {mode!r} is not one of {list(STATIC_MODES)}")
        L = num_layers
        return Recompute(L if mode in ("attn", "full") else 0, L if mode in ("mlp", "full") else 0)

    def is_full(self, num_layers: int) -> bool:
        return self.attn >= num_layers and self.mlp >= num_layers

    def describe(self, num_layers: int) -> str:
        if self.attn == 0 and self.mlp == 0:
            return "none"
        if self.is_full(num_layers):
            return "full"
        return f"attn{self.attn}+mlp{self.mlp}"


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """How one micro-batch runs: on a group of `sp` ranks, `mbs` samples, `recompute`, and
    the group's split into Ulysses degree ``sp // ring`` inside ring degree `ring`."""

    sp: int
    mbs: int
    recompute: Recompute = Recompute()
    #: ring-attention degree r (dividing sp): K/V blocks pass between r sub-groups of
    #: sp / r Ulysses ranks (`runtime.ring`); 1 = Ulysses over the whole group
    ring: int = 1

    def __post_init__(self) -> None:
        if self.sp < 1 or self.mbs < 1:
            raise ValueError(f"Layout needs sp >= 1 and mbs >= 1; got sp={self.sp}, mbs={self.mbs}")
        if self.ring < 1 or self.sp % self.ring:
            raise ValueError(
                f"Layout ring degree {self.ring} must divide sp={self.sp}; use a divisor of sp (1 = Ulysses only)"
            )
        if self.recompute.attn < 0 or self.recompute.mlp < 0:
            raise ValueError(f"recompute counts must be >= 0; got {self.recompute}")

    @property
    def ulysses(self) -> int:
        """The Ulysses degree u = sp / ring: the ranks that split the heads."""
        return self.sp // self.ring

    def sp_words(self) -> str:
        """The SP degree and its split: "SP 64 = 8u×8r" (Ulysses u x ring r), "SP 8" without ring."""
        return f"SP {self.sp} = {self.ulysses}u×{self.ring}r" if self.ring > 1 else f"SP {self.sp}"

    def to_json(self) -> dict:
        out = {"sp": self.sp, "mbs": self.mbs, "recompute": {"attn": self.recompute.attn, "mlp": self.recompute.mlp}}
        if self.ring > 1:
            out["ring"] = self.ring
        return out

    @staticmethod
    def from_json(d: dict) -> Layout:
        r = d.get("recompute", {})
        return Layout(
            int(d["sp"]), int(d["mbs"]), Recompute(int(r.get("attn", 0)), int(r.get("mlp", 0))), int(d.get("ring", 1))
        )


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The transformer as the cost model sees it.

    ``attn_params`` / ``mlp_params`` / ``other_params`` are weights per layer that every
    token multiplies (forward FLOPs per token = 2 x params). For a video model one "layer"
    is the repeating unit (for STDiT: a spatial + temporal block pair).
    """

    name: str
    kind: Literal["text", "video"]
    num_layers: int
    hidden: int
    num_heads: int
    ffn_hidden: int
    attention: AttentionPattern
    attn_params: int
    mlp_params: int
    other_params: int = 0
    #: attention sub-blocks per layer (STDiT pair: spatial + temporal = 2)
    attn_per_layer: int = 1
    #: parameters outside the repeated layers (embeddings, head, ...)
    extra_params: int = 0
    vocab_size: int = 0
    #: cross-attention context tokens per sample (video: text tokens), 0 if none
    context_tokens: int = 0
    #: video patchify rule: latent frames = frames * t_num // t_den (1 for images),
    #: spatial tokens = ceil(h / spatial_patch) * ceil(w / spatial_patch)
    t_num: int = 5
    t_den: int = 17
    spatial_patch: int = 16
    bytes_per_value: int = 2
    #: key/value heads (grouped-query attention); 0 = as many as query heads
    num_kv_heads: int = 0
    #: parameters of the largest repeated block that a shard block gathers at once (a model
    #: whose blocks differ, e.g. dual- and single-stream); 0 = one layer's
    max_unit_params: int = 0
    #: query/key head size; 0 = hidden / num_heads
    head_dim: int = 0
    #: value head size (multi-head latent attention: unlike the query/key one); 0 = head_dim
    v_head_dim: int = 0
    #: parameters that do not train (``requires_grad=False``: a LoRA's base, a frozen encoder):
    #: stored, but with no gradient, no optimizer state and no weight-gradient compute
    frozen_params: int = 0
    #: fp32 parameters a forward under `torch.autocast` copies to 16 bits (`runtime.autocast`):
    #: 2 bytes each held through every micro-batch; 0: no autocast, or weights stored in 16 bits
    autocast_params: int = 0
    #: a vision-language model's vision tower, priced from `VisionSize.patches`; None: none
    vision: VisionTower | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def unit_params(self) -> int:
        """Parameters of the largest repeated unit gathered at once under parameter sharding."""
        return self.max_unit_params or (self.attn_params + self.mlp_params + self.other_params)

    @property
    def num_params(self) -> int:
        per_layer = self.attn_params + self.mlp_params + self.other_params
        return self.num_layers * per_layer + self.extra_params + (self.vision.num_params if self.vision else 0)

    @property
    def trainable_params(self) -> int:
        """Parameters with a gradient: what the gradient sync and the optimizer hold."""
        return self.num_params - self.frozen_params

    def latent_grid(self, size: Size) -> tuple[int, int]:
        """(latent frames T, spatial tokens S) of a sample; text is (1, tokens)."""
        if not isinstance(size, tuple):
            return 1, int(size)
        frames, height, width = size
        t = 1 if frames == 1 else max(1, frames * self.t_num // self.t_den)
        s = math.ceil(height / self.spatial_patch) * math.ceil(width / self.spatial_patch)
        return t, s

    def tokens(self, size: Size) -> int:
        t, s = self.latent_grid(size)
        return t * s

    def attention_pairs(self, size: Size) -> int:
        """Query x key pairs one attention sub-block computes for one sample (summed over
        the attention sub-blocks of a layer)."""
        t, s = self.latent_grid(size)
        n = t * s
        if self.attention == "causal":
            return n * (n + 1) // 2
        if self.attention == "full":
            return n * n
        return t * s * s + s * t * t  # spatial: per frame S x S; temporal: per position T x T


def llama_like(
    name: str, *, num_layers: int, hidden: int, num_heads: int, ffn_hidden: int, vocab_size: int
) -> ModelSpec:
    return ModelSpec(
        name=name,
        kind="text",
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        ffn_hidden=ffn_hidden,
        attention="causal",
        attn_params=4 * hidden * hidden,
        mlp_params=3 * hidden * ffn_hidden,
        extra_params=2 * vocab_size * hidden,
        vocab_size=vocab_size,
    )


def stdit_like(name: str, *, num_pairs: int, hidden: int, num_heads: int, context_tokens: int = 300) -> ModelSpec:
    """Open-Sora-1.2-like: per pair a spatial and a temporal block, each with self-attention,
    cross-attention to replicated text and a GELU MLP (ffn = 4 x hidden)."""
    d = hidden
    return ModelSpec(
        name=name,
        kind="video",
        num_layers=num_pairs,
        hidden=d,
        num_heads=num_heads,
        ffn_hidden=4 * d,
        attention="factorized",
        attn_per_layer=2,
        attn_params=2 * 4 * d * d,  # q, k, v, o of the two self-attentions
        mlp_params=2 * 2 * d * 4 * d,  # two MLPs
        other_params=2 * 2 * d * d,  # q, o of the two cross-attentions (per video token)
        extra_params=num_pairs * 2 * 2 * d * d,  # their k, v act on the text tokens only
        context_tokens=context_tokens,
    )


LLAMA_7B = llama_like("llama-7b", num_layers=32, hidden=4096, num_heads=32, ffn_hidden=11008, vocab_size=32000)
STDIT_1B = stdit_like("stdit-1.1b", num_pairs=28, hidden=1152, num_heads=16)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The machines a run plans for. Bandwidths are per GPU, one direction, bytes/s."""

    world_size: int
    gpus_per_node: int = 8
    #: usable device memory per GPU for model states + activations (bytes)
    memory_bytes: int = 128 * GiB
    intra_bw: float = 0.0
    intra_latency: float = 0.0
    inter_bw: float = 0.0
    inter_latency: float = 0.0
    name: str = "cluster"
    #: ranks per parameter-shard block: parameters and gradients are sharded (FSDP2) over
    #: aligned blocks of this many ranks (1 = every rank holds the whole model); SP groups are
    #: never smaller than a block (`topology`)
    shard_size: int = 1
    #: SP groups may run Ulysses x ring attention (`runtime.ring`): sizes need not divide the
    #: heads, and the planners price every (Ulysses, ring) split of a size and run each
    #: micro-batch at the one predicted fastest (`cost.ring`). False: Ulysses only
    ring: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {self.world_size}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1; got {self.gpus_per_node}")
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            raise ValueError(
                f"world_size {self.world_size} is not a whole number of nodes of "
                f"{self.gpus_per_node} GPUs; use a multiple of gpus_per_node"
            )
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0; got {self.memory_bytes}")
        check_shard_size(self.shard_size, self.world_size, self.gpus_per_node)

    def shard_sizes(self) -> list[int]:
        """Every shard size this cluster allows, ascending (`check_shard_size`)."""
        return [
            s
            for s in range(1, self.world_size + 1)
            if _shard_size_error(s, self.world_size, self.gpus_per_node) is None
        ]

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.gpus_per_node)

    def spans_nodes(self, sp: int) -> bool:
        """An aligned group of `sp` ranks crosses a node boundary iff it is larger than a node."""
        return sp > self.gpus_per_node


def _shard_size_error(shard_size: int, world_size: int, gpus_per_node: int) -> str | None:
    s, g = shard_size, gpus_per_node
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        return "a positive integer"
    if not ((g % s == 0 and s & (s - 1) == 0) or s % g == 0):
        return f"a power of two dividing the {g} GPUs per node, or a whole number of nodes"
    if world_size % s:
        return f"a divisor of the world size {world_size}"
    return None


def check_shard_size(shard_size: int, world_size: int, gpus_per_node: int) -> int:
    """Validates a parameter-shard block size: a power of two that divides a node, or a whole
    number of nodes, dividing the world (blocks of it tile the ranks). Returns it."""
    need = _shard_size_error(shard_size, world_size, gpus_per_node)
    if need is not None:
        ok = [s for s in range(1, world_size + 1) if _shard_size_error(s, world_size, gpus_per_node) is None]
        raise ValueError(
            f"shard_size={shard_size!r} must be {need} (world {world_size}, {gpus_per_node} GPUs "
            f"per node); use one of {ok}"
        )
    return shard_size


def h200_cluster(
    world_size: int = 32, gpus_per_node: int = 8, memory_bytes: int | None = None, shard_size: int = 1
) -> ClusterSpec:
    """H200 SXM nodes. Link speeds are datasheet assumptions (not measured here), derated to
    achievable bus bandwidth: NVLink 4 is 900 GB/s per GPU both directions together
    (450 GB/s one way), taken at 70% = 315 GB/s; one 400 Gb/s InfiniBand NIC per GPU is
    50 GB/s, taken at 80% = 40 GB/s. Usable memory: 128 GiB of the 139.8 GiB the card reports,
    the rest left for the CUDA context, communication buffers and allocator fragmentation."""
    return ClusterSpec(
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        memory_bytes=memory_bytes if memory_bytes is not None else 128 * GiB,
        intra_bw=0.7 * 450e9,
        intra_latency=10e-6,
        inter_bw=0.8 * 50e9,
        inter_latency=20e-6,
        name="h200",
        shard_size=shard_size,
    )


@dataclass(frozen=True)
class Workload:
    """The sizes of a dataset's samples, indexed by sample id, with their token counts."""

    model: ModelSpec
    sizes: tuple[Size, ...]
    tokens: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.sizes) == 0:
            raise ValueError("the dataset is empty: there is nothing to plan")
        sizes = tuple(check_size(s, i) for i, s in enumerate(self.sizes))
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "tokens", tuple(self.model.tokens(s) for s in sizes))

    def __len__(self) -> int:
        return len(self.sizes)


def batch_key(model: ModelSpec, size: Size) -> tuple[int, ...]:
    """The class of samples a micro-batch may hold together: text, the cost bucket
    (`bucket_key`: documents of any length pack into one row); video, the cost bucket and the
    exact latent grid (frames, patch rows, patch columns): same-shape samples stack as rows,
    so a 240x256 and a 256x256 clip never share a micro-batch."""
    key = bucket_key(model, size)
    if isinstance(size, VisionSize):  # and the class of its vision patches, all and the largest image's
        return (
            *key,
            *(int(math.floor(math.log(p) / math.log(1.25) + 1e-9)) for p in (sum(size.patches), max(size.patches))),
        )
    if not isinstance(size, tuple):
        return key
    frames, height, width = size
    t, _ = model.latent_grid(size)
    return (*key, t, math.ceil(height / model.spatial_patch), math.ceil(width / model.spatial_patch))


def bucket_key(model: ModelSpec, size: Size, ratio: float = 1.25) -> tuple[int, int]:
    """Cost class of a sample. Text: geometric token ranges `ratio` apart, i.e.
    floor(log_ratio(tokens)). Video: the latent grid (T, S), each axis in geometric ranges
    `ratio` apart (the standard Open-Sora buckets each get their own class)."""
    t, s = model.latent_grid(size)
    if not isinstance(size, tuple):
        return 0, int(math.floor(math.log(max(s, 1)) / math.log(ratio) + 1e-9))
    lr = math.log(ratio)
    return int(math.floor(math.log(t) / lr + 1e-9)), int(math.floor(math.log(s) / lr + 1e-9))


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that is at most the value: 1.50 GiB, 195 KiB, 900 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.{0 if v >= 100 else 1 if v >= 10 else 2}f} {unit}"
    return f"{n:.0f} B"
